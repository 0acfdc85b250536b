"""The profiling job's pure parts: which engine it starts, which repeat a point keeps,
and the fit it writes, with plain numbers (the engine run is in
tests/integration/test_profile_steps.py)."""

import pytest

from configs import load_config
from control.calibration import StepMeasurement
from control.model import StepCostModel
from tools.profile_report import measured_calibration, settled
from tools.profile_steps import Point, Window, plan_points, profile_config, summarize

pytestmark = pytest.mark.unit


def test_engine_starts_with_a_table_at_k_max_for_every_batch_size_and_no_controller():
    cfg = profile_config(load_config("tiny", ["engine.max_num_seqs=16"]), [1, 16], [0, 4])
    assert cfg.engine.spec.schedule == [(1, 16, 4)]
    assert cfg.engine.spec.controller is None


@pytest.mark.parametrize("overrides, batch_sizes, ks, message", [
    (["engine.spec={method: none}"], [1], [0], "spec.method='none'"),
    ([], [1], [0, 2, 5], r"runs K in \[0, 1, 2, 3, 4\] only"),  # none above the start-up K
    ([], [1, 64], [0, 4], "max_num_seqs=32"),
])
def test_a_grid_the_engine_cannot_run_is_refused_by_name(overrides, batch_sizes, ks, message):
    with pytest.raises(ValueError, match=message):
        profile_config(load_config("tiny", overrides), batch_sizes, ks)


@pytest.mark.parametrize("method", [[], ["engine.spec.method=eagle3", "engine.spec.head=artifacts/tiny/eagle3-head"]])
def test_p_eagle_and_eagle3_may_sweep_every_k(method):
    cfg = load_config("tiny", method)
    assert profile_config(cfg, [1], [0, 1, 2, 3, 4]).engine.spec.schedule == [(1, 32, 4)]


def test_long_context_adds_the_smallest_and_largest_k_at_every_batch_size():
    points = plan_points([1, 8], [0, 4], long_context=512)
    assert [p for p in points if p.variant == "long"] == [Point(1, 0, "long"), Point(1, 4, "long"),
                                                          Point(8, 0, "long"), Point(8, 4, "long")]
    assert all(p.variant == "workload" for p in plan_points([1, 8], [0, 4], long_context=0))


def test_a_point_keeps_the_mean_of_its_two_fastest_runs():
    windows = [Window(20, 0.40, 300.0, 0, ()), Window(25, 0.25, 310.0, 0, ()), Window(20, 2.0, 305.0, 0, ())]
    m = summarize(Point(4, 0), windows)
    assert m.step_time_s == pytest.approx(0.015) and m.num_steps == 45 and m.num_context_tokens == 305.0


def test_a_point_is_settled_when_its_two_fastest_runs_agree():
    assert settled([0.050, 0.0104, 0.010])  # one run slowed by other load: the others agree
    assert not settled([0.010, 0.013, 0.030])
    assert not settled([0.010])


TINY = load_config("tiny")


def _calibrate(measurements, context_varied):
    return measured_calibration(TINY, measurements, [[m.step_time_s] * 2 for m in measurements], name="t",
                                machine="a test machine", kv_capacity_tokens=18_000, acceptance_per_pos=[0.6, 0.3, 0.1, 0.05],
                                context_varied=context_varied, method="synthetic")


def test_fit_recovers_a_step_cost_and_reports_each_points_residual():
    truth = StepCostModel(fixed_s=5e-3, per_token_s=2e-4, per_kv_token_s=1e-6, draft_pass_s=3e-3,
                          draft_per_token_s=1e-4)
    measurements = [StepMeasurement(b, k, truth.step_time_s(b, k, ctx), ctx, num_steps=30)
                    for b in (1, 2, 4, 8, 16) for k in (0, 4) for ctx in (150.0 * b, 600.0 * b)]
    cal = _calibrate(measurements, context_varied=True)
    assert cal.status == "measured" and cal.name == "t"
    assert (cal.max_num_seqs, cal.max_num_speculative_tokens) == (TINY.engine.max_num_seqs, 4)
    assert cal.cost.coefficients() == pytest.approx(truth.coefficients(), rel=1e-4, abs=1e-12)
    assert cal.fit["rms_relative_residual"] < 1e-4 and len(cal.fit["residuals"]) == len(measurements)
    assert cal.fit["num_unsettled_points"] == 0
    # Without a second context length the KV cost is not identifiable and stays at 0.
    short = [m for m in measurements if m.num_context_tokens == 150.0 * m.batch_size]
    cal = _calibrate(short, context_varied=False)
    assert cal.cost.per_kv_token_s == 0 and "per_kv_token_s" in cal.fit["held_at_zero"]
