"""Pool capacity at a latency target, and the replica count that demand needs.

Owns the replica half of the controller: given the K table in force, the measured
acceptance and the (measured-corrected) step-time grid, how many requests one replica can
serve while every request still streams at the target time per output token
(TPOT = T(B, K(B)) / τ(K(B))), and therefore how many replicas the requests now in the
system need. Scaling on this, rather than on raw queue length, means a workload whose
drafts are accepted less (or a K that had to drop) asks for more replicas at the same
queue, and one with high acceptance asks for fewer.

The batch half: what one engine kept full delivers (`full_engine_throughput`: no latency
target, the largest batch its KV cache holds, the best of the K it may run), and how many
engines a batch of work needs to finish within a deadline (`batch_pool_size`).

Knows nothing about Ray Serve or how replicas are started: it returns a number and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from control.model import StepCostModel, max_batch_size, plain_step_time_s, tokens_per_step


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica delivers at the latency target with the K table in force."""

    batch_size: int  # most concurrent requests that still meet the TPOT target
    num_speculative_tokens: int  # K the table uses at that batch size
    tokens_per_s: float  # output tokens/s of the replica at that batch size
    tpot_s: float  # time per output token each request sees there
    meets_target: bool  # False when even one request alone misses the target


def replica_capacity(
    step_time_grid_s: np.ndarray,
    tokens_per_step: Sequence[float],
    k_by_batch: Sequence[int],
    max_batch_size: int,
    target_tpot_s: float,
) -> ReplicaCapacity:
    """Largest B <= max_batch_size with T(B, K(B)) / τ(K(B)) <= target_tpot_s.

    `step_time_grid_s[B-1, K]` and `k_by_batch[B-1]` are dense over B = 1..len."""
    if target_tpot_s <= 0:
        raise ValueError(f"target_tpot_s must be > 0, got {target_tpot_s!r}")
    limit = max(1, min(max_batch_size, len(k_by_batch)))
    best = None
    for b in range(1, limit + 1):
        k = k_by_batch[b - 1]
        tpot = step_time_grid_s[b - 1, k] / tokens_per_step[k]
        if tpot <= target_tpot_s or b == 1:
            best = (b, k, tpot)
        if tpot > target_tpot_s:
            break
    b, k, tpot = best
    return ReplicaCapacity(b, k, b / tpot, tpot, tpot <= target_tpot_s)


def target_replicas(
    num_requests_in_system: int,
    capacity: ReplicaCapacity,
    current_replicas: int,
    intervals_below: int,
    *,
    target_utilization: float,
    min_replicas: int,
    max_replicas: int,
    scale_down_dwell_intervals: int,
) -> tuple[int, int, str]:
    """(target replicas, updated intervals_below, reason).

    Needed = ceil(requests / (capacity.batch_size · utilization)). Scale up at once;
    scale down only after `scale_down_dwell_intervals` intervals in a row that needed
    fewer replicas (a burst that ends should not cost a cold start on the next one)."""
    if not 0 < target_utilization <= 1:
        raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization!r}")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas!r}, {max_replicas!r}")
    per_replica = max(1.0, capacity.batch_size * target_utilization)
    needed = math.ceil(num_requests_in_system / per_replica) if num_requests_in_system else 0
    needed = min(max(needed, min_replicas), max_replicas)
    why = (
        f"{num_requests_in_system} requests in system; one replica serves "
        f"{capacity.batch_size} at TPOT {capacity.tpot_s * 1e3:.1f} ms with K={capacity.num_speculative_tokens} "
        f"({capacity.tokens_per_s:.0f} tok/s), so {needed} needed at {target_utilization:.0%} utilization"
    )
    if not capacity.meets_target:
        why += " (target TPOT unreachable even at batch 1)"
    if needed > current_replicas:
        return needed, 0, f"scale up {current_replicas}->{needed}: {why}"
    if needed < current_replicas:
        intervals_below += 1
        if intervals_below >= scale_down_dwell_intervals:
            return needed, 0, f"scale down {current_replicas}->{needed}: {why}"
        return current_replicas, intervals_below, (
            f"hold {current_replicas} ({intervals_below}/{scale_down_dwell_intervals} intervals below): {why}"
        )
    return current_replicas, 0, f"hold {current_replicas}: {why}"


@dataclass(frozen=True)
class EngineThroughput:
    """What one engine kept full of batch work delivers, on paper."""

    batch_size: int  # requests running at once: max_num_seqs, or fewer where the KV cache ends
    num_speculative_tokens: int  # K it runs at that batch size (0 on a plain engine)
    drafter: bool  # False: an engine started without speculation
    tokens_per_s: float  # output tokens/s
    step_s: float


def full_engine_throughput(
    cost: StepCostModel,
    acceptance_per_pos: Sequence[float],
    k_choices: Sequence[int],
    *,
    start_k: int,
    max_num_seqs: int,
    kv_capacity_tokens: int,
    num_context_tokens_per_req: float,
    plain_engine: bool,
) -> EngineThroughput:
    """The best of an engine started at `start_k` running each K in `k_choices` (a static
    preset: its one K; with the controller: 0..start_k), and of a plain engine where
    `plain_engine` allows one (no speculation configured, or the controller may restart
    without it), at the largest batch: `max_num_seqs`, fewer where `kv_capacity_tokens`
    (0 = unknown) cannot hold that many requests with their context and draft slots."""
    if not k_choices and not plain_engine:
        raise ValueError("nothing to run: no K to choose from and no plain engine")
    if any(not 0 <= k <= start_k for k in k_choices):
        raise ValueError(f"every K must be in 0..start_k={start_k}, got {list(k_choices)!r}")

    def batch(lookahead: int) -> int:
        if not kv_capacity_tokens:
            return max_num_seqs
        return max(1, max_batch_size(kv_capacity_tokens, num_context_tokens_per_req, lookahead, max_num_seqs))

    options = []
    b = batch(start_k)
    for k in k_choices:
        step = cost.step_time_s(b, k, b * num_context_tokens_per_req)
        options.append(EngineThroughput(b, k, True, b * tokens_per_step(acceptance_per_pos, k) / step, step))
    if plain_engine:
        pb = batch(0)
        step = plain_step_time_s(cost, pb, pb * num_context_tokens_per_req)
        options.append(EngineThroughput(pb, 0, False, pb / step, step))
    return max(options, key=lambda o: o.tokens_per_s)


def steady_state_vs_paper(
    output_tokens: int,
    prompt_tokens: int,
    generation_s: float,
    engine_tokens_per_s: float,
    prefill_s_per_token: float,
) -> dict[str, float | None]:
    """A finished run's steady state against the paper, start-up apart.

    Measured: output tokens over the engines' time generating (each engine's first to last
    output token, summed over engines; engine start-up and the job's set-up are outside
    it). Paper, for the same work: the decode at `engine_tokens_per_s` (one engine kept
    full) plus the prefill of the prompts the run actually had, each prompt token costing
    `prefill_s_per_token` (the calibration's per batched token). Both per engine."""
    if engine_tokens_per_s <= 0 or prefill_s_per_token < 0:
        raise ValueError(f"need engine_tokens_per_s > 0 and prefill_s_per_token >= 0, got "
                         f"{engine_tokens_per_s!r}, {prefill_s_per_token!r}")
    paper_s = output_tokens / engine_tokens_per_s + prompt_tokens * prefill_s_per_token
    paper = output_tokens / paper_s if paper_s > 0 else None
    measured = output_tokens / generation_s if generation_s > 0 else None
    return {"paper_tokens_per_s_with_prefill": paper,
            "measured_steady_engine_tokens_per_s": measured,
            "steady_vs_paper": measured / paper if measured and paper else None}


@dataclass(frozen=True)
class PoolSize:
    """Engines for a batch of work: the pool's bounds and what they are expected to take."""

    min_actors: int
    max_actors: int
    engines_needed: int | None  # for the deadline; None without one
    hours_at_max: float  # expected hours with max_actors engines running
    hours_at_min: float
    reason: str


def batch_pool_size(
    output_tokens: float,
    engine_tokens_per_s: float,
    *,
    min_actors: int,
    max_actors: int,
    deadline_s: float | None = None,
) -> PoolSize:
    """Bounds of the engine pool for `output_tokens` of work at `engine_tokens_per_s` each.

    Without a deadline the configured bounds stand. With one, the pool grows to the engines
    the deadline needs, ceil(work / (rate x deadline)), and no further: never above
    `max_actors` (then the deadline is missed and the reason says by how much), and
    `min_actors` never above the new max. Engine start-up is not in the estimate."""
    if engine_tokens_per_s <= 0:
        raise ValueError(f"engine_tokens_per_s must be > 0, got {engine_tokens_per_s!r}")
    if output_tokens < 0:
        raise ValueError(f"output_tokens must be >= 0, got {output_tokens!r}")
    if not 1 <= min_actors <= max_actors:
        raise ValueError(f"need 1 <= min_actors <= max_actors, got {min_actors!r}, {max_actors!r}")
    if deadline_s is not None and deadline_s <= 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")

    def hours(n: int) -> float:
        return output_tokens / (engine_tokens_per_s * n) / 3600.0

    work = f"{output_tokens:.3g} output tokens at {engine_tokens_per_s:.0f} tok/s per engine"
    if deadline_s is None:
        return PoolSize(min_actors, max_actors, None, hours(max_actors), hours(min_actors),
                        f"{work}: {duration(hours(max_actors))} on {max_actors} engine(s)")
    needed = max(1, math.ceil(output_tokens / (engine_tokens_per_s * deadline_s)))
    top = min(needed, max_actors)
    low = min(min_actors, top)
    deadline = duration(deadline_s / 3600.0)
    if needed > max_actors:
        why = (f"{work}: the {deadline} deadline needs {needed} engines but pool.max_actors is "
               f"{max_actors}: expect {duration(hours(max_actors))}")
    else:
        why = f"{work}: {needed} engine(s) finish within the {deadline} deadline ({duration(hours(top))})"
    return PoolSize(low, top, needed, hours(top), hours(low), why)


def duration(hours: float) -> str:
    """Hours as a person reads them: '2.5 h', '12 min', '40 s'."""
    if hours >= 1:
        return f"{hours:.3g} h"
    if hours * 60 >= 1:
        return f"{hours * 60:.3g} min"
    return f"{hours * 3600:.2g} s"
