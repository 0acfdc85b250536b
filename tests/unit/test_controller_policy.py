"""The speculation controller's pure parts: goodput model, acceptance estimate, policy,
capacity and calibration, driven with plain numbers (no Ray, no vLLM, no simulator)."""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from control.acceptance import prior_estimate, update_estimate
from control.calibration import SHIPPED_DIR, Calibration, StepMeasurement, load_calibration, save_calibration
from control.model import (
    StepCostModel, best_num_speculative_tokens, geometric_acceptance, goodput_tokens_per_s, max_batch_size,
    tokens_per_step,
)
from control.policy import (
    BusySample, ControllerConfig, ReplicaSignals, StepTimeSample, decide, dense_from_schedule, initial_state,
)
from control.step_time import join_cost_grid
from tools.fit_calibration import b200_qwen3_coder_calibration, fit_step_cost

pytestmark = pytest.mark.unit

B200 = load_calibration("b200-qwen3-coder-30b-a3b.json")
CODE = B200.acceptance_per_pos  # geometric 0.88, the calibration's HumanEval fit


def config(**overrides) -> ControllerConfig:
    base = ControllerConfig(cost=B200.cost, max_num_speculative_tokens=11, max_num_seqs=128,
                            kv_capacity_tokens=B200.kv_capacity_tokens, acceptance_prior=CODE,
                            target_tpot_s=0.02)
    return replace(base, **overrides)


def engine_window(decision, replica_id, batch_size, acceptance, num_steps, rng, num_waiting=0):
    """What an engine running `decision`'s schedule reports for one interval: K comes from
    the schedule at this batch size, drafts are accepted position by position."""
    k = dense_from_schedule(decision.schedules[replica_id], 128, 11)[batch_size - 1] if decision else 0
    n = batch_size * num_steps
    drafts, accepted = [0] * 11, [0] * 11
    alive = n
    p_prev = 1.0
    for i in range(k):
        alive = rng.binomial(alive, acceptance[i] / p_prev)
        p_prev = acceptance[i]
        drafts[i], accepted[i] = n, int(alive)
    return ReplicaSignals(replica_id, batch_size, num_waiting, 0.1, tuple(drafts), tuple(accepted))


# -- goodput model ----------------------------------------------------------------------

def test_tokens_per_step_counts_the_bonus_token_and_geometric_matches_closed_form():
    acc = geometric_acceptance(0.8, 7)
    assert tokens_per_step(acc, 0) == 1.0
    assert tokens_per_step(acc, 7) == pytest.approx((1 - 0.8**8) / (1 - 0.8))


def test_best_k_falls_as_the_batch_grows():
    ks = [best_num_speculative_tokens(B200.cost, CODE, b, 11, 512) for b in (1, 8, 32, 64, 128, 256)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] == 11 and ks[-1] <= 5


def test_parallel_drafting_cost_is_flat_in_k_and_sequential_grows():
    par = StepCostModel(fixed_s=1e-3, per_token_s=0.0, draft_pass_s=1e-3, drafting="parallel")
    seq = replace(par, drafting="sequential")
    assert par.step_time_s(1, 11) == par.step_time_s(1, 3)
    assert seq.step_time_s(1, 11) - seq.step_time_s(1, 3) == pytest.approx(8e-3)


def test_k_is_off_when_verification_is_compute_bound():
    compute_bound = StepCostModel(fixed_s=5e-3, per_token_s=1e-4, draft_pass_s=1e-3)
    cfg = config(cost=compute_bound, max_num_seqs=256, acceptance_prior=geometric_acceptance(0.7, 11))
    table = initial_state(cfg).k_by_batch
    assert table[0] > 0  # one request: the fixed cost dominates, drafting pays
    assert all(k == 0 for k in table[200:])  # verification is per token: drafting only costs


def test_kv_lookahead_shrinks_the_admissible_batch_and_pushes_k_down_when_kv_is_tight():
    assert max_batch_size(20_000, 100, 11, 1024) < max_batch_size(20_000, 100, 3, 1024)
    # Short contexts, so the lookahead is a large share of each request's KV.
    ample = config(lookahead_follows_k=True, default_context_tokens_per_req=16)
    tight = replace(ample, kv_capacity_tokens=128 * 20)  # 128 requests fit only at K <= 3
    assert initial_state(tight).k_by_batch[-1] < initial_state(ample).k_by_batch[-1]


# -- acceptance estimate ----------------------------------------------------------------

def test_acceptance_uses_drafts_that_reached_each_position_as_denominator():
    est = prior_estimate((0.5,) * 4, 4, prior_drafts=1e-9)
    # 100 drafts at K=4 and 300 at K=1: position 1 has 400 drafts, positions 2-4 have 100.
    est = update_estimate(est, (400, 100, 100, 100), (320, 60, 40, 20), halflife_drafts=1e9, min_fresh_drafts=1)
    assert est.acceptance_per_pos == pytest.approx((0.8, 0.6, 0.4, 0.2), abs=1e-6)


def test_unmeasured_positions_keep_their_value_and_age():
    est = prior_estimate(CODE, 11, prior_drafts=20)
    est = update_estimate(est, (100,) * 3 + (0,) * 8, (90, 80, 70) + (0,) * 8, 1000, 50)
    assert est.age_intervals[:3] == (0, 0, 0)
    assert est.acceptance_per_pos[5] == pytest.approx(CODE[5])
    assert all(a > 30 for a in est.age_intervals[3:])


# -- policy -----------------------------------------------------------------------------

def test_decision_schedule_is_a_valid_vllm_table_for_the_engine_config():
    from configs.schema import SpecConfig

    for method, allowed in [("eagle3", None), ("peagle", (0, 11))]:
        cfg = config(allowed_k=allowed)
        decision, _ = decide([ReplicaSignals("r0", 8, 0, 0.1)], initial_state(cfg), cfg)
        SpecConfig(method=method, head="h", num_speculative_tokens=11, schedule=[list(r) for r in decision.schedule])
        assert decision.schedule[0][0] == 1 and decision.schedule[-1][1] == 128
        assert dense_from_schedule(decision.schedule, 128, 11) == list(decision.k_by_batch)


def test_controller_chooses_and_probes_only_k_values_the_engine_can_run():
    # An engine that can run only some K (CUDA graphs: the start-up table's). The free optimum here uses K between.
    free = initial_state(config()).k_by_batch
    assert set(free) - {0, 11}
    cfg = config(allowed_k=(0, 11))
    state, rng, decision = initial_state(cfg), np.random.default_rng(0), None
    assert set(state.k_by_batch) <= {0, 11}
    seen = set()
    for _ in range(40):  # load that moves, and positions beyond the K in force go stale
        decision, state = decide([engine_window(decision, "r0", int(rng.integers(1, 128)), CODE, 40, rng)],
                                 state, replace(cfg, max_acceptance_age_intervals=2))
        seen |= {k for _, _, k in decision.schedules["r0"]}
    assert seen <= {0, 11}


def test_controller_learns_lower_acceptance_and_lowers_k_with_a_reason():
    cfg = config()
    state, rng = initial_state(cfg), np.random.default_rng(0)
    low = geometric_acceptance(0.55, 11)
    decision = None
    for _ in range(12):
        decision, state = decide([engine_window(decision, "r0", 16, low, 40, rng)], state, cfg)
        if decision.changed:
            break
    assert decision.changed and "K table changed" in decision.reason
    assert decision.k_by_batch[15] < initial_state(cfg).k_by_batch[15]
    assert decision.k_by_batch[15] == best_num_speculative_tokens(B200.cost, low, 16, 11, 512) or abs(
        goodput_tokens_per_s(B200.cost, low, 16, decision.k_by_batch[15], 512)
        / goodput_tokens_per_s(B200.cost, low, 16, best_num_speculative_tokens(B200.cost, low, 16, 11, 512), 512)
        - 1) < cfg.switch_min_gain


def test_hysteresis_prevents_flapping_on_noisy_acceptance():
    def count_changes(cfg):
        state, rng, decision, changes = initial_state(cfg), np.random.default_rng(1), None, 0
        for _ in range(200):
            # True acceptance fixed; only 4 steps per interval, so each window is noisy.
            decision, state = decide([engine_window(decision, "r0", 8, CODE, 4, rng)], state, cfg)
            changes += decision.changed
        return changes

    jittery = config(switch_min_gain=0.0, switch_dwell_intervals=1, acceptance_halflife_drafts=100)
    steady = config(acceptance_halflife_drafts=100)
    assert count_changes(jittery) > 20  # the noise is real: without hysteresis the table flaps
    assert count_changes(steady) <= 2


def test_probing_keeps_positions_beyond_current_k_fresh():
    """At B=128 the table runs K≈4, so positions 5+ are never drafted. The workload's
    deep acceptance improves; only probes can see it, and they must move K up."""
    cfg = config(max_acceptance_age_intervals=5)
    start = geometric_acceptance(0.7, 11)
    state = replace(initial_state(replace(cfg, acceptance_prior=start)))
    rng, decision = np.random.default_rng(2), None
    k0 = state.k_by_batch[127]
    better = tuple(start[:k0]) + tuple(start[k0 - 1] * 0.97**i for i in range(1, 12 - k0))
    probes = 0
    for _ in range(120):
        decision, state = decide([engine_window(decision, "r0", 128, better, 20, rng)], state, cfg)
        if decision.probe_replica and decision.probe_num_speculative_tokens == 0:
            assert "without drafts" in decision.reason  # the base step, measured at times
            continue
        probes += decision.probe_replica is not None
        if decision.probe_replica:
            assert decision.probe_num_speculative_tokens > decision.k_by_batch[127]
            assert "probe r0" in decision.reason
    assert 0 < probes < 60
    assert state.acceptance.acceptance_per_pos[k0 + 2] == pytest.approx(better[k0 + 2], abs=0.05)
    assert state.k_by_batch[127] > k0


def test_without_stale_positions_nobody_probes():
    cfg = config(max_acceptance_age_intervals=10**6)
    state = initial_state(cfg)
    state = replace(state, acceptance=replace(state.acceptance, age_intervals=(0,) * 11))
    decision, _ = decide([ReplicaSignals("r0", 128, 0, 0.5)], state, cfg)
    assert decision.probe_replica is None and decision.probe_num_speculative_tokens == 0


def test_measured_step_times_correct_the_calibration_and_lower_k():
    cfg = config()
    state = initial_state(cfg)
    k_before = sum(state.k_by_batch[15:64])
    costly = replace(B200.cost, spec_overhead_s=B200.cost.spec_overhead_s + 6e-3)  # speculation 6 ms dearer
    samples = tuple(StepTimeSample(32, k, 200, costly.step_time_s(32, k, 32 * 512), 0.0, 512.0) for k in (0, 4, 8))
    for _ in range(4):
        _, state = decide([ReplicaSignals("r0", 32, 0, 0.2, step_samples=samples)], state, cfg)
    assert state.step_time_scale[1] > 1.5 and state.step_time_scale[0] == pytest.approx(1.0, abs=0.1)
    assert sum(state.k_by_batch[15:64]) < k_before  # each extra draft now costs more


# -- replicas -----------------------------------------------------------------------------

def test_replicas_follow_capacity_at_the_latency_target_not_queue_length():
    cfg = config(max_replicas=64, target_tpot_s=0.004)
    signals = [ReplicaSignals(f"r{i}", 100, 50, 0.5) for i in range(4)]  # 600 requests in system
    high, _ = decide(signals, initial_state(cfg, 4), cfg)
    low_cfg = replace(cfg, acceptance_prior=geometric_acceptance(0.4, 11))
    low, _ = decide(signals, initial_state(low_cfg, 4), low_cfg)
    # Same queue, lower acceptance: each replica serves fewer requests at the target.
    assert low.capacity.batch_size < high.capacity.batch_size
    assert low.target_replicas > high.target_replicas > 4
    assert "scale up" in high.reason and "TPOT" in high.reason


def test_scale_down_waits_for_the_dwell():
    cfg = config(max_replicas=8, scale_down_dwell_intervals=3)
    state = initial_state(cfg, 8)
    targets = []
    for _ in range(4):
        decision, state = decide([ReplicaSignals("r0", 1, 0, 0.0)], state, cfg)
        targets.append(decision.target_replicas)
    assert targets == [8, 8, 1, 1]


# -- calibration ----------------------------------------------------------------------------

def test_fit_step_cost_recovers_known_coefficients():
    truth = StepCostModel(fixed_s=4e-3, per_token_s=2e-5, moe_weight_load_s=2e-3, moe_num_experts=128,
                          moe_experts_per_token=8, spec_overhead_s=5e-4, draft_pass_s=3e-4)
    meas = [StepMeasurement(b, k, replace(truth, drafting=d).step_time_s(b, k), drafting=d)
            for b in (1, 2, 4, 8, 32, 128) for k in (0, 3, 7, 11) for d in ("parallel", "sequential")]
    template = replace(truth, **{f: 0.0 for f in ("fixed_s", "per_token_s", "moe_weight_load_s",
                                                  "spec_overhead_s", "draft_pass_s")})
    fitted, residuals = fit_step_cost(template, meas, ("fixed_s", "per_token_s", "moe_weight_load_s",
                                                       "spec_overhead_s", "draft_pass_s"))
    assert max(abs(r) for r in residuals) < 1e-6
    assert fitted.coefficients() == pytest.approx(truth.coefficients(), rel=1e-4, abs=1e-12)


def test_shipped_b200_calibration_is_the_fit_of_the_published_table():
    cal, report = b200_qwen3_coder_calibration()
    assert cal.cost.coefficients() == pytest.approx(B200.cost.coefficients(), rel=1e-6)
    assert report["rms_relative_residual"] < 0.05 and report["max_abs_relative_residual"] < 0.10
    # Out of sample, the published +2% of P-EAGLE over EAGLE-3 at c=128 is reproduced.
    assert report["out_of_sample_check"]["peagle_best_over_eagle3_best_c128"] == pytest.approx(1.02, abs=0.02)


def test_calibration_round_trips_and_placeholder_is_refused(tmp_path):
    save_calibration(B200, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json") == B200
    placeholder = Calibration(name="new-hw", status="placeholder", source="not measured yet", cost=None)
    save_calibration(placeholder, tmp_path / "new-hw.json")
    with pytest.raises(ValueError, match="placeholder"):
        load_calibration(tmp_path / "new-hw.json")
    ph = load_calibration(tmp_path / "new-hw.json", allow_placeholder=True)
    assert ph == placeholder and ph.cost is None and ph.measurements == ()
    bad = json.loads((tmp_path / "c.json").read_text()) | {"status": "guessed"}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="'guessed'"):
        load_calibration(tmp_path / "bad.json")


def test_shipped_cpu_calibration_is_measured_and_its_fit_matches_its_measurements():
    cal = load_calibration("cpu-tiny.json")
    assert cal.status == "measured" and cal.measurements
    ks = {m.num_speculative_tokens for m in cal.measurements}
    assert 0 in ks and cal.max_num_speculative_tokens in ks
    assert len(cal.acceptance_per_pos) == cal.max_num_speculative_tokens
    for m, r in zip(cal.measurements, cal.fit["residuals"]):
        predicted = cal.cost.step_time_s(m.batch_size, m.num_speculative_tokens, m.num_context_tokens)
        assert predicted == pytest.approx(m.step_time_s * (1 + r["relative_residual"]), rel=1e-3)


def test_regenerating_on_paper_calibrations_leaves_measured_ones_alone(tmp_path):
    from tools.fit_calibration import main

    measured = (SHIPPED_DIR / "cpu-tiny.json").read_text()
    (tmp_path / "cpu-tiny.json").write_text(measured)
    main(["--out-dir", str(tmp_path)])
    assert (tmp_path / "cpu-tiny.json").read_text() == measured
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "b200-qwen3-coder-30b-a3b.json", "b200-qwen3-coder-30b-a3b.residuals.json", "cpu-tiny.json",
        "h100-llama31-8b.json"]


def test_control_package_imports_no_ray_vllm_or_torch():
    code = ("import sys, control.policy, benchmarks.sim.simulator, benchmarks.sim.policies, control.calibration, "
            "benchmarks.sim.scenarios, tools.fit_calibration; "
            "print(sorted(m for m in ('ray', 'vllm', 'torch', 'pydantic', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_drafting_steps_slower_than_calibrated_are_charged_to_speculation():
    # An engine that only drafts (K=11 everywhere) measures steps 2x the calibration. The
    # controller cannot tell a slow machine from dear drafting without K=0 steps; it must
    # not scale both (which would leave K unchanged), but charge drafting and lower K.
    cfg = config()
    state = initial_state(cfg)
    k = state.k_by_batch[31]
    assert k > 0
    slow = StepTimeSample(32, k, 300, 2.0 * B200.cost.step_time_s(32, k, 32 * 512), 0.0, 512.0)
    for _ in range(4):
        _, state = decide([ReplicaSignals("r0", 32, 0, 0.2, step_samples=(slow,))], state, cfg)
    assert state.step_time_scale[0] == pytest.approx(1.0)
    assert state.step_time_scale[1] > 1.5
    assert state.k_by_batch[31] < k


def test_an_engine_that_always_drafts_is_probed_at_k0_within_the_budget():
    cfg = config(probe_budget=0.2, max_acceptance_age_intervals=3)
    state, decision = initial_state(cfg), None
    drafting = StepTimeSample(8, state.k_by_batch[7], 100, B200.cost.step_time_s(8, state.k_by_batch[7]))
    probes = []
    for i in range(60):
        decision, state = decide([ReplicaSignals("r0", 8, 0, 0.1, step_samples=(drafting,))], state, cfg)
        if decision.probe_replica and decision.probe_num_speculative_tokens == 0:
            probes.append(i)
            assert decision.schedules["r0"] == ((1, 128, 0),) and "without drafts" in decision.reason
    assert probes, "the non-speculative step time was never measured"
    # Once K=0 steps are measured, the base is fresh and no K=0 probe follows for a while.
    base = StepTimeSample(8, 0, 100, B200.cost.step_time_s(8, 0))
    for _ in range(3):
        decision, state = decide([ReplicaSignals("r0", 8, 0, 0.1, step_samples=(drafting, base))], state, cfg)
        assert decision.probe_num_speculative_tokens != 0 or decision.probe_replica is None


def test_drafting_cost_is_re_read_once_the_base_step_is_measured():
    # The machine runs the base step 30% faster than calibrated and drafting costs what
    # the calibration says. An engine that starts drafting sees steps *faster* than
    # predicted and charges that to speculation (drafting looks nearly free). Once K=0
    # steps are measured, the drafting steps seen so far must be re-read against the true
    # base: speculation costs what it costs, at once, not after thousands more steps.
    cfg = config()
    state = initial_state(cfg)
    k = state.k_by_batch[31]
    base_s = 0.7 * B200.cost.step_time_s(32, 0, 32 * 512)
    extra_s = B200.cost.step_time_s(32, k, 32 * 512) - B200.cost.step_time_s(32, 0, 32 * 512)
    drafting = StepTimeSample(32, k, 2000, base_s + extra_s, 0.0, 512.0)
    for _ in range(5):
        _, state = decide([ReplicaSignals("r0", 32, 0, 0.2, step_samples=(drafting,))], state, cfg)
    assert state.step_time_scale[1] < 0.8  # charged to speculation while the base is unknown
    base = StepTimeSample(32, 0, 100, base_s, 0.0, 512.0)
    _, state = decide([ReplicaSignals("r0", 32, 0, 0.2, step_samples=(base,))], state, cfg)
    assert state.step_time_scale[0] == pytest.approx(0.7, abs=0.01)
    assert state.step_time_scale[1] == pytest.approx(1.0, abs=0.05)


def test_step_times_measured_at_one_batch_size_move_k_there_and_not_everywhere():
    # P-EAGLE on a small model: the calibration is right at B=1 but drafting costs 4x
    # what it predicts at B=16 (per-step costs it does not model). Both K=0 and K_max
    # steps were measured at each. K must turn 0 at B=16 and stay K_max at B=1: one
    # pool-wide factor would move both or neither.
    cfg = config(max_num_seqs=16, max_num_speculative_tokens=7, allowed_k=(0, 7),
                 acceptance_prior=geometric_acceptance(0.5, 7))
    state = initial_state(cfg)
    assert state.k_by_batch[0] == state.k_by_batch[15] == 7
    t = B200.cost.step_time_s
    dear = lambda b, k: t(b, 0, b * 512) + 4.0 * (t(b, k, b * 512) - t(b, 0, b * 512))  # noqa: E731
    samples = (StepTimeSample(1, 0, 100, t(1, 0, 512), 0.0, 512.0), StepTimeSample(1, 7, 300, t(1, 7, 512), 0.0, 512.0),
               StepTimeSample(16, 0, 100, t(16, 0, 16 * 512), 0.0, 512.0),
               StepTimeSample(16, 7, 300, dear(16, 7), 0.0, 512.0))
    for _ in range(6):
        _, state = decide([ReplicaSignals("r0", 8, 0, 0.2, step_samples=samples)], state, cfg)
    assert state.k_by_batch[0] == 7
    assert state.k_by_batch[15] == 0


def test_time_outside_the_decode_steps_moves_k_only_where_it_grows_with_k():
    # Decode steps exactly as calibrated at 8 running, where they say K=7. As run, steps
    # where requests join add time per output token, measured at K=0 and K=7. The same at
    # both (a prefill costs what it costs) leaves K alone; growing with K (on short
    # requests, more steps have a request joining, each dearer with drafts to verify), it
    # makes the table draft shallower, not stop.
    acc = geometric_acceptance(0.8, 7)
    cfg = config(max_num_seqs=16, max_num_speculative_tokens=7, acceptance_prior=acc, probe_budget=1e-9)
    start = initial_state(cfg)
    assert start.k_by_batch[7] == 7
    t = lambda k: B200.cost.step_time_s(8, k, 8 * 512)  # noqa: E731

    def k_at_8(join_s_at_k0: float, join_s_at_k7: float) -> int:
        state = start
        for _ in range(8):
            tokens = {k: round(200 * 8 * tokens_per_step(acc, k)) for k in (0, 7)}
            busy = tuple(BusySample(8, k, 200, 200 * t(k) + j * tokens[k], tokens[k])
                         for k, j in ((0, join_s_at_k0), (7, join_s_at_k7)))
            decode = (StepTimeSample(8, 0, 200, t(0), 0.0, 512.0), StepTimeSample(8, 7, 200, t(7), 0.0, 512.0))
            signals = ReplicaSignals("r0", 8, 0, 0.1, (10_000,) * 7, tuple(int(10_000 * p) for p in acc), decode,
                                     busy_samples=busy)
            _, state = decide([signals], state, cfg)
        return state.k_by_batch[7]

    assert k_at_8(0.0, 0.0) == 7
    assert k_at_8(1e-3, 1e-3) == 7  # 1 ms per token at every K: more than any decode step's, and K stays
    assert 0 < k_at_8(0.2e-3, 0.6e-3) < 7


def test_join_cost_grid_is_a_line_in_k_weighted_by_tokens_that_a_thin_cell_barely_moves():
    # Bucket 5-8: K=0 and K=4 measured at 0.1 and 0.5 ms/token (2,000 tokens each), K=2 too
    # thin to count (10 tokens), and K=1 measured briefly (500 tokens) at 2 ms/token, as
    # right after a table change. Bucket 1 measured only at K=3; the others not at all.
    def cell(extra_s_per_token, tokens):
        return (tokens / 8, extra_s_per_token * tokens, tokens)

    empty = tuple((0.0, 0.0, 0.0) for _ in range(8))
    b5_8 = list(empty)
    b5_8[0], b5_8[4], b5_8[2] = cell(1e-4, 2000), cell(5e-4, 2000), cell(5e-3, 10)
    b1 = list(empty)
    b1[3] = cell(3e-4, 1000)
    sums = (tuple(b1), empty, empty, tuple(b5_8), empty)
    grid = join_cost_grid(sums, 16, 7, 500)
    assert grid[8 - 1] == pytest.approx([1e-4 * (1 + k) for k in range(8)])  # the line through K=0 and K=4
    assert grid[5 - 1] == pytest.approx(grid[8 - 1])  # one bucket
    assert grid[0] == pytest.approx([3e-4] * 8)  # one K measured: the same at every K
    assert not grid[[1, 2, 3, *range(8, 16)]].any()  # not measured: nothing charged
    b5_8[1] = cell(2e-3, 500)  # the brief K=1 cell: 20x the line there, a ninth of the tokens
    with_brief = join_cost_grid((tuple(b1), empty, empty, tuple(b5_8), empty), 16, 7, 500)[8 - 1]
    assert with_brief[1] < 2.5 * grid[8 - 1][1] and with_brief[4] < 1.5 * grid[8 - 1][4]
    falling = list(empty)
    falling[0], falling[2] = cell(4e-4, 1000), cell(2e-4, 1000)
    assert join_cost_grid((empty, empty, empty, tuple(falling), empty), 16, 7, 500)[7, 4:] == pytest.approx(0.0)


def test_each_batch_size_bucket_measures_its_step_without_drafts():
    # Corrections are kept per batch-size bucket, so each bucket that drafts needs a K=0
    # measurement of its own (within the probe budget), and not again while it is fresh.
    cfg = config(probe_budget=0.5)
    state = initial_state(cfg)

    def window(b, with_base=False):
        k = state.k_by_batch[b - 1]
        samples = [StepTimeSample(b, k, 100, B200.cost.step_time_s(b, k, b * 512), 0.0, 512.0)]
        if with_base:
            samples.append(StepTimeSample(b, 0, 100, B200.cost.step_time_s(b, 0, b * 512), 0.0, 512.0))
        drafts = (1000,) * 11  # every position measured: no position probes in the way
        return [ReplicaSignals("r0", b, 0, 0.2, drafts, tuple(int(1000 * p) for p in CODE), tuple(samples))]

    def k0_probe_within(n, b, with_base=False):
        nonlocal state
        for _ in range(n):
            decision, state = decide(window(b, with_base), state, cfg)
            if decision.probe_replica and decision.probe_num_speculative_tokens == 0:
                assert f"at batch size {b}" in decision.reason and "never measured there" in decision.reason
                return True
        return False

    assert state.k_by_batch[7] > 0 and state.k_by_batch[63] > 0
    assert k0_probe_within(5, 8)
    assert not k0_probe_within(cfg.max_acceptance_age_intervals, 8, with_base=True)  # fresh there
    assert k0_probe_within(5, 64)  # a bucket never measured


def test_a_bucket_whose_k0_step_rests_on_few_steps_is_probed_before_it_goes_stale():
    # One K=0 interval at batch size 1 measures a few dozen steps, too few to tell a 10%
    # drafting cost from noise. Where the choice between drafting and not is close
    # (K=7 wins by ~3% at acceptance 0.3), the controller keeps probing K=0 there at the budget's
    # pace until the bucket has its steps, instead of waiting until it is stale; where
    # K=0 is predicted to lose much (high acceptance), it does not.
    def k0_probes(acceptance, intervals=12):
        cfg = config(max_num_seqs=16, max_num_speculative_tokens=7, allowed_k=(0, 7),
                     acceptance_prior=geometric_acceptance(acceptance, 7), probe_budget=0.05)
        state = initial_state(cfg)
        k = state.k_by_batch[0]
        assert k == 7
        t = lambda kk: B200.cost.step_time_s(1, kk, 512)  # noqa: E731
        drafts = (10_000,) * 7  # every position fresh: no acceptance probe in the way
        accepted = tuple(int(10_000 * p) for p in geometric_acceptance(acceptance, 7))
        probes, base_steps = [], 20  # one thin K=0 measurement already made
        for i in range(intervals):
            samples = [StepTimeSample(1, k, 30, t(k), 0.0, 512.0)]
            if i == 0 or (probes and probes[-1] == i - 1):
                samples.append(StepTimeSample(1, 0, base_steps, t(0), 0.0, 512.0))
            decision, state = decide([ReplicaSignals("r0", 1, 0, 0.1, drafts, accepted, tuple(samples))], state, cfg)
            if decision.probe_replica and decision.probe_num_speculative_tokens == 0:
                probes.append(i)
                assert "steps measured there" in decision.reason
        return probes, state

    close, state = k0_probes(0.3)
    assert len(close) >= 3  # measured again and again while thin, long before 30 intervals
    assert state.step_time_sums_by_bucket[0][0] >= 80
    assert k0_probes(0.9)[0] == []  # K=0 would cost much: the budget does not allow it
