"""When an engine restarts without its drafter, and back (control.replacement), on plain
numbers: a restart pays only when what it saves over the expected rest of the load beats
its measured cost; short bursts never pay; no flapping."""

import pytest

from control.model import StepCostModel, plain_step_time_s
from control.replacement import ReplacementConfig, ReplacementState, decide_replacement, times_per_token_s

pytestmark = pytest.mark.unit

CONFIG = ReplacementConfig(min_gain=0.05, dwell_intervals=5, cost_margin=2.0, cooldown_intervals=20)


def run(state, intervals, *, other_wins=True, now=10.0, other=6.0, cost=20.0, interval_s=2.0):
    """Feed `intervals` identical intervals; the index of the first switch (or None) and the last state."""
    first = None
    for i in range(intervals):
        d, state = decide_replacement(state, CONFIG, interval_s=interval_s,
                                      other_faster_at_load=other_wins, time_per_token_now_s=now,
                                      time_per_token_other_s=other, switch_cost_s=cost)
        if d.switch and first is None:
            first = i
            assert "restart without speculation" in d.reason or "restart with speculation" in d.reason
    return first, state


def test_restart_comes_when_the_saving_over_the_load_so_far_beats_twice_the_cost():
    # 40% saved per token; the load is expected to last as long as it has: after n intervals
    # of 2 s, 0.4 * 2n s saved > 2 x 20 s once n > 50.
    first, state = run(ReplacementState(), 60)
    assert first == 50  # the 51st interval
    assert state.speculating is False


def test_a_dearer_restart_waits_longer_and_a_cheap_one_still_waits_for_the_dwell():
    assert run(ReplacementState(), 200, cost=60.0)[0] == 150
    assert run(ReplacementState(), 10, cost=0.0)[0] == CONFIG.dwell_intervals - 1


def test_short_bursts_never_restart():
    state = ReplacementState()
    for _ in range(10):  # 30 intervals of off-wanted, 1 interval not: the count starts over
        first, state = run(state, 30)
        assert first is None
        first, state = run(state, 1, other_wins=False)
    assert state.speculating and state.wanted_intervals == 0


def test_no_restart_for_a_small_saving_or_a_slower_engine():
    assert run(ReplacementState(), 500, other=9.8)[0] is None  # 2% < min_gain
    assert run(ReplacementState(), 500, other=12.0)[0] is None


def test_back_with_speculation_needs_the_cooldown_too():
    first, state = run(ReplacementState(), 51)
    assert first == 50 and not state.speculating  # switched in the last interval
    # Drafting pays again at once, and a lot: still held until the cooldown is over.
    d, state = decide_replacement(state, CONFIG, interval_s=2.0, other_faster_at_load=True,
                                  time_per_token_now_s=10.0, time_per_token_other_s=1.0, switch_cost_s=0.0)
    assert not d.switch
    switched_at = None
    for i in range(40):
        d, state = decide_replacement(state, CONFIG, interval_s=2.0, other_faster_at_load=True,
                                      time_per_token_now_s=10.0,
                                      time_per_token_other_s=1.0, switch_cost_s=0.0)
        if d.switch:
            switched_at = i
            break
    assert switched_at == CONFIG.cooldown_intervals - 1 and state.speculating and "with speculation" in d.reason


def test_bad_numbers_are_refused_by_name():
    with pytest.raises(ValueError, match="switch_cost_s"):
        decide_replacement(ReplacementState(), CONFIG, interval_s=2.0, other_faster_at_load=True,
                           time_per_token_now_s=1.0, time_per_token_other_s=1.0, switch_cost_s=-1.0)
    with pytest.raises(ValueError, match="dwell_intervals"):
        ReplacementConfig(dwell_intervals=0)


def test_per_token_times_charge_the_drafters_k0_pass_to_the_speculating_engine_only():
    cost = StepCostModel(fixed_s=0.008, per_token_s=0.0002, draft_pass_s=0.0006,
                         k0_draft_fixed_s=0.002, k0_draft_per_req_s=0.0002)
    spec0, plain = times_per_token_s(cost, (1.0, 1.0), (0.5, 0.3), 8, 0, 100.0)
    assert spec0 == pytest.approx(cost.step_time_s(8, 0, 800.0) / 8)
    assert plain == pytest.approx((cost.step_time_s(8, 0, 800.0) - 0.002 - 8 * 0.0002) / 8)
    assert plain_step_time_s(cost, 8, 800.0) < cost.step_time_s(8, 0, 800.0)
    spec2, _ = times_per_token_s(cost, (1.0, 1.0), (0.5, 0.3), 8, 2, 100.0)
    assert spec2 == pytest.approx(cost.step_time_s(8, 2, 800.0) / (8 * 1.8))


def test_drafter_k0_cost_is_fitted_from_side_by_side_ratios_in_the_calibrations_own_seconds():
    from control.calibration import StepMeasurement
    from tools.fit_calibration import fit_k0_draft_cost, k0_pairs

    cost = StepCostModel(fixed_s=0.008, per_token_s=0.0002, per_kv_token_s=1e-6, draft_pass_s=0.0006)

    def pairs(ratio, slowdown):  # measured on a machine `slowdown` x busier than the calibration's
        rows = []
        for b in (1, 2, 4, 8, 16):
            with_drafter = slowdown * cost.step_time_s(b, 0, 200.0 * b)
            rows += [StepMeasurement(b, 0, ratio * with_drafter, 200.0 * b, drafting="none"),
                     StepMeasurement(b, 0, with_drafter, 200.0 * b)]
        return k0_pairs(rows)

    half = fit_k0_draft_cost(cost, pairs(0.5, slowdown=3.0))
    for b in (1, 4, 16):
        assert plain_step_time_s(half, b, 200.0 * b) / cost.step_time_s(b, 0, 200.0 * b) == pytest.approx(0.5, abs=0.05)
    none = fit_k0_draft_cost(cost, pairs(1.0, slowdown=1.0))
    assert none.k0_draft_fixed_s == none.k0_draft_per_req_s == 0.0
    assert fit_k0_draft_cost(cost, []) == cost


def test_the_other_engine_must_deliver_more_over_the_load_as_it_ran():
    from control.replacement import load_times_per_token_s, other_engine_faster_at_load

    # One sample per interval: (K decided there, s/token speculating, s/token plain).
    drafting_loses = [(4, 2.0, 1.5), (4, 1.2, 1.0), (0, 1.1, 0.9)]
    assert other_engine_faster_at_load(True, drafting_loses)  # K>0 intervals count: the drafter is dear
    # The load's tokens/s is the mean of its intervals': 1/s per token averaged, not s averaged.
    assert load_times_per_token_s([(4, 1.0, 2.0), (4, 0.5, 0.5)]) == pytest.approx((2 / 3, 0.8))
    # Four intervals at a size where the plain engine wins by 25%, one dip to where drafting
    # wins by 10%: over the load the plain engine delivers more (a rule asking for a win at
    # every size seen would never restart a closed loop that dips between requests).
    dips = 4 * [(4, 1.0, 0.8)] + [(4, 0.9, 1.0)]
    assert other_engine_faster_at_load(True, dips)
    assert not other_engine_faster_at_load(True, [(4, 1.0, 0.8)] + 4 * [(4, 0.5, 1.0)])  # mostly where drafting wins
    # Back to speculating: the drafting engine must deliver more, and its table draft somewhere.
    assert other_engine_faster_at_load(False, [(4, 0.8, 0.9), (4, 0.5, 0.6)])
    assert other_engine_faster_at_load(False, [(4, 0.7, 1.0), (4, 0.7, 0.6)])
    assert not other_engine_faster_at_load(False, [(0, 0.8, 0.9), (0, 0.5, 0.6)])  # K=0 everywhere: nothing to come back for
    assert not other_engine_faster_at_load(False, [(4, 0.8, 0.9), (4, 0.7, 0.5)])
    assert not other_engine_faster_at_load(True, []) and not other_engine_faster_at_load(False, [])
    with pytest.raises(ValueError, match="at least one interval"):
        load_times_per_token_s([])
