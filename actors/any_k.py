"""P-EAGLE at any K in 0..K_max per step, inside the engine (a vLLM general plugin).

vLLM 0.32's parallel drafter sizes its one-pass input from the start-up K (K_max): each
request gets K_max - 1 mask slots after its bonus token, the pass samples B x K_max rows,
and `propose` reshapes them with the step's K (`view(-1, K)`). A step K below K_max then
either kills the engine core (B x K_max not divisible by K) or hands request b the drafts
of request a (upstream #45695, still open in 0.32; the canary in
tests/integration/test_live_schedule.py runs raw vLLM without this plugin and keeps
checking it). A K = 0 step still runs the whole first pass with K_max - 1 mask rows per
request, only to throw the drafts away.

This module wraps `SpecDecodeBaseProposer.propose` so a step's first pass is laid out for
that step's K: max(K, 1) slots per request (the bonus token and K - 1 mask tokens), the
only two sizes `set_inputs_first_pass` reads. Why that is exact, not an approximation:
the head's attention is causal, so a draft slot never sees the mask slots after it, and
a mask slot's embedding and hidden state do not depend on K; the K drafts of a K-slot
pass are the first K drafts a K_max-slot pass would make. K = 1 is one-token EAGLE; K = 0
runs the head over the step's own tokens only (its KV cache stays in step with the
target's) and samples nothing, or, on a decode-only step, skips the head and leaves the
catch-up to the next pass (`actors.k0_skip`, which every step goes through here). The output stays the target's whatever the drafts are
(rejection sampling); tests/integration/test_live_schedule.py proves it token for token
with K switching across 0..K_max, and that the K asked for is the K that ran.

Knows nothing about who chooses K (the scheduler's batch-size table, put in force live
by `actors.live_schedule`). Acts only on EAGLE-3 heads with parallel drafting; DFlash and
one-token EAGLE pass through untouched. Why our own: vLLM has no per-step K for parallel
drafting yet; remove this module when it does (the canary will fail first).
"""

from __future__ import annotations

import functools

from actors import k0_skip

MARK = "_peagle_any_k"


def slots_for(k: int) -> tuple[int, int]:
    """(slots per request, new slots per request) of a first pass drafting `k` tokens:
    the bonus token plus k - 1 mask tokens; EAGLE's shift makes the bonus take the place
    of the first input, so one slot fewer is new."""
    if k < 0:
        raise ValueError(f"a step's K must be >= 0, got {k!r}")
    slots = max(k, 1)
    return slots, slots - 1


def _wrap(propose):
    import inspect

    signature = inspect.signature(propose)

    def run_pass(self, k: int, **kwargs):
        saved = self.extra_slots_per_request, self.net_num_new_slots_per_request
        self.extra_slots_per_request, self.net_num_new_slots_per_request = slots_for(k)
        try:
            return propose(self, k, **kwargs)
        finally:
            self.extra_slots_per_request, self.net_num_new_slots_per_request = saved

    @functools.wraps(propose)
    def propose_at_step_k(self, num_speculative_tokens, *args, **kwargs):
        if not k0_skip.applies(self):
            return propose(self, num_speculative_tokens, *args, **kwargs)
        bound = signature.bind(self, num_speculative_tokens, *args, **kwargs).arguments
        bound.pop("self")
        k = int(bound.pop("num_speculative_tokens"))
        return k0_skip.propose(self, k, bound, functools.partial(run_pass, self))

    setattr(propose_at_step_k, MARK, True)
    return propose_at_step_k


def installed() -> bool:
    """Whether this process's drafter runs any K per step (the plugin was loaded here)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    return bool(getattr(SpecDecodeBaseProposer.propose, MARK, False))


def install() -> None:
    """vLLM general-plugin entry point (`peagle_any_k`). Idempotent. Leaves vLLM alone,
    with a log line, if the drafter no longer has the attributes this relies on."""
    import logging

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if installed():
        return
    needed = ("set_inputs_first_pass", "propose")
    if not all(hasattr(SpecDecodeBaseProposer, name) for name in needed):
        logging.getLogger(__name__).warning(
            "P-EAGLE per-step K not installed: vLLM's SpecDecodeBaseProposer lacks %s", needed)
        return
    SpecDecodeBaseProposer.propose = _wrap(SpecDecodeBaseProposer.propose)
    k0_skip.install()
