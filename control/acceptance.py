"""Online per-position acceptance: what the controller believes p_i is, and how fresh.

Owns one estimator: for each draft position i, an exponentially forgetting average of
accepted_at_pos[i] / drafts_that_reached_pos[i], where forgetting is counted in drafts
(not seconds), so a busy replica adapts as fast in tokens as an idle one and a position
nobody drafts keeps its last value instead of decaying towards nothing. It also keeps an
age per position (control intervals since it last saw enough drafts): the policy probes
positions whose age grows, because positions beyond the K in force are never drafted.

Why the denominator is per position: when K varies per step (a batch-size schedule),
vLLM's accepted_per_pos[i] / num_drafts under-counts deep positions, which only the
steps with K >= i drafted.

Knows nothing about step costs, schedules or where the counts come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: Age of a position never measured (only the prior stands behind it).
NEVER_OBSERVED = 10**9


@dataclass(frozen=True)
class AcceptanceEstimate:
    """p_i for i = 1..len, the effective drafts behind each, and intervals since fresh."""

    acceptance_per_pos: tuple[float, ...]
    evidence_drafts: tuple[float, ...]
    age_intervals: tuple[int, ...]

    @property
    def num_positions(self) -> int:
        return len(self.acceptance_per_pos)


def prior_estimate(acceptance_prior: Sequence[float], num_positions: int, prior_drafts: float) -> AcceptanceEstimate:
    """Start from a prior worth `prior_drafts` drafts per position, every position stale.
    A prior shorter than `num_positions` is extended with its last conditional ratio."""
    if not acceptance_prior:
        raise ValueError("acceptance_prior must name at least one position, got ()")
    p = [float(x) for x in acceptance_prior[:num_positions]]
    ratio = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else p[-1]
    while len(p) < num_positions:
        p.append(p[-1] * ratio)
    p = _monotone(p)
    age = (NEVER_OBSERVED,) * num_positions
    return AcceptanceEstimate(tuple(p), (float(prior_drafts),) * num_positions, age)


def update_estimate(
    estimate: AcceptanceEstimate,
    num_drafts_per_pos: Sequence[int],
    num_accepted_per_pos: Sequence[int],
    halflife_drafts: float,
    min_fresh_drafts: int,
) -> AcceptanceEstimate:
    """Fold one window of counts into the estimate.

    Per position: keep = 0.5 ** (n / halflife); p = (p·w·keep + accepted) / (w·keep + n).
    Positions with fewer than `min_fresh_drafts` drafts in the window age by one interval.
    The result is clamped non-increasing in i (unconditional acceptance cannot grow with
    depth; noise at thin positions would otherwise make deeper drafts look free)."""
    if len(num_drafts_per_pos) != len(num_accepted_per_pos):
        raise ValueError(
            f"num_drafts_per_pos ({len(num_drafts_per_pos)}) and num_accepted_per_pos "
            f"({len(num_accepted_per_pos)}) must have the same length"
        )
    p = list(estimate.acceptance_per_pos)
    w = list(estimate.evidence_drafts)
    age = list(estimate.age_intervals)
    for i in range(estimate.num_positions):
        n = num_drafts_per_pos[i] if i < len(num_drafts_per_pos) else 0
        a = num_accepted_per_pos[i] if i < len(num_accepted_per_pos) else 0
        if a < 0 or n < 0 or a > n:
            raise ValueError(f"position {i + 1}: need 0 <= accepted <= drafts, got {a!r} of {n!r}")
        if n > 0:
            kept = w[i] * 0.5 ** (n / halflife_drafts)
            p[i] = (p[i] * kept + a) / (kept + n)
            w[i] = kept + n
        age[i] = 0 if n >= min_fresh_drafts else (age[i] if age[i] >= NEVER_OBSERVED else age[i] + 1)
    return AcceptanceEstimate(tuple(_monotone(p)), tuple(w), tuple(age))


def _monotone(p: list[float]) -> list[float]:
    out: list[float] = []
    for x in p:
        x = min(max(x, 0.0), 1.0)
        out.append(min(x, out[-1]) if out else x)
    return out
