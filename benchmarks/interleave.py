"""Paired, interleaved arms: the order in which a round measures the arms.

Benchmarks that compare arms on this shared machine start every arm's engine at once and
measure each level on every arm in turn, round after round, so drift hits all arms alike
(`benchmarks.peagle_table`, `benchmarks.controller_live`). The order rotates from round
to round, so no arm always runs first or last.
"""

from __future__ import annotations


def rotated(arms: list[str], round_index: int) -> list[str]:
    """The arms in the order round `round_index` measures them: shifted by one each round."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]
