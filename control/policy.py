"""The speculation controller: (signals, state, config) -> (decision, next state), pure.

Each control interval it
1. folds the replicas' per-position draft/accept counts into the acceptance estimate
   (control.acceptance) and their measured step times into two correction factors of the
   calibrated T(B, K): one for the non-speculative step T(B, 0), one for what speculation
   adds on top (T(B, K) - T(B, 0)); a uniform factor alone would never move the best K.
   Pool-wide, and per batch-size bucket where that bucket has been measured
   (control.step_time);
2. recomputes, for every batch size B = 1..max_num_seqs, the K in 0..K_max maximizing
   goodput 1 / (T(B, K)/(B·τ(K)) + J(B, K)), where J is the time per output token the
   replicas measured outside their decode steps (requests joining, their prefill;
   control.step_time.join_cost_grid) and B is capped by what the KV cache admits with
   the lookahead slots reserved per request;
3. applies hysteresis: a batch size's K changes only if the predicted gain exceeds
   `switch_min_gain`, and a change must be wanted `switch_dwell_intervals` intervals in
   a row before the latest proposal is put in force;
4. probes: positions beyond the K a replica runs at are never drafted, so their estimate
   goes stale. When some are, one replica (rotating) runs one interval at
   K + probe_depth_tokens: at once for a position never measured, otherwise as often as
   `probe_budget` (fraction of pool goodput) allows by the model's own prediction of
   what the probe costs. The other direction too: a batch-size bucket that drafts
   never measures its step without drafts, so it gets one-interval K=0 probes within
   half the budget, while its K=0 measurement is stale or rests on too few steps;
5. sizes the pool on predicted capacity at the latency target (control.capacity).

The output is what vLLM consumes: a batch-size -> K schedule per replica (`[[lo, hi, K]]`,
`num_speculative_tokens_per_batch_size`). The engine is started at K_max and per step
looks up K by its batch size, so load changes are followed within a step without the
controller; the controller keeps the table true to the measured workload.

Knows nothing about Ray, vLLM or torch, about how signals are gathered, or how a schedule
is applied; every decision carries a human-readable `reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from control.acceptance import NEVER_OBSERVED, AcceptanceEstimate, prior_estimate, update_estimate
from control.capacity import ReplicaCapacity, replica_capacity, target_replicas
from control.model import StepCostModel, max_batch_size, step_time_grid_s, tokens_per_step
from control.step_time import (
    batch_size_bucket, corrected_step_time_s, join_cost_grid, num_batch_size_buckets, update_join_cost,
    update_step_time_scale,
)

Schedule = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class StepTimeSample:
    """`num_steps` measured steps of one replica at one (batch size, K), averaged."""

    batch_size: int
    num_speculative_tokens: int
    num_steps: int
    mean_step_time_s: float
    mean_prefill_tokens: float = 0.0
    mean_context_tokens_per_req: float = 0.0


@dataclass(frozen=True)
class BusySample:
    """`num_steps` steps of one replica at one (batch size, K), every step it ran back to
    back (prefills and the steps where requests join included): their seconds and the
    output tokens they made."""

    batch_size: int
    num_speculative_tokens: int
    num_steps: int
    seconds: float
    output_tokens: int


@dataclass(frozen=True)
class ReplicaSignals:
    """One replica over the last control interval (counts are deltas, not totals)."""

    replica_id: str
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction 0..1
    num_drafts_per_pos: tuple[int, ...] = ()  # drafts that reached position i (K_step >= i)
    num_accepted_per_pos: tuple[int, ...] = ()
    step_samples: tuple[StepTimeSample, ...] = ()  # decode steps only
    mean_context_tokens_per_req: float = 0.0
    busy_samples: tuple[BusySample, ...] = ()  # every step as run


@dataclass(frozen=True)
class ControllerConfig:
    cost: StepCostModel  # calibrated T(B, K) of one replica
    max_num_speculative_tokens: int  # K_max: the engine's start-up num_speculative_tokens
    max_num_seqs: int  # engine's batch limit; the table covers B = 1..max_num_seqs
    kv_capacity_tokens: int  # KV slots of one replica
    acceptance_prior: tuple[float, ...]  # p_i before any measurement (generic workload)
    target_tpot_s: float  # latency target per output token, for capacity
    lookahead_follows_k: bool = False  # vLLM reserves K_max slots whatever the step's K
    # K values the engine can run; None = every K in 0..K_max. With CUDA graphs only the
    # start-up table's (configs.spec_k.allowed_k says why).
    allowed_k: tuple[int, ...] | None = None
    prior_drafts: float = 20.0  # weight of the prior, in drafts per position (a weak guess)
    acceptance_halflife_drafts: float = 1000.0  # forgetting: half weight after this many drafts
    min_fresh_drafts: int = 50  # drafts in an interval that make a position's estimate fresh
    switch_min_gain: float = 0.02  # change a batch size's K only for a larger predicted gain
    switch_dwell_intervals: int = 2  # intervals in a row that must want a change before it is made
    max_acceptance_age_intervals: int = 30  # older estimates are stale and get probed
    probe_depth_tokens: int = 4  # a probe drafts this many positions past the K in force
    # Most pool goodput probing may cost, as a fraction. Small on purpose: on the B200
    # calibration the most any policy gains over the best fixed K is 3-8% per trace
    # (benchmarks.controller_sim), so 1% spent exploring was a quarter of the gain.
    probe_budget: float = 0.005
    step_time_halflife_steps: float = 2000.0  # forgetting of the step-time correction
    # A batch-size bucket's own correction counts as this many steps against the pool-wide
    # one: a few intervals of measurements there and the bucket goes by its own.
    step_time_bucket_prior_steps: float = 50.0
    # A bucket with fewer K=0 steps measured than this is probed at the budget's pace
    # (below), not only once its measurement is stale: one interval measures a few dozen
    # steps at small batch sizes, too few to tell a 10% drafting cost from noise.
    base_step_min_steps: float = 100.0
    # Output tokens a (batch-size bucket, K) must have made before its cost outside the
    # decode steps counts (control.step_time.join_cost_grid).
    join_cost_min_tokens: float = 500.0
    default_context_tokens_per_req: float = 512.0  # when replicas report none
    target_utilization: float = 0.85  # fraction of capacity the pool is sized to run at
    min_replicas: int = 1
    max_replicas: int = 1
    scale_down_dwell_intervals: int = 10

    def __post_init__(self) -> None:
        if self.max_num_speculative_tokens < 1:
            raise ValueError(f"max_num_speculative_tokens must be >= 1, got {self.max_num_speculative_tokens!r}")
        if self.max_num_seqs < 1 or self.kv_capacity_tokens < 1:
            raise ValueError(f"max_num_seqs/kv_capacity_tokens must be >= 1, got "
                             f"{self.max_num_seqs!r}/{self.kv_capacity_tokens!r}")
        if not all(0.0 <= p <= 1.0 for p in self.acceptance_prior) or not self.acceptance_prior:
            raise ValueError(f"acceptance_prior must be probabilities, got {self.acceptance_prior!r}")
        if not 0 <= self.switch_min_gain < 1 or self.switch_dwell_intervals < 1:
            raise ValueError(f"need 0 <= switch_min_gain < 1 and switch_dwell_intervals >= 1, got "
                             f"{self.switch_min_gain!r}, {self.switch_dwell_intervals!r}")
        if self.allowed_k is not None and (0 not in self.allowed_k or not all(
                0 <= k <= self.max_num_speculative_tokens for k in self.allowed_k)):
            raise ValueError(f"allowed_k must contain 0 and lie in 0..{self.max_num_speculative_tokens}, "
                             f"got {self.allowed_k!r}")
        if not 0 < self.probe_budget < 1:
            raise ValueError(f"probe_budget must be in (0, 1), got {self.probe_budget!r}")


@dataclass(frozen=True)
class ControllerState:
    acceptance: AcceptanceEstimate
    k_by_batch: tuple[int, ...]  # dense table in force: k_by_batch[B-1]
    step_time_scale: tuple[float, float] = (1.0, 1.0)  # (base step, speculation overhead)
    # Decayed sums behind step_time_scale, each n-weighted: K=0 steps (count, measured,
    # predicted) and drafting steps (count, measured, predicted base part, predicted
    # speculation part); () until the first interval.
    step_time_sums: tuple[float, ...] = ()
    # The same per batch-size bucket (B = 1, 2, 3-4, 5-8, ...).
    step_time_sums_by_bucket: tuple[tuple[float, ...], ...] = ()
    # Per bucket and K: decayed (steps, seconds beyond the decode steps, output tokens) of
    # the steps as run (control.step_time.update_join_cost); () until the first interval.
    join_cost_sums: tuple[tuple[tuple[float, float, float], ...], ...] = ()
    pending_k_by_batch: tuple[int, ...] | None = None
    pending_intervals: int = 0
    intervals_since_probe: int = 0
    probe_cursor: int = 0
    # Per batch-size bucket (control.step_time): intervals since a K=0 step was last measured there.
    base_step_age_by_bucket: tuple[int, ...] = ()
    num_replicas: int = 1
    intervals_below: int = 0  # consecutive intervals that needed fewer replicas
    interval: int = 0


@dataclass(frozen=True)
class Decision:
    k_by_batch: tuple[int, ...]  # table in force, dense: index B-1
    schedule: Schedule  # the same as vLLM ranges
    schedules: Mapping[str, Schedule]  # per replica: the table in force, or a probe table
    probe_replica: str | None
    probe_num_speculative_tokens: int  # 0 when nobody probes
    target_replicas: int
    capacity: ReplicaCapacity
    acceptance_per_pos: tuple[float, ...]
    max_k_in_force: int  # largest K the table uses; an engine started at it reserves less KV
    changed: bool
    reason: str


def initial_state(config: ControllerConfig, num_replicas: int = 1) -> ControllerState:
    """The table the prior predicts, with no hysteresis, and a prior-only estimate."""
    est = prior_estimate(config.acceptance_prior, config.max_num_speculative_tokens, config.prior_drafts)
    ctx = config.default_context_tokens_per_req
    goodput = _goodput(config, *_step_times(config, est, np.ones((config.max_num_seqs, 2)), ctx), ctx, 0.0)
    table = tuple(int(k) for k in np.argmax(goodput, axis=1))
    return ControllerState(acceptance=est, k_by_batch=table, num_replicas=num_replicas)


def decide(
    signals: Sequence[ReplicaSignals], state: ControllerState, config: ControllerConfig
) -> tuple[Decision, ControllerState]:
    kmax = config.max_num_speculative_tokens
    drafts, accepted = np.zeros(kmax, dtype=np.int64), np.zeros(kmax, dtype=np.int64)
    for s in signals:
        n = min(kmax, len(s.num_drafts_per_pos))
        drafts[:n] += np.asarray(s.num_drafts_per_pos[:n], dtype=np.int64)
        accepted[:n] += np.asarray(s.num_accepted_per_pos[:n], dtype=np.int64)
    est = update_estimate(state.acceptance, drafts, accepted, config.acceptance_halflife_drafts,
                          config.min_fresh_drafts)
    scale, sums, bucket_sums, scale_by_b = update_step_time_scale(
        [m for s in signals for m in s.step_samples], state.step_time_scale, state.step_time_sums,
        state.step_time_sums_by_bucket, config.cost, config.max_num_seqs, config.step_time_halflife_steps,
        config.step_time_bucket_prior_steps)
    running = sum(s.num_running_reqs for s in signals)
    ctx = (sum(s.mean_context_tokens_per_req * s.num_running_reqs for s in signals) / running
           if running and any(s.mean_context_tokens_per_req for s in signals)
           else config.default_context_tokens_per_req)
    step_s, tau = _step_times(config, est, scale_by_b, ctx)
    b_col = np.arange(1, config.max_num_seqs + 1, dtype=float)[:, None]
    join_sums = update_join_cost([m for s in signals for m in s.busy_samples], state.join_cost_sums,
                                 step_s / (b_col * tau[None, :]), config.max_num_seqs, config.step_time_halflife_steps)
    join_s = join_cost_grid(join_sums, config.max_num_seqs, kmax, config.join_cost_min_tokens)
    goodput = _goodput(config, step_s, tau, ctx, join_s)

    # Best K per batch size, then hysteresis: keep a K unless the best beats it clearly.
    rows = np.arange(config.max_num_seqs)
    cur = np.asarray(state.k_by_batch)
    best = np.argmax(goodput, axis=1)
    gain = goodput[rows, best] / np.maximum(goodput[rows, cur], 1e-12)
    proposal = tuple(int(k) for k in np.where(gain > 1.0 + config.switch_min_gain, best, cur))
    table, pending, n_pending, changed = state.k_by_batch, None, 0, False
    if proposal != state.k_by_batch:
        # Dwell counts intervals in a row that wanted a change (the latest proposal wins):
        # noise that crosses the margin once does not move the table.
        n_pending = state.pending_intervals + 1
        if n_pending >= config.switch_dwell_intervals:
            table, changed, n_pending = proposal, True, 0
        else:
            pending = proposal
    reasons = [_describe_change(state.k_by_batch, proposal, gain, n_pending, config, changed)]
    if proposal != state.k_by_batch:
        reasons[0] += (f" (measured acceptance p1..p{kmax} = {' '.join(f'{p:.2f}' for p in est.acceptance_per_pos)}; "
                       f"step time x{scale[0]:.2f} base, x{scale[1]:.2f} speculation vs calibration)")

    # Probe positions that went stale beyond the K a replica is running at.
    in_force = schedule_from_table(table)
    schedules = {s.replica_id: in_force for s in signals}
    probe_replica, probe_k, since_probe, cursor = None, 0, state.intervals_since_probe + 1, state.probe_cursor
    num_buckets = num_batch_size_buckets(config.max_num_seqs)
    measured_base = {batch_size_bucket(m.batch_size, num_buckets) for s in signals for m in s.step_samples
                     if m.num_speculative_tokens == 0 and m.num_steps}
    base_ages = tuple(0 if j in measured_base else (a if a >= NEVER_OBSERVED else a + 1)
                      for j, a in enumerate(state.base_step_age_by_bucket or (NEVER_OBSERVED,) * num_buckets))
    active = sorted((s for s in signals if s.num_running_reqs > 0), key=lambda s: s.replica_id)
    if active:
        s = active[cursor % len(active)]
        b = min(s.num_running_reqs, config.max_num_seqs)
        k_op = table[b - 1]
        k_probe = _allowed_at_least(config, min(kmax, k_op + config.probe_depth_tokens))
        ages = [est.age_intervals[j - 1] for j in range(k_op + 1, k_probe + 1)]
        stale = [j for j, a in zip(range(k_op + 1, k_probe + 1), ages) if a > config.max_acceptance_age_intervals]
        cost = max(0.0, 1.0 - goodput[b - 1, k_probe] / max(goodput[b - 1, k_op], 1e-12))
        period = cost / (config.probe_budget * max(1, len(signals)))
        # A position never measured is explored soon (every other interval until the probe
        # has reported); refreshing one measured before is paced so that probing costs at
        # most probe_budget of pool goodput on average.
        never = any(a >= NEVER_OBSERVED for a in ages)
        if stale and since_probe >= (min(2.0, period) if never else period):
            probe_replica, probe_k, since_probe, cursor = s.replica_id, k_probe, 0, cursor + 1
            schedules[s.replica_id] = schedule_from_table(tuple(max(k, k_probe) for k in table))
            reasons.append(
                f"probe {s.replica_id}: K {k_op}->{k_probe} for one interval to refresh "
                f"p{stale[0]}..p{stale[-1]} (stale > {config.max_acceptance_age_intervals} intervals; "
                f"predicted cost {cost / max(1, len(signals)):.1%} of pool goodput this interval)")
        # The other direction: an engine that always drafts never measures a step without
        # drafts, so the base step time stays the calibration's and a wrong calibration
        # is never found out (the comparison with K=0 is then off by its error). Measure
        # it, per batch-size bucket as the corrections are, where it is stale or rests on
        # too few steps, within half the probe budget: paced by the predicted cost even
        # where never measured (where K=0 is predicted to lose much, the measurement would
        # have to be off by as much to change the choice; where the choice is close,
        # probes are cheap and come often until the bucket has its steps).
        elif k_op > 0:
            j = batch_size_bucket(b, num_buckets)
            base_age, base_steps = base_ages[j], bucket_sums[j][0]
            cost0 = max(0.0, 1.0 - goodput[b - 1, 0] / max(goodput[b - 1, k_op], 1e-12))
            period0 = 2.0 * cost0 / (config.probe_budget * max(1, len(signals)))
            why0 = ("never measured there" if base_age >= NEVER_OBSERVED
                    else f"{base_steps:.0f} steps measured there" if base_steps < config.base_step_min_steps
                    else f"{base_age} intervals old")
            if ((base_age > config.max_acceptance_age_intervals or base_steps < config.base_step_min_steps)
                    and since_probe >= period0):
                probe_replica, probe_k, since_probe, cursor = s.replica_id, 0, 0, cursor + 1
                # Counted as fresh: a probe that measured nothing (all steps prefilled) is
                # retried at the budget's pace, not every other interval.
                base_ages = base_ages[:j] + (0,) + base_ages[j + 1:]
                schedules[s.replica_id] = schedule_from_table((0,) * len(table))
                reasons.append(
                    f"probe {s.replica_id}: K {k_op}->0 for one interval to measure the step without "
                    f"drafts at batch size {b} ({why0}; "
                    f"predicted cost {cost0 / max(1, len(signals)):.1%} of pool goodput this interval)")

    # Replicas: capacity at the latency target with the table in force.
    b_adm = max_batch_size(config.kv_capacity_tokens, ctx, _lookahead(config, kmax), config.max_num_seqs)
    cap = replica_capacity(step_s, tau, table, b_adm, config.target_tpot_s)
    in_system = sum(s.num_running_reqs + s.num_waiting_reqs for s in signals)
    n_rep, below, why = target_replicas(
        in_system, cap, state.num_replicas, state.intervals_below,
        target_utilization=config.target_utilization, min_replicas=config.min_replicas,
        max_replicas=config.max_replicas, scale_down_dwell_intervals=config.scale_down_dwell_intervals)
    reasons.append(why)

    decision = Decision(
        k_by_batch=table, schedule=in_force, schedules=schedules, probe_replica=probe_replica,
        probe_num_speculative_tokens=probe_k, target_replicas=n_rep, capacity=cap,
        acceptance_per_pos=est.acceptance_per_pos, max_k_in_force=max(table), changed=changed,
        reason="; ".join(reasons))
    new_state = replace(
        state, acceptance=est, k_by_batch=table, step_time_scale=scale, step_time_sums=sums, step_time_sums_by_bucket=bucket_sums,
        join_cost_sums=join_sums,
        pending_k_by_batch=pending, pending_intervals=n_pending, intervals_since_probe=since_probe,
        probe_cursor=cursor, base_step_age_by_bucket=base_ages, num_replicas=n_rep, intervals_below=below, interval=state.interval + 1)
    return decision, new_state


def schedule_from_table(k_by_batch: Sequence[int]) -> Schedule:
    """Dense [K for B=1..N] -> vLLM ranges ((1, hi, K), ...), merging equal neighbours."""
    out: list[tuple[int, int, int]] = []
    for b, k in enumerate(k_by_batch, start=1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, int(k)))
    return tuple(out)


def dense_from_schedule(schedule: Sequence[Sequence[int]], max_num_seqs: int, max_k: int) -> list[int]:
    """vLLM's lookup, the inverse of `schedule_from_table`: K for B = 1..max_num_seqs (index
    B-1), gaps and tail carry the previous K forward, every K clamped to the engine's
    start-up K."""
    ranges = sorted((int(a), int(b), int(k)) for a, b, k in schedule)
    if not ranges or ranges[0][0] != 1:
        raise ValueError(f"a schedule's first range must start at batch size 1, got {schedule!r}")
    # The last range starting at or before B either holds B or ends before it (carry forward).
    return [min(max_k, [k for lo, _, k in ranges if lo <= b][-1]) for b in range(1, max_num_seqs + 1)]


def _allowed_at_least(config: ControllerConfig, k: int) -> int:
    """The smallest K the engine can run that is >= k (K_max if none)."""
    if config.allowed_k is None:
        return k
    return min((a for a in config.allowed_k if a >= k), default=config.max_num_speculative_tokens)


def _lookahead(config: ControllerConfig, k: int) -> int:
    return k if config.lookahead_follows_k else config.max_num_speculative_tokens


def _step_times(config: ControllerConfig, est: AcceptanceEstimate, scale_by_b: np.ndarray, ctx: float):
    """(corrected decode step time [B, K], τ [K]) for B = 1..max_num_seqs, with
    `scale_by_b[B-1]` = (base, speculation) correction factors at that batch size."""
    kmax = config.max_num_speculative_tokens
    raw = step_time_grid_s(config.cost, np.arange(1, config.max_num_seqs + 1, dtype=float), kmax, ctx)
    step_s = corrected_step_time_s(raw[:, :1], raw, scale_by_b[:, :1], scale_by_b[:, 1:2])
    tau = np.array([tokens_per_step(est.acceptance_per_pos, k) for k in range(kmax + 1)])
    return step_s, tau


def _goodput(config: ControllerConfig, step_s: np.ndarray, tau: np.ndarray, ctx: float, join_s) -> np.ndarray:
    """Goodput [B, K] for B = 1..max_num_seqs from `_step_times`, with `join_s` the seconds
    per output token outside the decode steps ([B, K] or a scalar). A batch size the KV
    cache cannot admit at K runs only the admissible batch."""
    kmax = config.max_num_speculative_tokens
    b = np.arange(1, config.max_num_seqs + 1, dtype=float)
    goodput = 1.0 / (step_s / (b[:, None] * tau[None, :]) + join_s)
    if config.allowed_k is not None:  # a K the engine cannot run is never chosen
        goodput[:, [k for k in range(kmax + 1) if k not in config.allowed_k]] = -np.inf
    for k in range(kmax + 1):
        cap = max_batch_size(config.kv_capacity_tokens, ctx, _lookahead(config, k), config.max_num_seqs)
        if cap < config.max_num_seqs:
            goodput[cap:, k] = goodput[cap - 1, k] if cap >= 1 else 0.0
    return goodput


def _describe_change(old, new, gain, n_pending, config: ControllerConfig, changed: bool) -> str:
    if new == tuple(old):
        return f"hold K table: within {config.switch_min_gain:.0%} of the best K at every batch size"
    parts, b = [], 0
    while b < len(new):
        if new[b] == old[b]:
            b += 1
            continue
        e = b
        while e + 1 < len(new) and (old[e + 1], new[e + 1]) == (old[b], new[b]):
            e += 1
        parts.append(f"B {b + 1}-{e + 1}: K {old[b]}->{new[b]} (+{(gain[b:e + 1].max() - 1):.1%} predicted)")
        b = e + 1
    what = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more ranges" if len(parts) > 4 else "")
    if changed:
        return f"K table changed: {what}"
    return f"K table change pending ({n_pending}/{config.switch_dwell_intervals} intervals): {what}"
