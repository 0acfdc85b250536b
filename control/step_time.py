"""Step-time corrections: how far the measured steps of the running engines are from the
calibrated T(B, K), as two factors, pool-wide and per batch-size bucket.

A base factor comes from K=0 steps only, s0 = measured / predicted; a speculation factor
from drafting steps, on what remains after the base part, s1 = (measured - s0 * predicted
base) / predicted speculation part. Each side keeps decayed sums (forgetting counted in
its own steps, so a side nobody measures keeps its value), and s1 is recomputed from its
sums with the current s0 every interval. That matters: an engine that starts drafting
measures no K=0 step, its excess over the calibration is charged to speculation (a joint
fit would split it, which leaves K unchanged however dear drafting really is); once K=0
steps are measured, the drafting steps already seen are re-read against the true base
instead of keeping what was charged against the calibration's.

Per batch-size bucket (1, 2, 3-4, 5-8, ...) too: a calibration is rarely wrong by one
factor at every batch size (on the CPU tiny model the base step once ran at 0.74x the
calibration at B=1 and 0.62x at B=16). A bucket's factors are its own measurements pulled
towards the pool-wide ones by `bucket_prior_steps` pseudo-steps, so where a bucket has
run both K=0 and drafting steps, the choice between them there follows what was measured
there. Clamped to [0.2, 5]: a calibration off by more than 5x is wrong, not something to
track.

Beside the two factors, the time a load costs OUTSIDE the decode steps, per output token
and per K (`update_join_cost`, `join_cost_grid`): every step run back to back (the ones
where requests join, with their prefill, included) less what the corrected decode steps
predict for the tokens it made. It is kept apart from the factors on purpose. Where that
time is the same per output token at every K (a prefill costs what it costs), it leaves
the choice of K alone, whereas folded into the factors it would be charged to drafting in
proportion to the drafter's cost. Where it grows with K it moves the choice, and on short
requests it does: at 16 requests on the CPU default, over a third of K=3's steps had a
request joining, each at 2.3x a decode step's time, against 2-3% of a plain engine's
steps; the K=3 engine spent 0.6 ms per output token outside its decode steps, the
K=0 one 0.4 ms, and a choice of K from decode steps alone drafted too deep. Measured per
batch-size bucket and K (a bucket runs the K of its table and gets K=0 and deeper probes)
and charged along a line in K fitted to those, weighted by their output tokens, never
below 0: a K measured once, briefly, around a table change (where requests that joined
under the old K skew it) moves the line little, where joining the points one by one let
such a cell, never run again, mark its K as dear for good; 0 where a bucket has measured
none.

Pure numbers, like control.policy that uses it; knows nothing about how steps are timed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from control.model import StepCostModel

# One row of sums, each n-weighted: K=0 steps (count, measured s, predicted s) and
# drafting steps (count, measured s, predicted base part s, predicted speculation part s).
NUM_SUMS = 7
MIN_FACTOR, MAX_FACTOR = 0.2, 5.0


def corrected_step_time_s(base_s, full_s, base_factor, speculation_factor):
    """The calibration's step time corrected by measured factors: `base_factor` (s0) on
    the base step (K=0), `speculation_factor` (s1) on what drafting adds to it. Scalars
    or numpy arrays that broadcast."""
    return base_factor * base_s + speculation_factor * (full_s - base_s)


def num_batch_size_buckets(max_num_seqs: int) -> int:
    return batch_size_bucket(max_num_seqs) + 1


def batch_size_bucket(batch_size: int, num_buckets: int | None = None) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, ...; capped at num_buckets - 1."""
    j = max(0, int(batch_size) - 1).bit_length()
    return j if num_buckets is None else min(j, num_buckets - 1)


def update_step_time_scale(
    samples: Sequence,  # control.policy.StepTimeSample: this interval's measured steps
    scale: tuple[float, float],  # the pool-wide (s0, s1) so far
    pool_sums: Sequence[float],  # () before the first interval
    bucket_sums: Sequence[Sequence[float]],  # () before the first interval
    cost: StepCostModel,
    max_num_seqs: int,
    halflife_steps: float,
    bucket_prior_steps: float,
):
    """Fold one interval's steps in. Returns (pool-wide (s0, s1), pool-wide sums,
    per-bucket sums, factors per batch size as an array [B-1, 2])."""
    num_buckets = num_batch_size_buckets(max_num_seqs)
    buckets = [list(b) for b in bucket_sums] or [[0.0] * NUM_SUMS for _ in range(num_buckets)]
    new = [[0.0] * NUM_SUMS for _ in range(num_buckets)]
    for m in samples:
        ctx = m.batch_size * m.mean_context_tokens_per_req
        base = cost.step_time_s(m.batch_size, 0, ctx, m.mean_prefill_tokens)
        full = cost.step_time_s(m.batch_size, m.num_speculative_tokens, ctx, m.mean_prefill_tokens)
        n, row = m.num_steps, new[batch_size_bucket(m.batch_size, num_buckets)]
        if m.num_speculative_tokens == 0:
            row[0] += n
            row[1] += n * m.mean_step_time_s
            row[2] += n * base
        elif full > base:
            row[3] += n
            row[4] += n * m.mean_step_time_s
            row[5] += n * base
            row[6] += n * (full - base)

    def fold(old: Sequence[float], add: Sequence[float]) -> list[float]:
        keep_b, keep_s = 0.5 ** (add[0] / halflife_steps), 0.5 ** (add[3] / halflife_steps)
        return [old[i] * (keep_b if i < 3 else keep_s) + add[i] for i in range(NUM_SUMS)]

    def factors(row: Sequence[float], prior: tuple[float, float] | None, prior_steps: float):
        """(s0, s1) from one row of sums; with `prior`, pulled towards it by prior_steps
        pseudo-steps (at the row's own mean predicted times)."""
        n0, bt, bb, n1, st, sb, sx = row
        if prior is None:
            s0 = bt / bb if bb > 0 else scale[0]
        else:
            s0 = (bt + prior_steps * prior[0] * bb / n0) / (bb + prior_steps * bb / n0) if n0 else prior[0]
        s0 = float(np.clip(s0, MIN_FACTOR, MAX_FACTOR))
        if prior is None:
            s1 = (st - s0 * sb) / sx if sx > 0 else scale[1]
        else:
            s1 = (st - s0 * sb + prior_steps * prior[1] * sx / n1) / (sx + prior_steps * sx / n1) if n1 else prior[1]
        return s0, float(np.clip(s1, MIN_FACTOR, MAX_FACTOR))

    buckets = [fold(old, add) for old, add in zip(buckets, new)]
    # Pool-wide: every bucket's new steps, decayed by the pool's steps on each side.
    total = [sum(r[i] for r in new) for i in range(NUM_SUMS)]
    pool = fold(pool_sums or [0.0] * NUM_SUMS, total)
    pool_scale = factors(pool, None, 0.0)
    per_bucket = [factors(r, pool_scale, bucket_prior_steps) for r in buckets]
    scale_by_b = np.array([per_bucket[batch_size_bucket(b, num_buckets)] for b in range(1, max_num_seqs + 1)])
    return pool_scale, tuple(pool), tuple(tuple(r) for r in buckets), scale_by_b


def update_join_cost(
    samples: Sequence,  # control.policy.BusySample: this interval's steps as run
    sums_by_bucket: Sequence[Sequence[Sequence[float]]],  # () before the first interval
    decode_s_per_token: np.ndarray,  # [B-1, K]: the corrected decode steps' time per output token
    max_num_seqs: int,
    halflife_steps: float,
) -> tuple[tuple[tuple[float, float, float], ...], ...]:
    """Fold one interval's steps as run in: per bucket and K, decayed (steps, seconds beyond
    the decode steps' prediction, output tokens), forgetting counted in that cell's own steps."""
    num_buckets, num_k = num_batch_size_buckets(max_num_seqs), decode_s_per_token.shape[1]
    sums = [[list(c) for c in row] for row in sums_by_bucket] or [[[0.0] * 3 for _ in range(num_k)]
                                                                  for _ in range(num_buckets)]
    new = [[[0.0] * 3 for _ in range(num_k)] for _ in range(num_buckets)]
    for m in samples:
        if not (1 <= m.batch_size <= max_num_seqs and 0 <= m.num_speculative_tokens < num_k and m.output_tokens > 0):
            continue
        cell = new[batch_size_bucket(m.batch_size, num_buckets)][m.num_speculative_tokens]
        cell[0] += m.num_steps
        cell[1] += m.seconds - m.output_tokens * decode_s_per_token[m.batch_size - 1, m.num_speculative_tokens]
        cell[2] += m.output_tokens
    out = []
    for row, add_row in zip(sums, new):
        folded = []
        for old, add in zip(row, add_row):
            keep = 0.5 ** (add[0] / halflife_steps)
            folded.append(tuple(o * keep + a for o, a in zip(old, add)))
        out.append(tuple(folded))
    return tuple(out)


def join_cost_grid(sums_by_bucket: Sequence[Sequence[Sequence[float]]], max_num_seqs: int, max_k: int,
                   min_tokens: float) -> np.ndarray:
    """Seconds per output token outside the decode steps, [B-1, K] for B = 1..max_num_seqs
    and K = 0..max_k: in each bucket, the line in K through its measured Ks (those with
    `min_tokens` output tokens or more), fitted by least squares weighted by their output
    tokens, never below 0; flat where one K is measured, 0 where none is."""
    num_buckets = num_batch_size_buckets(max_num_seqs)
    ks = np.arange(max_k + 1, dtype=float)
    by_bucket = np.zeros((num_buckets, max_k + 1))
    for j, row in enumerate(sums_by_bucket[:num_buckets]):
        known = [(k, extra / tokens) for k, (_, extra, tokens) in enumerate(row[:max_k + 1]) if tokens >= min_tokens]
        if not known:
            continue
        kx, ox = np.array([k for k, _ in known], dtype=float), np.array([o for _, o in known])
        if len(known) == 1:
            by_bucket[j] = max(0.0, float(ox[0]))
            continue
        w = np.array([row[int(k)][2] for k in kx])  # output tokens: a thin cell moves the line little
        k_mean, o_mean = np.average(kx, weights=w), np.average(ox, weights=w)
        slope = np.sum(w * (kx - k_mean) * (ox - o_mean)) / np.sum(w * (kx - k_mean) ** 2)
        by_bucket[j] = np.maximum(0.0, o_mean + slope * (ks - k_mean))
    return np.array([by_bucket[batch_size_bucket(b, num_buckets)] for b in range(1, max_num_seqs + 1)])
