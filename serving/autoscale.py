"""Serve autoscaling on predicted capacity: how many engine replicas the requests need.

Why capacity and not queue length: how many requests one replica serves within the
latency target is not a constant. It is the largest batch whose time per output token,
T(B, K(B)) / τ(K(B)), still meets the target, so it falls when the workload's drafts are
accepted less (τ shrinks) or when the K in force had to drop. Serve's default rule keeps
`ongoing requests / target_ongoing_requests` replicas, a fixed number per replica: at the
same queue it runs too few replicas for a hard workload (every request misses the
target) and too many for an easy one. Here each replica reports the capacity its
speculation controller predicts (control.capacity), and the pool gets
ceil(requests / (capacity · target_utilization)) replicas, via
`control.capacity.target_replicas`.

Three parts:
- `autoscaling_stats`: what a replica returns from Serve's `record_autoscaling_stats`
  hook (plain floats under fixed keys); used by `EngineReplica` and by tests alike.
- `decide`: the decision, pure, on plain numbers: reports in, (replicas, dwell count,
  reason) out. Replicas that report no capacity (no controller configured, or nothing
  measured yet) leave the queue rule as fallback: ongoing requests / target_ongoing_requests.
- `CapacityPolicy`: the adapter Serve calls with an `AutoscalingContext` (a class policy,
  `autoscaling_config.policy`); it decides once per report interval, keeps its dwell count
  in Serve's `policy_state` and logs every decision with its reason. `autoscaling_config`
  builds the Serve settings that wire it in.

Knows nothing about vLLM or the engine, and imports no Ray: Serve pickles the policy into
its controller, and tests drive `decide` with plain numbers.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Hashable, Mapping, Sequence

from configs.schema import ServeConfig
from control.capacity import ReplicaCapacity, target_replicas

# A child of Serve's logger, so decisions land in the Serve controller's log.
log = logging.getLogger("ray.serve.peagle_autoscale")

REQUESTS_KEY = "peagle_requests_in_system"
CAPACITY_PREFIX = "peagle_capacity_"
CAPACITY_FIELDS = tuple(f.name for f in fields(ReplicaCapacity))

DECIDED_AT_KEY = "peagle_decided_at_s"
INTERVALS_BELOW_KEY = "peagle_intervals_below"


def autoscaling_stats(num_requests_in_system: float, capacity: Mapping[str, Any] | None) -> dict[str, float]:
    """A replica's report for Serve's `record_autoscaling_stats` hook. `capacity` is the
    controller's `ReplicaCapacity` as a dict (`Engine.spec_control_state()["capacity"]`),
    or None when the replica has no controller; capacity keys are then left out."""
    stats = {REQUESTS_KEY: float(num_requests_in_system)}
    if capacity and all(capacity.get(name) is not None for name in CAPACITY_FIELDS):
        stats.update({CAPACITY_PREFIX + name: float(capacity[name]) for name in CAPACITY_FIELDS})
    return stats


@dataclass(frozen=True)
class ReplicaReport:
    num_requests_in_system: float  # running + waiting at the engine
    capacity: ReplicaCapacity | None  # None: no controller, or nothing measured yet


@dataclass(frozen=True)
class ScalingSettings:
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float  # fallback: requests per replica when no capacity is known
    target_utilization: float  # fraction of a replica's capacity to fill before adding one
    scale_down_dwell_intervals: int  # decisions in a row that need fewer before scaling down


@dataclass(frozen=True)
class ScalingDecision:
    num_replicas: int
    intervals_below: int  # carried to the next decision (the scale-down dwell)
    reason: str


def reports_from_metrics(
    metrics: Mapping[str, Mapping[Hashable, float]], replicas: Sequence[Hashable]
) -> list[ReplicaReport]:
    """Per-replica reports from Serve's aggregated custom metrics ({metric: {replica: value}},
    each value averaged over the look-back window). A replica counts as measured only when
    all capacity fields are there and its batch size is at least 1."""
    reports = []
    for replica in replicas:
        values = {name: metrics.get(CAPACITY_PREFIX + name, {}).get(replica) for name in CAPACITY_FIELDS}
        capacity = None
        if all(v is not None for v in values.values()) and values["batch_size"] >= 1:
            capacity = ReplicaCapacity(
                batch_size=math.floor(values["batch_size"] + 1e-6),  # window mean: round down
                num_speculative_tokens=round(values["num_speculative_tokens"]),
                tokens_per_s=values["tokens_per_s"],
                tpot_s=values["tpot_s"],
                meets_target=values["meets_target"] >= 0.5,
            )
        reports.append(ReplicaReport(metrics.get(REQUESTS_KEY, {}).get(replica, 0.0), capacity))
    return reports


def pool_capacity(capacities: Sequence[ReplicaCapacity]) -> ReplicaCapacity:
    """What one replica of the pool serves: the mean over the replicas that measured it
    (a new replica is assumed to behave like the measured ones)."""
    n = len(capacities)
    return ReplicaCapacity(
        batch_size=max(1, math.floor(sum(c.batch_size for c in capacities) / n + 1e-6)),
        num_speculative_tokens=round(sum(c.num_speculative_tokens for c in capacities) / n),
        tokens_per_s=sum(c.tokens_per_s for c in capacities) / n,
        tpot_s=sum(c.tpot_s for c in capacities) / n,
        meets_target=all(c.meets_target for c in capacities),
    )


def decide(
    reports: Sequence[ReplicaReport],
    current_replicas: int,
    intervals_below: int,
    settings: ScalingSettings,
    num_requests_seen_by_serve: float = 0.0,
) -> ScalingDecision:
    """Replicas for the requests in the system. Requests = the larger of what the engines
    report and what Serve counts (requests at replicas plus those queued at handles, which
    no engine has seen yet). Scale up at once; scale down after the dwell."""
    reported = sum(r.num_requests_in_system for r in reports)
    num_requests = math.ceil(max(reported, num_requests_seen_by_serve) - 1e-6)
    measured = [r.capacity for r in reports if r.capacity is not None]
    if measured:
        target, below, reason = target_replicas(
            num_requests, pool_capacity(measured), current_replicas, intervals_below,
            target_utilization=settings.target_utilization,
            min_replicas=settings.min_replicas,
            max_replicas=settings.max_replicas,
            scale_down_dwell_intervals=settings.scale_down_dwell_intervals,
        )
        if len(measured) < len(reports):
            reason += f" (capacity measured on {len(measured)} of {len(reports)} replicas)"
        return ScalingDecision(target, below, reason)
    return _queue_rule(num_requests, current_replicas, intervals_below, settings)


def _queue_rule(
    num_requests: int, current: int, intervals_below: int, settings: ScalingSettings
) -> ScalingDecision:
    """Fallback when no replica reports capacity: Serve's default rule, with the same
    bounds and scale-down dwell as the capacity rule."""
    needed = math.ceil(num_requests / settings.target_ongoing_requests) if num_requests else 0
    needed = min(max(needed, settings.min_replicas), settings.max_replicas)
    why = (
        f"{num_requests} requests in system; no replica reports capacity (no speculation "
        f"controller, or not measured yet), so queue rule at {settings.target_ongoing_requests:g} "
        f"requests per replica: {needed} needed"
    )
    if needed > current:
        return ScalingDecision(needed, 0, f"scale up {current}->{needed}: {why}")
    if needed < current:
        intervals_below += 1
        if intervals_below >= settings.scale_down_dwell_intervals:
            return ScalingDecision(needed, 0, f"scale down {current}->{needed}: {why}")
        return ScalingDecision(current, intervals_below, f"hold {current} ({intervals_below}/"
                               f"{settings.scale_down_dwell_intervals} intervals below): {why}")
    return ScalingDecision(current, 0, f"hold {current}: {why}")


class CapacityPolicy:
    """Serve's custom autoscaling policy (`policy_function` = this class, settings as
    `policy_kwargs`). Serve calls it every control-loop tick (~0.1 s); it decides once per
    `decision_interval_s` (the replicas' report interval) and in between keeps the target.
    Its state (time of the last decision, dwell count) lives in `ctx.policy_state`."""

    def __init__(self, target_utilization: float, scale_down_delay_s: float, decision_interval_s: float):
        if not 0 < target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization!r}")
        if decision_interval_s <= 0 or scale_down_delay_s < 0:
            raise ValueError(f"need decision_interval_s > 0 and scale_down_delay_s >= 0, got "
                             f"{decision_interval_s!r}, {scale_down_delay_s!r}")
        self.target_utilization = target_utilization
        self.decision_interval_s = decision_interval_s
        self.scale_down_dwell_intervals = max(1, math.ceil(scale_down_delay_s / decision_interval_s))

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state)
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        decided_at_s = state.get(DECIDED_AT_KEY)
        if decided_at_s is not None and now_s - decided_at_s < self.decision_interval_s:
            return ctx.target_num_replicas, state
        settings = ScalingSettings(
            min_replicas=max(1, ctx.capacity_adjusted_min_replicas),
            max_replicas=max(1, ctx.capacity_adjusted_max_replicas),
            target_ongoing_requests=ctx.config.target_ongoing_requests,
            target_utilization=self.target_utilization,
            scale_down_dwell_intervals=self.scale_down_dwell_intervals,
        )
        reports = reports_from_metrics(ctx.aggregated_metrics or {}, ctx.running_replicas)
        decision = decide(reports, ctx.target_num_replicas, state.get(INTERVALS_BELOW_KEY, 0),
                          settings, num_requests_seen_by_serve=ctx.total_num_requests)
        log.info("autoscale %s/%s: %s", ctx.app_name, ctx.deployment_name, decision.reason)
        state[DECIDED_AT_KEY] = now_s
        state[INTERVALS_BELOW_KEY] = decision.intervals_below
        return decision.num_replicas, state


def autoscaling_config(serve_cfg: "ServeConfig", min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """Serve's `autoscaling_config` for capacity-based scaling between the bounds. The
    policy owns both delays (up at once, down after its dwell), so Serve's own delays are
    zero; replicas report every `autoscale_interval_s` and the metrics are averaged over
    two intervals. `target_ongoing_requests` stays for the fallback queue rule."""
    interval_s = serve_cfg.autoscale_interval_s
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "target_ongoing_requests": serve_cfg.target_ongoing_requests,
        "metrics_interval_s": interval_s,
        "look_back_period_s": 2 * interval_s,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {
            "policy_function": f"{CapacityPolicy.__module__}:{CapacityPolicy.__name__}",
            "policy_kwargs": {
                "target_utilization": serve_cfg.target_utilization,
                "scale_down_delay_s": serve_cfg.scale_down_delay_s,
                "decision_interval_s": interval_s,
            },
        },
    }
