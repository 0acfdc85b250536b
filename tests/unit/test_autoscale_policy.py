"""Serve autoscaling on predicted capacity (serving/autoscale.py), with plain numbers: the
pure decision, the metrics round trip, and the Serve adapter driven by a stand-in context."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from configs.schema import ServeConfig
from control.capacity import ReplicaCapacity
from serving.autoscale import (
    INTERVALS_BELOW_KEY, CapacityPolicy, ReplicaReport, ScalingSettings, autoscaling_config,
    autoscaling_stats, decide, reports_from_metrics,
)

pytestmark = pytest.mark.unit


def capacity(batch_size: int, k: int = 3, meets_target: bool = True) -> ReplicaCapacity:
    tpot_s = 0.02
    return ReplicaCapacity(batch_size, k, batch_size / tpot_s, tpot_s, meets_target)


def settings(**overrides) -> ScalingSettings:
    base = dict(min_replicas=1, max_replicas=8, target_ongoing_requests=16, target_utilization=1.0,
                scale_down_dwell_intervals=3)
    return ScalingSettings(**{**base, **overrides})


def test_same_queue_needs_more_replicas_when_capacity_is_lower():
    # 32 requests either way; drafts accepted less (or K dropped) -> 8 per replica, not 32.
    easy = decide([ReplicaReport(32, capacity(32, k=7))], 1, 0, settings())
    hard = decide([ReplicaReport(32, capacity(8, k=1))], 1, 0, settings())
    assert easy.num_replicas == 1 and "hold 1" in easy.reason
    assert hard.num_replicas == 4 and hard.reason.startswith("scale up 1->4")
    assert "K=1" in hard.reason


def test_utilization_leaves_headroom():
    full = decide([ReplicaReport(16, capacity(16))], 1, 0, settings(target_utilization=1.0))
    headroom = decide([ReplicaReport(16, capacity(16))], 1, 0, settings(target_utilization=0.5))
    assert (full.num_replicas, headroom.num_replicas) == (1, 2)


def test_requests_are_summed_over_replicas_and_serve_count_wins_when_larger():
    two = [ReplicaReport(10, capacity(8)), ReplicaReport(6, capacity(8))]
    assert decide(two, 2, 0, settings()).num_replicas == 2  # 16 / 8
    # 40 requests Serve sees (30 still queued at handles, no engine has them yet).
    assert decide(two, 2, 0, settings(), num_requests_seen_by_serve=40).num_replicas == 5


def test_pool_capacity_is_the_mean_of_measured_replicas_and_unmeasured_ones_are_named():
    reports = [ReplicaReport(12, capacity(4)), ReplicaReport(12, capacity(8)), ReplicaReport(0, None)]
    decision = decide(reports, 3, 0, settings())  # 24 requests / 6 per replica
    assert decision.num_replicas == 4
    assert "capacity measured on 2 of 3 replicas" in decision.reason


def test_without_capacity_the_queue_rule_decides():
    reports = [ReplicaReport(40, None), ReplicaReport(10, None)]
    decision = decide(reports, 2, 0, settings(target_ongoing_requests=16))
    assert decision.num_replicas == 4  # ceil(50 / 16)
    assert decision.reason.startswith("scale up 2->4") and "no replica reports capacity" in decision.reason


@pytest.mark.parametrize("cap", [capacity(4), None], ids=["capacity", "queue-rule"])
def test_scale_down_waits_for_the_dwell_and_a_busy_interval_resets_it(cap):
    rules = settings(scale_down_dwell_intervals=3, target_ongoing_requests=4)
    idle = [ReplicaReport(0, cap)]
    busy = [ReplicaReport(12, cap)]
    below = 0
    for i in (1, 2):
        decision = decide(idle, 3, below, rules)
        assert decision.num_replicas == 3 and f"{i}/3 intervals below" in decision.reason
        below = decision.intervals_below
    decision = decide(busy, 3, below, rules)  # load is back: the dwell starts over
    assert (decision.num_replicas, decision.intervals_below) == (3, 0)
    below = 0
    for _ in range(2):
        below = decide(idle, 3, below, rules).intervals_below
    decision = decide(idle, 3, below, rules)
    assert decision.num_replicas == 1 and decision.reason.startswith("scale down 3->1")


def test_scale_up_is_immediate():
    decision = decide([ReplicaReport(20, capacity(4))], 1, 2, settings())
    assert (decision.num_replicas, decision.intervals_below) == (5, 0)


@pytest.mark.parametrize("cap", [capacity(2), None], ids=["capacity", "queue-rule"])
def test_bounds_hold(cap):
    rules = settings(min_replicas=2, max_replicas=3, target_ongoing_requests=2, scale_down_dwell_intervals=1)
    assert decide([ReplicaReport(100, cap)], 2, 0, rules).num_replicas == 3
    assert decide([ReplicaReport(0, cap)], 3, 0, rules).num_replicas == 2


def test_unreachable_target_is_said():
    decision = decide([ReplicaReport(4, capacity(1, meets_target=False))], 1, 0, settings())
    assert decision.num_replicas == 4 and "unreachable" in decision.reason


def test_replica_stats_round_trip_through_serve_metrics():
    cap = capacity(6, k=5)
    stats = autoscaling_stats(9, vars(cap))
    assert all(isinstance(v, float) for v in stats.values())  # Serve accepts numbers only
    bare = autoscaling_stats(3, None)
    # Serve's aggregated_metrics: {metric: {replica: window mean}}.
    metrics: dict = {}
    for replica, s in (("r1", stats), ("r2", bare)):
        for name, value in s.items():
            metrics.setdefault(name, {})[replica] = value
    r1, r2, r3 = reports_from_metrics(metrics, ["r1", "r2", "r3"])
    assert r1 == ReplicaReport(9.0, cap)
    assert r2 == ReplicaReport(3.0, None)
    assert r3 == ReplicaReport(0.0, None)  # running, not reported yet


def test_partial_or_unmeasured_capacity_counts_as_none():
    assert autoscaling_stats(1, {"batch_size": 4}) == autoscaling_stats(1, None)
    metrics = {name: {"r": v} for name, v in autoscaling_stats(2, vars(capacity(4))).items()}
    metrics["peagle_capacity_batch_size"]["r"] = 0.0
    assert reports_from_metrics(metrics, ["r"])[0].capacity is None


def context(metrics, target, now_s, state=None, serve_requests=0.0):
    return SimpleNamespace(
        policy_state=state or {}, current_time=now_s, target_num_replicas=target,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        config=SimpleNamespace(target_ongoing_requests=100.0), aggregated_metrics=metrics,
        running_replicas=list(metrics.get("peagle_requests_in_system", {})),
        total_num_requests=serve_requests, app_name="peagle", deployment_name="EngineReplica",
    )


def test_serve_adapter_decides_once_per_interval_and_keeps_dwell_in_policy_state():
    policy = CapacityPolicy(target_utilization=1.0, scale_down_delay_s=2.0, decision_interval_s=1.0)
    assert policy.scale_down_dwell_intervals == 2
    loaded = {name: {"r1": v} for name, v in autoscaling_stats(12, vars(capacity(4))).items()}
    idle = {name: {"r1": v} for name, v in autoscaling_stats(0, vars(capacity(4))).items()}

    target, state = policy(context(loaded, 1, now_s=100.0))
    assert target == 3
    # Within the interval the target is kept, whatever the metrics say.
    assert policy(context(idle, 3, now_s=100.5, state=state))[0] == 3
    target, state = policy(context(idle, 3, now_s=101.0, state=state))
    assert target == 3 and state[INTERVALS_BELOW_KEY] == 1
    target, state = policy(context(idle, 3, now_s=102.0, state=state))
    assert target == 1 and state[INTERVALS_BELOW_KEY] == 0


def test_serve_config_wires_the_capacity_policy():
    cfg = ServeConfig(target_utilization=0.5, scale_down_delay_s=30, autoscale_interval_s=2,
                      target_ongoing_requests=8)
    config = autoscaling_config(cfg, 1, 4)
    assert config["policy"]["policy_function"] == "serving.autoscale:CapacityPolicy"
    assert config["policy"]["policy_kwargs"] == {
        "target_utilization": 0.5, "scale_down_delay_s": 30, "decision_interval_s": 2}
    assert (config["min_replicas"], config["max_replicas"], config["target_ongoing_requests"]) == (1, 4, 8)
    assert config["upscale_delay_s"] == config["downscale_delay_s"] == 0  # the policy owns both
    assert config["look_back_period_s"] > config["metrics_interval_s"]


def test_autoscale_module_imports_neither_ray_nor_vllm():
    code = ("import sys, serving.autoscale; "
            "print(sorted(m for m in ('ray', 'vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
