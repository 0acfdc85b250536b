"""Which speculation depths K a table may hold and an engine may run: the one rule.

Read by the config schema (a batch-size -> K table in a preset or an override), by the
engine facade before it sends a live table (`actors.engine`), by the engine-core plugin
that swaps it (`actors.live_schedule`, with the engine's actual settings), by the
controller's settings and by calibration (`tools.profile_steps`). Plain Python with no
imports of the project, so the engine core loads it as cheaply as the schema does.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def check_schedule(schedule: Sequence[Sequence[int]], k_max: int) -> None:
    """A batch-size -> K table ([[lo, hi, K], ...]): contiguous ranges from batch size 1,
    every K in 0..k_max. Raises ValueError naming the first bad entry."""
    if not schedule:
        raise ValueError("spec.schedule must not be empty; omit it for a fixed K")
    expected_lo = 1
    for lo, hi, k in schedule:
        if lo != expected_lo or hi < lo:
            raise ValueError(
                f"spec.schedule ranges must be contiguous from 1, got range {[lo, hi, k]!r} "
                f"where lo={expected_lo} was expected"
            )
        if not 0 <= k <= k_max:
            raise ValueError(
                f"spec.schedule K must be in [0, num_speculative_tokens={k_max}], got {k!r}"
            )
        expected_lo = hi + 1


def allowed_k(k_max: int, startup_ks: Iterable[int], *, graphs_captured: bool,
              parallel_drafting: bool, any_k_installed: bool = True) -> list[int]:
    """The K values an engine started at K = `k_max` (with `startup_ks` in its start-up
    table) can run per step, in its table or put in force live:

    * none above the start-up K (KV lookahead slots were reserved for it); 0 always;
    * with CUDA graphs, only the start-up table's K values and k_max (graphs were captured
      for those decode shapes only);
    * P-EAGLE (parallel drafting) without the project's plugin `actors.any_k` only 0 and
      k_max: vLLM 0.32 sizes the parallel draft slots from the start-up K and a smaller
      step K crashes the engine or mixes drafts between requests (upstream #45695);
    * otherwise every K in 0..k_max.
    """
    if not k_max:
        return [0]
    if parallel_drafting and not any_k_installed:
        return [0, k_max]
    if graphs_captured:
        return sorted({0, k_max, *(int(k) for k in startup_ks)})
    return list(range(k_max + 1))
