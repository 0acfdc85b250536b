"""The synthetic accept rule (actors.synthetic_rejection.synthetic_verify) on plain tensors."""

import math

import pytest
import torch

from actors.synthetic_rejection import PLACEHOLDER_TOKEN_ID as PH
from actors.synthetic_rejection import synthetic_verify

pytestmark = pytest.mark.unit


def _verify(num_drafts, drafts, replacement, bonus, u, rates, max_spec_len=None, rows=None, out=None):
    max_spec_len = max_spec_len or max(num_drafts)
    if out is None:
        out = torch.full((len(num_drafts), max_spec_len + 1), PH, dtype=torch.int32)
    synthetic_verify(
        out,
        torch.tensor(num_drafts, dtype=torch.int32).cumsum(0).to(torch.int32),
        torch.tensor(drafts, dtype=torch.int32),
        torch.tensor(replacement, dtype=torch.int64),
        torch.tensor(bonus, dtype=torch.int64).reshape(-1, 1),
        torch.tensor(u, dtype=torch.float64),
        torch.tensor(rates, dtype=torch.float32),
        rows=None if rows is None else torch.tensor(rows),
    )
    return out.tolist()


def _kernel_reference(num_drafts, drafts, replacement, bonus, u, rates, max_spec_len):
    """vLLM's Triton synthetic branch, one request at a time."""
    out, start = [], 0
    for b, n in enumerate(num_drafts):
        row, rejected = [PH] * (max_spec_len + 1), False
        for pos in range(n):
            if rejected:
                break
            accepted = u[start + pos] < rates[pos] and drafts[start + pos] >= 0
            row[pos] = drafts[start + pos] if accepted else replacement[start + pos]
            rejected = not accepted
        if not rejected:
            row[n] = bonus[b]
        out.append(row)
        start += n
    return out


def test_first_rejection_emits_the_replacement_and_ends_the_request():
    # Position 3's uniform is below its rate, but position 2 was already rejected.
    out = _verify([4], drafts=[11, 12, 13, 14], replacement=[21, 22, 23, 24], bonus=[99],
                  u=[0.1, 0.9, 0.0, 0.0], rates=[0.5, 0.5, 0.5, 0.5])
    assert out == [[11, 22, PH, PH, PH]]


def test_all_accepted_appends_the_bonus_token_and_no_drafts_means_bonus_only():
    out = _verify([3, 0, 1], drafts=[11, 12, 13, 31], replacement=[0, 0, 0, 0], bonus=[97, 98, 99],
                  u=[0.0, 0.1, 0.2, 0.4], rates=[0.9, 0.9, 0.9], max_spec_len=3)
    assert out == [[11, 12, 13, 97], [98, PH, PH, PH], [31, 99, PH, PH]]


def test_placeholder_draft_is_rejected_even_at_rate_one():
    out = _verify([2], drafts=[11, -1], replacement=[21, 22], bonus=[99], u=[0.5, 0.5], rates=[1.0, 1.0])
    assert out == [[11, 22, PH]]


def test_zero_rate_never_accepts():
    out = _verify([2], drafts=[11, 12], replacement=[21, 22], bonus=[99], u=[0.0, 0.0], rates=[1.0, 0.0])
    assert out == [[11, 22, PH]]


def test_rows_outside_the_mask_are_left_alone():
    before = torch.tensor([[5, 6, 7], [PH, PH, PH]], dtype=torch.int32)
    out = _verify([2, 2], drafts=[11, 12, 13, 14], replacement=[0, 0, 0, 0], bonus=[98, 99],
                  u=[0.0] * 4, rates=[1.0, 1.0], rows=[False, True], out=before)
    assert out == [[5, 6, 7], [13, 14, 99]]


def test_matches_the_kernel_rule_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        max_spec_len = int(torch.randint(1, 6, (1,), generator=gen))
        batch = int(torch.randint(1, 7, (1,), generator=gen))
        num_drafts = torch.randint(0, max_spec_len + 1, (batch,), generator=gen).tolist()
        total = sum(num_drafts)
        drafts = torch.randint(-1, 50, (total,), generator=gen).tolist()
        replacement = torch.randint(50, 100, (total,), generator=gen).tolist()
        bonus = torch.randint(100, 150, (batch,), generator=gen).tolist()
        u = torch.rand(total, generator=gen, dtype=torch.float64).tolist()
        rates = sorted(torch.rand(max_spec_len, generator=gen).tolist(), reverse=True)
        rates32 = torch.tensor(rates, dtype=torch.float32).double().tolist()
        got = _verify(num_drafts, drafts, replacement, bonus, u, rates, max_spec_len=max_spec_len)
        want = _kernel_reference(num_drafts, drafts, replacement, bonus, u, rates32, max_spec_len)
        assert got == want


def test_conditional_rates_give_the_configured_unconditional_acceptance():
    unconditional = [0.8, 0.6, 0.4, 0.2]
    # vLLM's unconditional_to_conditional_rates: c_i = p_i / p_{i-1}, c_0 = p_0.
    conditional = [p / q for p, q in zip(unconditional, [1.0, *unconditional[:-1]])]
    num_steps, k = 100_000, len(unconditional)
    gen = torch.Generator().manual_seed(1)
    out = torch.full((num_steps, k + 1), PH, dtype=torch.int32)
    synthetic_verify(out, torch.arange(1, num_steps + 1, dtype=torch.int32) * k,
                     torch.ones(num_steps * k, dtype=torch.int32), torch.zeros(num_steps * k, dtype=torch.int64),
                     torch.full((num_steps, 1), 2, dtype=torch.int64),
                     torch.rand(num_steps * k, generator=gen, dtype=torch.float64),
                     torch.tensor(conditional, dtype=torch.float32))
    accepted_per_pos = (out[:, :k] == 1).double().mean(dim=0).tolist()
    for want, got in zip(unconditional, accepted_per_pos):
        assert abs(got - want) <= 4.5 * math.sqrt(want * (1 - want) / num_steps)
