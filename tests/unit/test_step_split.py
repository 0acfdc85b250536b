"""The step split's bookkeeping (actors.step_split): which steps count, and the means it
reports. The engine-core side is exercised on the real engine by
tests/integration/test_profile_steps.py."""

import pytest

from actors.step_split import add_step, is_decode_step, per_step

pytestmark = pytest.mark.unit


def test_only_pure_decode_steps_count():
    # Each request runs its new token plus its drafts: decode. A prompt chunk, or a request
    # scheduled more tokens than 1 + drafts, makes it a prefill (or mixed) step.
    assert is_decode_step({"a": 1, "b": 1}, {})
    assert is_decode_step({"a": 5, "b": 5}, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]})
    assert not is_decode_step({"a": 5, "b": 3}, {"a": [1, 2, 3, 4]})
    assert not is_decode_step({"a": 40}, {})
    assert not is_decode_step({"a": 1, "b": 30}, {})
    assert not is_decode_step({}, {})


def test_means_per_batch_size_and_other_is_the_rest_of_the_step():
    sums: dict = {}
    add_step(sums, 4, 0.010, {"target": 0.004, "draft": 0.003})
    add_step(sums, 4, 0.014, {"target": 0.006, "draft": 0.003})
    add_step(sums, 1, 0.005, {"target": 0.002, "draft": 0.0})
    out = per_step(sums)
    assert list(out) == [1, 4]
    four = out[4]
    assert four["steps"] == 2
    assert four["step_s"] == pytest.approx(0.012)
    assert four["target"] == pytest.approx(0.005) and four["draft"] == pytest.approx(0.003)
    assert four["other"] == pytest.approx(0.004)
    assert out[1]["other"] == pytest.approx(0.003)


def test_other_never_goes_negative():
    # A phase timed across a step boundary can exceed its step; the rest is then 0, not < 0.
    sums: dict = {}
    add_step(sums, 2, 0.004, {"target": 0.003, "draft": 0.002})
    assert per_step(sums)[2]["other"] == 0.0
