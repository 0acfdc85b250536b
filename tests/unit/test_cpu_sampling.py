"""The CPU expand kernel's replacement (actors.cpu_sampling.expand_to_tokens) on plain
tensors: each request's temperature / top-k / top-p reaches each of its draft tokens in
the tensor's own dtype. vLLM's CPU stand-in wrote float and int32 values into an int64
copy and left the real output uninitialised (sampled verification on NaN)."""

import pytest
import torch

from actors.cpu_sampling import expand_to_tokens, top_k_of_nothing

pytestmark = pytest.mark.unit


def expand(values, counts, dtype, replace_from=0, replace_to=0):
    out = torch.full((sum(counts),), -7, dtype=dtype)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    expand_to_tokens(out, torch.tensor(values, dtype=dtype), cu, replace_from, replace_to)
    return out.tolist()


def test_temperatures_reach_every_draft_token_as_floats_with_greedy_replaced_by_one():
    # GREEDY_TEMPERATURE (0) -> 1, as the rejection sampler asks; a request with no drafts takes no slot.
    got = expand([0.7, 0.0, 1.5, 0.25], [2, 3, 0, 1], torch.float32, replace_from=0, replace_to=1)
    assert got == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.25])


def test_int32_top_k_and_float_top_p_keep_their_dtype_and_values():
    assert expand([5, 50], [1, 2], torch.int32) == [5, 50, 50]
    assert expand([0.9, 0.5], [3, 1], torch.float32) == pytest.approx([0.9, 0.9, 0.9, 0.5])


def test_slots_past_the_last_request_are_left_alone():
    out = torch.full((5,), -1.0)
    expand_to_tokens(out, torch.tensor([2.0]), torch.tensor([3], dtype=torch.int32), 0, 0)
    assert out.tolist() == [2.0, 2.0, 2.0, -1.0, -1.0]


def test_the_top_k_mask_of_a_step_with_no_draft_token_is_empty_not_an_error():
    def vllm_top_k(logits, k):  # what vLLM's CPU fallback does first: k.max() of nothing raises
        k.max()
        return logits[:, :1]

    guarded = top_k_of_nothing(vllm_top_k)
    empty = torch.empty((0, 4096))
    assert guarded(empty, torch.empty((0,), dtype=torch.int32)) is empty
    assert guarded(torch.zeros((2, 8)), torch.tensor([3, 5])).shape == (2, 1)  # rows: vLLM's own
