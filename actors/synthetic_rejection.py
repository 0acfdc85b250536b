"""Synthetic rejection sampling on vLLM's CPU backend.

vLLM 0.32 can accept drafts at calibrated rates whatever the head drafted
(`speculative_config: {"rejection_sample_method": "synthetic",
"synthetic_acceptance_rates": [...]}`), which lets a performance experiment behave like a
head of any acceptance. `vllm.v1.sample.rejection_sampler.rejection_sample` keeps the
rule inside its two Triton kernels (`rejection_greedy_sample_kernel`,
`rejection_random_sample_kernel`). Without a Triton CPU backend, the CPU platform
(`CpuPlatform.register_triton_kernel_overrides`) swaps those kernels for the wrappers
`_rejection_greedy_sample_kernel_impl` / `_rejection_random_sample_kernel_impl` in
`vllm.utils.cpu_triton_utils`, which call C++ kernels that know no synthetic mode and
`assert not SYNTHETIC_MODE`: every synthetic engine on this CPU dies on its first verify step.

So this module, a vLLM general plugin (entry point `vllm.general_plugins`), replaces those
two wrappers with ones that run the synthetic rule in torch (`synthetic_verify`) and hand
every other call to vLLM's own wrapper unchanged. vLLM loads general plugins in a worker
before the platform registers its kernel overrides (`WorkerBase.init_worker`), so the
platform registers ours. The rule is the Triton kernels' own, step for step:

* position i (0-based) of a request's drafts is accepted iff `u[i] < c[i]`, with `c` the
  conditional rates vLLM derives from the configured unconditional ones
  (`unconditional_to_conditional_rates`: c_i = p_i / p_{i-1}, c_0 = p_0), and the draft
  id is not the -1 placeholder; `u` comes from vLLM's `generate_uniform_probs` (float64
  `torch.rand`, per-request `torch.Generator` for seeded requests), which runs before the
  kernels and is not touched here;
* the first rejection writes the replacement token (the target argmax for greedy
  requests, vLLM's recovered token for random ones) and ends the request's verification:
  later positions stay the -1 placeholder whatever their `u`;
* when every draft is accepted (also when a request has none), the bonus token follows.

Greedy requests go through the greedy kernel, temperature > 0 requests through the random
one, as in vLLM. GPU, Triton-CPU and non-synthetic paths are untouched. The accept rule
itself imports only torch and is unit-tested in tests/unit/test_synthetic_rejection.py;
the calibration on the real engine in tests/integration/test_synthetic_acceptance.py.
"""

from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for "no token" in the output rows
_PATCHED = "_peagle_synthetic"


def synthetic_verify(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    replacement_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniform_probs: torch.Tensor,
    conditional_rates: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Write synthetic verification results into `output_token_ids` [batch, max_spec_len + 1]
    (pre-filled with the placeholder) for the requests selected by the bool mask `rows`
    (all when None); other rows are left as they are.

    Token-indexed inputs are flat over the batch's drafts ([num_tokens]), with request b's
    drafts at cu_num_draft_tokens[b-1]:cu_num_draft_tokens[b]. `replacement_token_ids` is
    what a rejected position emits (target argmax or recovered token); `bonus_token_ids`
    has one entry per request."""
    batch_size, width = output_token_ids.shape
    max_spec_len = width - 1
    device = output_token_ids.device
    ends = cu_num_draft_tokens.to(torch.long)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    num_drafts = ends - starts

    # [batch, max_spec_len] views of the flat per-token inputs. Slots past a request's
    # drafts read one appended dummy entry and never count (`valid`).
    num_tokens = draft_token_ids.numel()
    pos = torch.arange(max_spec_len, device=device)
    valid = pos.unsqueeze(0) < num_drafts.unsqueeze(1)
    index = torch.where(valid, starts.unsqueeze(1) + pos, num_tokens)

    def per_slot(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([values.reshape(-1).to(dtype), values.new_zeros(1, dtype=dtype)])[index]

    drafts = per_slot(draft_token_ids, torch.long)
    u = per_slot(uniform_probs, torch.float64)
    replacement = per_slot(replacement_token_ids, torch.long)
    rates = torch.zeros(max_spec_len, dtype=torch.float64, device=device)
    num_rates = min(max_spec_len, conditional_rates.numel())
    rates[:num_rates] = conditional_rates[:num_rates].to(torch.float64)

    accepted = valid & (u < rates) & (drafts >= 0)
    # Verification stops at the first rejection: only an unbroken prefix counts.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    out = torch.full((batch_size, width), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    out[:, :max_spec_len] = torch.where(pos < num_accepted.unsqueeze(1), drafts, PLACEHOLDER_TOKEN_ID)
    rejected = num_accepted < num_drafts
    batch = torch.arange(batch_size, device=device)
    at = num_accepted[rejected]
    out[batch[rejected], at] = replacement[batch[rejected], at]
    bonus = bonus_token_ids.reshape(-1).to(torch.long)
    out[batch[~rejected], num_drafts[~rejected]] = bonus[~rejected]

    selected = torch.ones(batch_size, dtype=torch.bool, device=device) if rows is None else rows.bool()
    output_token_ids[selected] = out[selected].to(output_token_ids.dtype)


def _greedy_impl(original):
    """CPU greedy-kernel wrapper: synthetic rule in torch, everything else to vLLM's.
    Same parameters, in the same order, as vLLM's wrapper (launches pass them by position)."""

    def rejection_greedy_sample(
        output_token_ids,
        cu_num_draft_tokens,
        draft_token_ids,
        target_argmax,
        bonus_token_ids,
        is_greedy,
        max_spec_len,
        uniform_probs=None,
        synthetic_conditional_rates=None,
        SYNTHETIC_MODE=False,
    ):
        if not SYNTHETIC_MODE:
            return original(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                            bonus_token_ids, is_greedy, max_spec_len, uniform_probs,
                            synthetic_conditional_rates, SYNTHETIC_MODE)
        synthetic_verify(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                         bonus_token_ids, uniform_probs, synthetic_conditional_rates, rows=is_greedy)

    setattr(rejection_greedy_sample, _PATCHED, True)
    return rejection_greedy_sample


def _random_impl(original):
    """CPU random-kernel wrapper; see `_greedy_impl`."""

    def rejection_random_sample(
        output_token_ids,
        cu_num_draft_tokens,
        draft_token_ids,
        draft_probs,
        target_probs,
        bonus_token_ids,
        recovered_token_ids,
        uniform_probs,
        is_greedy,
        max_spec_len,
        vocab_size,
        synthetic_conditional_rates=None,
        NO_DRAFT_PROBS=False,
        SYNTHETIC_MODE=False,
    ):
        if not SYNTHETIC_MODE:
            return original(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                            is_greedy, max_spec_len, vocab_size, synthetic_conditional_rates,
                            NO_DRAFT_PROBS, SYNTHETIC_MODE)
        synthetic_verify(output_token_ids, cu_num_draft_tokens, draft_token_ids, recovered_token_ids,
                         bonus_token_ids, uniform_probs, synthetic_conditional_rates, rows=~is_greedy)

    setattr(rejection_random_sample, _PATCHED, True)
    return rejection_random_sample


def install() -> None:
    """vLLM general-plugin entry point: on the CPU platform, replace vLLM's CPU wrappers of
    the two rejection kernels with synthetic-aware ones. Safe to call many times and in any
    vLLM process; does nothing on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils as cpu_tl

    for name, wrap in (("_rejection_greedy_sample_kernel_impl", _greedy_impl),
                       ("_rejection_random_sample_kernel_impl", _random_impl)):
        original = getattr(cpu_tl, name)
        if not getattr(original, _PATCHED, False):
            setattr(cpu_tl, name, wrap(original))
