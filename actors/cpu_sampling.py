"""Random sampling (temperature > 0, with or without `seed`) on vLLM 0.32's CPU backend:
three defects fixed inside the engine core.

1. **A seeded request under load killed the engine core.** When a step schedules only
   part of a request's prompt (chunked prefill: the step's token budget is full), vLLM
   still samples a token for it, throws that token away, and rewinds the request's
   `torch.Generator` as if nothing had been drawn: `GPUModelRunner._bookkeeping_sync`
   calls `gen.set_offset(gen.get_offset() - 4)`, the CUDA generator's Philox offset. A
   CPU generator (Mersenne Twister) has none and raises "CPU Generator does not use
   offset", which kills the engine core and every request in flight. Here the same
   rewind is done with the generator's full state, on the CPU model runner only: before
   a step samples, the states of the seeded requests whose token that step will discard
   are saved (`discard_request_mask` is set while the step's inputs are prepared, before
   sampling); after sampling they are put back, and vLLM's offset rewind is skipped for
   exactly those generators. As on CUDA, a discarded sample draws nothing from the
   request's stream, so a seed's text does not depend on how its prompt was split.

2. **Speculative verification of sampled requests ran on NaN probabilities.** The
   rejection sampler spreads each request's temperature, top-k and top-p over its draft
   tokens (`expand_batch_to_tokens`, a Triton kernel). vLLM's CPU stand-in for that
   kernel (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) converts the output tensor
   to int64 when it is not int64 already, so for a float32 temperature (or int32 top-k)
   it writes into a temporary copy and the real output stays uninitialised memory: the
   target logits were divided by garbage, the target probabilities were NaN, every draft
   was rejected, and the "recovered" token was drawn from NaN. Sampled output under
   speculation was then neither the target's distribution nor reproducible with a seed.
   Here the stand-in is replaced by `expand_to_tokens` (torch, any dtype), registered
   through the platform's kernel overrides the same way as `actors.synthetic_rejection`'s.

3. **`top_k` with temperature > 0 under speculation killed the engine core.** With a
   speculative config every step goes through the rejection sampler, also a step with no
   draft token (every prefill step), whose target logits then have no row. Without Triton
   the top-k mask falls back to `topk_topp_sampler.apply_top_k_only`, whose `k.max()` on
   an empty tensor raises. Here that function returns empty logits as they are
   (`top_k_of_nothing`); it is looked up at call time, so replacing the module's attribute
   suffices. (Found by the fuzz run, tests/integration/test_fuzz.py.)

All through a vLLM general plugin (entry point `vllm.general_plugins`): vLLM loads
general plugins in a worker before the platform registers its kernel overrides. GPU
runners and kernels are untouched. The real-engine tests are in
tests/integration/test_seeded_sampling.py (same seed, same text, with and without
speculation, under chunked prefill; sampled tokens' frequencies with and without
P-EAGLE) and tests/integration/test_fuzz.py.
"""

from __future__ import annotations

from typing import Any

import torch

_PATCHED = "_peagle_cpu_sampling"


def expand_to_tokens(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: int | None = None) -> None:
    """The `expand_kernel` contract: request i's value (`replace_to` where it equals
    `replace_from`) written to its tokens `cu_num_tokens[i-1]:cu_num_tokens[i]` of
    `output`, in `output`'s own dtype. Positions past the last request are left as they are."""
    if input_val.numel() == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output[:int(cu[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


def top_k_of_nothing(original):
    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:  # a step with no draft token: nothing to mask
            return logits
        return original(logits, k)
    setattr(apply_top_k_only, _PATCHED, True)
    return apply_top_k_only


def discarded_generators(runner: Any) -> dict[int, Any]:
    """{batch index: generator} of the seeded requests whose sample this step discards."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    mask = runner.discard_request_mask.np[:runner.input_batch.num_reqs]
    return {int(i): generators[int(i)] for i in mask.nonzero()[0] if int(i) in generators}


def _sample(original):
    def sample(self, *args, **kwargs):
        self._peagle_saved_states = {i: gen.get_state() for i, gen in discarded_generators(self).items()}
        return original(self, *args, **kwargs)
    setattr(sample, _PATCHED, True)
    return sample


def _bookkeeping_sync(original):
    def bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_peagle_saved_states", None) or {}
        self._peagle_saved_states = {}
        if not saved:
            return original(self, *args, **kwargs)
        generators = self.input_batch.generators
        for i, state in saved.items():
            generators[i].set_state(state)
        # vLLM's loop rewinds every discarded request's generator by offset; these are done.
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in saved}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators
    setattr(bookkeeping_sync, _PATCHED, True)
    return bookkeeping_sync


def install() -> None:
    """vLLM general-plugin entry point: on the CPU platform, wrap the CPU model runner's
    `_sample` and `_bookkeeping_sync`, replace the CPU expand kernel, and let the top-k
    mask take no rows. Safe to call many times and in any vLLM process; does nothing on
    other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils as cpu_tl
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for name, wrap in (("_sample", _sample), ("_bookkeeping_sync", _bookkeeping_sync)):
        original = getattr(CPUModelRunner, name)
        if not getattr(original, _PATCHED, False):
            setattr(CPUModelRunner, name, wrap(original))
    cpu_tl._expand_kernel_impl = expand_to_tokens
    if not getattr(topk_topp_sampler.apply_top_k_only, _PATCHED, False):
        topk_topp_sampler.apply_top_k_only = top_k_of_nothing(topk_topp_sampler.apply_top_k_only)
