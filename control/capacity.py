"""Pool capacity at a latency target, and the replica count that demand needs.

Owns the replica half of the controller: given the K table in force, the measured
acceptance and the (measured-corrected) step-time grid, how many requests one replica can
serve while every request still streams at the target time per output token
(TPOT = T(B, K(B)) / τ(K(B))), and therefore how many replicas the requests now in the
system need. Scaling on this, rather than on raw queue length, means a workload whose
drafts are accepted less (or a K that had to drop) asks for more replicas at the same
queue, and one with high acceptance asks for fewer.

Knows nothing about Ray Serve or how replicas are started: it returns a number and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


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
