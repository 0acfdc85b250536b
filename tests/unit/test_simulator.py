"""The discrete-event simulator reproduces the model it is built on, and the controller
meets the issue's acceptance criteria in it (on a reduced, faster configuration)."""

import pytest

from benchmarks.sim.policies import FixedK, StaticTable
from benchmarks.sim.scenarios import (
    SWEEP_CONCURRENCY, best_fixed, chat_workload, code_workload, day_night_trace, load_trace,
    model_ceiling, phase_oracle, policy_lineup, run_sweep, run_trace, worst_case_trace,
)
from benchmarks.sim.simulator import Phase, PoolConfig, Workload, simulate
from control.calibration import load_calibration
from control.model import geometric_acceptance, goodput_tokens_per_s, tokens_per_step
from control.policy import dense_from_schedule
from tools.fit_calibration import MT_BENCH_ACCEPTANCE

pytestmark = pytest.mark.unit

B200 = load_calibration("b200-qwen3-coder-30b-a3b.json")
CODE = code_workload(B200)
CHAT = chat_workload()


class SpyK:
    """K by batch size from a table; records every interval's signals."""

    name, num_lookahead_tokens = "spy", 7

    def __init__(self, schedule):
        self.dense = dense_from_schedule(schedule, 256, 7)
        self.signals = []

    def start(self, replica_ids):
        pass

    def num_speculative_tokens(self, replica_id, batch_size):
        return self.dense[batch_size - 1]

    def on_interval(self, now_s, signals):
        self.signals.extend(signals)


def test_simulator_reproduces_tau_for_a_known_acceptance_vector():
    acc = (0.9, 0.7, 0.5, 0.35, 0.2)
    wl = Workload("known", acc, prompt_tokens=64, mean_output_tokens=2000, output_tokens_sigma=0.1)
    r = simulate(FixedK(5), [Phase(20.0, 16, wl)], PoolConfig(cost=B200.cost, seed=3))
    assert r.num_decode_req_steps > 20_000
    assert r.mean_tokens_per_step == pytest.approx(tokens_per_step(acc, 5), rel=0.01)


def test_steady_state_throughput_matches_the_goodput_model():
    wl = Workload("long", CODE.acceptance_per_pos, prompt_tokens=64, mean_output_tokens=4000, output_tokens_sigma=0.1)
    pool = PoolConfig(cost=B200.cost, step_time_noise=0.0, warmup_s=2.0, seed=1)
    r = simulate(FixedK(7), [Phase(20.0, 8, wl)], pool)
    ctx = 64 + 4000 / 2  # mean context over a request's life
    assert r.tokens_per_s == pytest.approx(goodput_tokens_per_s(B200.cost, wl.acceptance_per_pos, 8, 7, ctx), rel=0.03)


def test_signals_count_drafts_per_position_when_k_varies_by_batch_size():
    spy = SpyK([(1, 4, 7), (5, 256, 2)])  # K=7 only while the batch is small
    wl = Workload("w", geometric_acceptance(0.8, 7), prompt_tokens=32, mean_output_tokens=200)
    simulate(spy, [Phase(5.0, 2, wl), Phase(5.0, 12, wl)], PoolConfig(cost=B200.cost, seed=0))
    drafts = [sum(s.num_drafts_per_pos[i] for s in spy.signals) for i in range(7)]
    accepted = [sum(s.num_accepted_per_pos[i] for s in spy.signals) for i in range(7)]
    assert drafts[0] > drafts[2] > 0 and drafts[2] == drafts[6]  # positions 3..7 only at K=7
    for i, p in enumerate(geometric_acceptance(0.8, 7)):
        assert accepted[i] / drafts[i] == pytest.approx(p, abs=0.03)
    assert any(s.step_samples for s in spy.signals) and all(0 <= s.kv_cache_usage <= 1 for s in spy.signals)


def test_kv_limit_caps_the_batch_and_a_larger_start_up_k_admits_fewer():
    wl = Workload("w", geometric_acceptance(0.8, 11), prompt_tokens=20, mean_output_tokens=30, output_tokens_sigma=0.0)
    pool = PoolConfig(cost=B200.cost, kv_capacity_tokens=64 * 40, seed=0)

    def mean_batch(k):
        r = simulate(FixedK(k), [Phase(5.0, 128, wl)], pool)
        return sum(b for _, b, _, _ in r.timeline) / len(r.timeline)

    assert mean_batch(11) < 0.9 * mean_batch(1) < 0.9 * 128  # the KV cache, not the clients, limits B


def test_same_seed_same_result():
    a = simulate(FixedK(3), [Phase(3.0, 8, CODE)], PoolConfig(cost=B200.cost, seed=5))
    b = simulate(FixedK(3), [Phase(3.0, 8, CODE)], PoolConfig(cost=B200.cost, seed=5))
    assert a.num_output_tokens == b.num_output_tokens and a.timeline == b.timeline


def test_dense_schedule_carries_k_forward_over_gaps_like_vllm():
    dense = dense_from_schedule([(1, 16, 3), (32, 128, 2)], 200, 7)
    assert dense[0] == dense[15] == dense[16] == dense[30] == 3
    assert dense[31] == dense[199] == 2
    assert dense_from_schedule([(1, 4, 11)], 4, 7) == [7, 7, 7, 7]  # clamped to the engine's K


def test_static_table_is_the_best_k_per_batch_under_its_prior():
    t = StaticTable.tuned(B200.cost, MT_BENCH_ACCEPTANCE, 11, 256)
    assert t.num_speculative_tokens("r0", 1) > t.num_speculative_tokens("r0", 256)


@pytest.mark.slow
def test_controller_meets_the_issue_criteria_where_the_model_allows():
    """Criteria: >= 0.98x the best fixed K at every concurrency; >= 85% of the oracle's
    gain (best fixed K per phase) over the best single fixed K on a varying trace."""
    # Each policy runs on its own seeded simulation, so running only those the criteria
    # read gives them the same numbers as the whole line-up would.
    lineup = {make().name: make for make in policy_lineup(B200)}
    fixed_and_controller = [m for name, m in lineup.items() if name.startswith("fixed K=") or name == "controller"]
    sweep = run_sweep(B200, CODE, fixed_and_controller, SWEEP_CONCURRENCY, duration_s=10.0, warmup_s=2.0)
    for c in SWEEP_CONCURRENCY:
        _, best = best_fixed({p: v[c] for p, v in sweep.items()})
        assert sweep["controller"][c] >= 0.98 * best, (c, sweep["controller"][c], best)

    # Load only: the controller beats every fixed K and keeps most of the possible gain.
    policies = [lineup["vLLM static table"], lineup["controller"]]
    phases = load_trace(CODE, 8.0)
    res = {p: r.tokens_per_s for p, r in run_trace(B200, phases, policies).items()}
    oracle = phase_oracle(B200, phases)
    assert oracle.tokens_per_s > oracle.best_fixed_tokens_per_s  # there is something to win
    assert oracle.share_of_gain(res["controller"]) >= 0.85, (res["controller"], oracle)

    # Load + workload shift: the gain grows with what fixed K leaves on the table.
    phases = day_night_trace(CODE, CHAT, 8.0)
    res = {p: r.tokens_per_s for p, r in run_trace(B200, phases, policies).items()}
    oracle = phase_oracle(B200, phases)
    assert oracle.share_of_gain(res["controller"]) >= 0.85, (res["controller"], oracle)
    assert res["controller"] >= res["vLLM static table"]


def test_oracle_picks_the_best_k_per_phase_on_other_seeds():
    """Deep drafting at one request, shallow at many: the oracle switches, and its share
    arithmetic reads as 'what a policy kept of what there was to win'."""
    phases = [Phase(10.0, 1, CODE), Phase(10.0, 256, CODE)]
    oracle = phase_oracle(B200, phases)
    assert oracle.best_k_by_phase[0] > oracle.best_k_by_phase[1]
    assert oracle.tokens_per_s > oracle.best_fixed_tokens_per_s
    assert oracle.share_of_gain(oracle.best_fixed_tokens_per_s) == 0.0
    assert oracle.share_of_gain(oracle.tokens_per_s) == pytest.approx(1.0)


def test_worst_case_trace_is_the_worst_mix_played_in_phases():
    phases = worst_case_trace(B200, [CODE, CHAT], total_s=100.0)
    assert sum(p.duration_s for p in phases) == pytest.approx(100.0)
    assert {p.workload.name for p in phases} <= {"code", "chat"}
    assert len({p.concurrency for p in phases}) >= 2  # a mix, not one steady load
    assert model_ceiling(B200, phases) > 1.05  # the model sees something to win on it
