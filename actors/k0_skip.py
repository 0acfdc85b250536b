"""A K = 0 step skips the P-EAGLE head; the head's KV cache catches up when drafting resumes.

Without this, a K = 0 step still runs the head over the step's tokens (one slot per
request, `actors.any_k`) only to keep the drafter's KV cache in step with the target's.
Here a K = 0 step runs no head at all, prompts (and prompt chunks) joining on it
included: it stashes, per request, what the head would have read at each skipped
position (the target's concatenated aux hidden states and its input token). The next
step that runs the head (K > 0, or a K = 0 step whose gap would overflow the stash)
first runs catch-up passes: the head over each request's stashed gap, batched like a
prefill through the unchanged first pass at K = 0 (one slot per request, no lm_head),
on a synthetic batch of just those requests. The head is causal, so this writes the
draft KV that continuous drafting would have written, and acceptance after a gap equals
acceptance without one.

A request that finishes, or is preempted, with a gap open leaves blocks whose target KV
is in the prefix cache but whose head KV was never written. A later hit on them (the
preempted row going on, the next turn of a chat, a sibling of n > 1, a prompt that
repeats) would draft over the hole: never a different output (rejection sampling), but
fewer drafts accepted for as long as the blocks are cached. So those blocks are dropped
from the prefix cache (`evict_holes`, from the core's step wrapper): a later request
recomputes them, head included. A preempted request's go before the next step is
scheduled (it resumes on them). A finished request's stay cached while K = 0 holds, where
a hit on them costs nothing (nothing drafts), so a K = 0 engine keeps a plain engine's
prefix hits; they go before a step that may draft is scheduled (the K the table gives for
the requests running and waiting, `next_step_may_draft`). A request that hit them inside
the spell and still runs when drafting resumes drafts over the hole for the rest of its
life (acceptance only), so they are kept only once the spell has lasted
`KEEP_AFTER_STEPS` steps: where the table drafts at one batch size and not at the next,
and a closed loop moves between the two every few steps, they go at once.

Skipping prompts needs that wrapper to reach the runner and read the cache's block ids
from the drafter's block table, so it is on only where the runner is in the core's
process (one worker, in-process executor) and the attention kernel's block is the
cache's (`blocks_differ`); elsewhere a K = 0 step skips decode-only steps and gaps stay
in the prefix cache (acceptance only, never output).

A step on which no request drafted (every K = 0 step's successor, a prefill) also skips
vLLM's rejection sampler: vLLM 0.32 sends every step of a speculating engine through it,
and with no drafts it only samples the bonus token, i.e. what the plain sampler does, at
~0.6 ms more a step at batch 16 on this CPU (`plain_sample_applies`; steps that want
logprobs or a thinking budget keep vLLM's path).

Design: docs/design/per-step-k-peagle.md, section (c). Called from `actors.any_k`'s
propose wrapper (`propose`) and the runner wrapper installed here (`install`), which
hands the drafter the step's scheduler output and frees finished/preempted requests.
Skips only with sync scheduling and data parallel size 1; anywhere else, and after any
exception (logged once; the skip is then off for the engine's life), a K = 0 step runs
the head as before. The output never depends on this module (rejection sampling);
only acceptance does. Knows nothing about who picks K.

`peagle_k0_skip` (engine-core utility) reads the counters and sets test-only knobs:
catch-up off and hole eviction off (the negative controls), prompt skipping off, a stash
width, a forced per-step K cycle, a prefix-cache reset.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from actors import step_split
from actors.step_split import is_decode_step

METHOD = "peagle_k0_skip"
ATTR = "_peagle_k0"
STASH_BUDGET_BYTES = 64 << 20  # per engine; the stash width W follows from it (design (c))
KEEP_AFTER_STEPS = 64  # steps in a row without drafting before a finished gap stays cached
COUNTERS = ("head_forwards", "skipped_steps", "catchup_passes", "catchup_tokens", "k0_head_runs",
            "flushes", "dropped_gaps", "plain_sampled_steps", "stashed_prompt_tokens", "evicted_blocks")

log = logging.getLogger(__name__)


def applies(proposer: Any) -> bool:
    """Whether this drafter is a P-EAGLE head's (EAGLE-3 with parallel drafting): the only
    drafters whose pass `actors.any_k` lays out per step and whose K = 0 steps skip here."""
    return bool(getattr(proposer, "parallel_drafting", False) and proposer.method == "eagle3"
                and getattr(proposer, "pass_hidden_states_to_model", False)
                and getattr(proposer, "needs_extra_input_slots", False))


def plan_passes(spans: Sequence[tuple[int, int, int]], max_tokens: int) -> list[list[tuple[int, int, int]]]:
    """Cut gaps (row, start, end) into catch-up passes of at most `max_tokens` tokens.
    A request appears at most once per pass, and its pieces run in position order."""
    if max_tokens < 1:
        raise ValueError(f"a catch-up pass needs room for at least one token, got {max_tokens!r}")
    left = [list(s) for s in spans if s[2] > s[1]]
    passes = []
    while left:
        room, cur = max_tokens, []
        for span in left:
            if room == 0:
                break
            take = min(room, span[2] - span[1])
            cur.append((span[0], span[1], span[1] + take))
            span[1] += take
            room -= take
        passes.append(cur)
        left = [s for s in left if s[2] > s[1]]
    return passes


class _Cycle(list):
    """A scheduler K lookup that ignores the batch size and returns the next K of a cycle
    (test-only: makes K switching deterministic per step)."""

    def __init__(self, cycle: Sequence[int], base: list[int]):
        super().__init__(base)
        self.cycle, self.i = [int(k) for k in cycle], 0

    def peek(self) -> int:
        """The K the next lookup will return, without taking it."""
        return self.cycle[self.i % len(self.cycle)]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list.__getitem__(self, index)
        k = self.peek()
        self.i += 1
        return k


class State:
    """Per-drafter stash and counters. `step` is set by the runner wrapper for one call."""

    def __init__(self, proposer: Any):
        self.enabled = True
        self.catch_up = True
        self.skip_prompts = True  # a K = 0 step with a prompt (chunk) in it skips too
        self.evict_holes = True  # a gap its request leaves un-caught-up is dropped from the prefix cache
        self.core_evicts = False  # set by `_core_state`: the core reaches this drafter and can evict its gaps
        self.fail_next = False  # test-only fault injection: the next skip decision raises
        self.width: int | None = None  # stash tokens per request; None: from STASH_BUDGET_BYTES
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.step: tuple[Any, Any] | None = None
        self.hidden = self.tokens = None
        self.slot: dict[str, int] = {}
        self.gap_start: dict[str, int] = {}
        self.written_end: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}  # KV block ids under each open gap, from its first block on
        self.holes: set[int] = set()  # blocks a preempted request left without head KV: evicted before the next step
        self.kept_holes: set[int] = set()  # finished requests' blocks without head KV: evicted before a step may draft
        self.keep_after_steps = KEEP_AFTER_STEPS
        self.steps_since_draft = 0  # propose calls in a row at K = 0
        self.block_size = proposer.vllm_config.cache_config.block_size
        self.max_reqs = proposer.vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = proposer.max_model_len
        proposer.model.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module, args):
        self.counters["head_forwards"] += 1

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.slot.pop(rid, None)
            self.gap_start.pop(rid, None)
            self.written_end.pop(rid, None)
            self.blocks.pop(rid, None)

    def leave_holes(self, req_ids, finished: bool = False) -> None:
        """These requests' blocks go back to the prefix cache with their open gaps un-caught-up:
        mark the gaps' blocks for eviction (a later hit would draft over a hole) and forget
        them. Preempted: evicted before the next step (the request resumes on them);
        finished: kept while K = 0 holds (`evict_holes`)."""
        if self.evict_holes and self.core_evicts:
            for rid in req_ids:
                if rid in self.gap_start:
                    (self.kept_holes if finished else self.holes).update(self.blocks.get(rid, ()))
        self.forget(req_ids)

    def disable(self, why: str) -> None:
        if self.enabled:
            log.warning("P-EAGLE K=0 skip disabled for this engine: %s", why)
        self.enabled = False
        self.forget(list(self.slot))
        self.hidden = self.tokens = None

    def _alloc(self, like_hidden, like_tokens) -> None:
        import torch

        if self.hidden is not None:
            return
        per_token = like_hidden.shape[1] * like_hidden.element_size() + like_tokens.element_size()
        width = self.width or min(self.max_model_len, STASH_BUDGET_BYTES // (self.max_reqs * per_token))
        if width < 2:
            raise ValueError(f"stash budget too small for one position per request (width {width!r})")
        self.hidden = torch.empty(self.max_reqs, width, like_hidden.shape[1], dtype=like_hidden.dtype,
                                  device=like_hidden.device)
        self.tokens = torch.empty(self.max_reqs, width, dtype=like_tokens.dtype, device=like_tokens.device)

    def _new_slot(self, rid: str) -> int:
        used = set(self.slot.values())
        free = next(s for s in range(self.max_reqs) if s not in used)
        self.slot[rid] = free
        return free

    def _note_blocks(self, rid: str, end: int, table, row: int) -> None:
        """Record the block ids under rid's gap up to position `end` (exclusive), reading
        the step's block table only when the gap reaches a new block."""
        first = self.gap_start[rid] // self.block_size
        have = self.blocks.setdefault(rid, [])
        need = (end - 1) // self.block_size + 1 - first
        if len(have) < need:
            have.extend(table[row, first + len(have):first + need].tolist())


def state_for(proposer: Any) -> State:
    st = getattr(proposer, ATTR, None)
    if st is None:
        st = State(proposer)
        setattr(proposer, ATTR, st)
    return st


def _rows(step, cad):
    """(req_ids, first positions, query lengths) of the step's rows, from the CPU side."""
    so, batch = step
    num_reqs = cad.batch_size()
    qsl = cad.query_start_loc_cpu[: num_reqs + 1].tolist()
    lens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
    req_ids = list(batch.req_ids[:num_reqs])
    starts = [int(p) for p in batch.num_computed_tokens_cpu[:num_reqs]]
    if cad.seq_lens_cpu_upper_bound is not None:  # sync scheduling: exact; a mismatch means a layout we do not know
        ends = cad.seq_lens_cpu_upper_bound[:num_reqs].tolist()
        if any(p + n != e for p, n, e in zip(starts, lens, ends)):
            raise RuntimeError("step rows do not match the input batch's computed tokens")
    return req_ids, starts, lens, qsl


def propose(proposer: Any, k: int, args: dict[str, Any], run_pass: Callable[..., Any]):
    """The step's drafting: skip (K = 0, decode-only) or catch up open gaps, then run."""
    st = state_for(proposer)
    st.steps_since_draft = st.steps_since_draft + 1 if k == 0 else 0
    step = st.step
    if st.enabled and step is not None:
        try:
            out = _skip_or_catch_up(proposer, st, k, args, run_pass)
            if out is not None:
                return out
        except Exception as exc:  # never take the engine down: fall back to running the head
            log.exception("P-EAGLE K=0 skip failed")
            st.disable(f"{type(exc).__name__}: {exc}")
    if k == 0:
        st.counters["k0_head_runs"] += 1
    return run_pass(k, **args)


def _skip_or_catch_up(proposer, st: State, k: int, args: dict[str, Any], run_pass):
    import torch

    if st.fail_next:
        st.fail_next = False
        raise RuntimeError("injected fault (test)")
    so, _ = st.step
    cad = args["common_attn_metadata"]
    req_ids, starts, lens, qsl = _rows(st.step, cad)
    tokens, hidden = args["target_token_ids"], args["target_hidden_states"]
    # A gap whose stash has a hole (a step ran no drafter at all) cannot be caught up: drop it.
    for rid, p in zip(req_ids, starts):
        if rid in st.gap_start and not st.gap_start[rid] <= p <= st.written_end[rid]:
            st.forget([rid])
            st.counters["dropped_gaps"] += 1
    skippable = st.skip_prompts and st.core_evicts or is_decode_step(so.num_scheduled_tokens,
                                                                      so.scheduled_spec_decode_tokens)
    # M-RoPE positions are 3-D; the catch-up batch builds 1-D ones, so those models never skip.
    if k == 0 and skippable and args.get("mm_embed_inputs") is None and not getattr(proposer, "uses_mrope", False):
        st._alloc(hidden, tokens)
        width = st.hidden.shape[1]
        joining = sum(rid not in st.gap_start for rid in req_ids)
        fits = len(st.slot) + joining <= st.max_reqs and all(
            p + n - st.gap_start.get(rid, p) <= width for rid, p, n in zip(req_ids, starts, lens))
        if fits:
            _stash(st, req_ids, starts, lens, tokens, hidden, cad.block_table_tensor)
            prompt_lens = st.step[1].num_prompt_tokens
            st.counters["stashed_prompt_tokens"] += sum(
                max(0, min(p + n, int(prompt_lens[i])) - p) for i, (p, n) in enumerate(zip(starts, lens)))
            st.counters["skipped_steps"] += 1
            proposer._last_draft_probs = None
            return torch.empty(len(req_ids), 0, dtype=torch.int64, device=tokens.device)
        st.counters["flushes"] += 1
    spans = [(i, st.gap_start[rid], p) for i, (rid, p) in enumerate(zip(req_ids, starts)) if rid in st.gap_start]
    if spans and st.catch_up:
        for piece in plan_passes(spans, proposer.max_num_tokens):
            _catch_up_pass(proposer, st, piece, req_ids, starts, qsl, args, run_pass)
    st.forget([req_ids[i] for i, _, _ in spans])
    return None


def _stash(st: State, req_ids, starts, lens, tokens, hidden, block_table) -> None:
    import torch

    slots, offsets = [], []
    for row, (rid, p, n) in enumerate(zip(req_ids, starts, lens)):
        if rid not in st.gap_start:
            st.gap_start[rid] = p
            slot = st._new_slot(rid)
        else:
            slot = st.slot[rid]
        base = p - st.gap_start[rid]
        slots.extend([slot] * n)
        offsets.extend(range(base, base + n))
        st.written_end[rid] = p + n
        st._note_blocks(rid, p + n, block_table, row)
    total = len(offsets)
    index = (torch.tensor(slots, device=hidden.device), torch.tensor(offsets, device=hidden.device))
    st.hidden.index_put_(index, hidden[:total])
    st.tokens.index_put_(index, tokens[:total].to(st.tokens.dtype))


def _catch_up_pass(proposer, st: State, piece, req_ids, starts, qsl, args, run_pass) -> None:
    """One K = 0 head pass over stashed positions [a, e) of each (row, a, e) in `piece`."""
    import torch

    cad, step_tokens = args["common_attn_metadata"], args["target_token_ids"]
    device = step_tokens.device
    toks, hids, poss, nexts, qlens, seq_lens = [], [], [], [], [], []
    for row, a, e in piece:
        rid = req_ids[row]
        slot, g = st.slot[rid], st.gap_start[rid]
        toks.append(st.tokens[slot, a - g:e - g])
        hids.append(st.hidden[slot, a - g:e - g])
        poss.append(torch.arange(a, e, dtype=args["target_positions"].dtype, device=device))
        # The token after the piece: stashed (valid below the step's start) or the step's first input.
        nexts.append(st.tokens[slot, e - g:e - g + 1] if e < starts[row] else step_tokens[qsl[row]:qsl[row] + 1])
        qlens.append(e - a)
        seq_lens.append(e)
    rows_cpu = torch.tensor([row for row, _, _ in piece])
    rows = rows_cpu.to(cad.block_table_tensor.device)
    qsl_cpu = torch.zeros(len(piece) + 1, dtype=cad.query_start_loc_cpu.dtype)
    qsl_cpu[1:] = torch.cumsum(torch.tensor(qlens), 0)
    num_tokens = int(qsl_cpu[-1])
    seq_lens_cpu = torch.tensor(seq_lens, dtype=cad.seq_lens.dtype)
    sub = cad.replace(
        query_start_loc=qsl_cpu.to(device=cad.query_start_loc.device, dtype=cad.query_start_loc.dtype),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(cad.seq_lens.device),
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        num_reqs=len(piece), num_actual_tokens=num_tokens,
        max_query_len=max(qlens), max_seq_len=max(seq_lens),
        block_table_tensor=cad.block_table_tensor[rows],
        slot_mapping=torch.zeros(num_tokens, dtype=cad.slot_mapping.dtype, device=cad.slot_mapping.device),
        causal=True, positions=None, is_prefilling=None,
        req_idx=None if cad.req_idx is None else cad.req_idx[rows_cpu.numpy()],
        logits_indices_padded=None, num_logits_indices=None, max_logits_per_req=None,
        _num_computed_tokens_cache=None, _token_to_req_indices_cache=None,
    )
    next_ids = args["next_token_ids"]
    run_pass(0, target_token_ids=torch.cat(toks).to(step_tokens.dtype), target_positions=torch.cat(poss),
             target_hidden_states=torch.cat(hids), next_token_ids=torch.cat(nexts).to(next_ids.dtype),
             token_indices_to_sample=None, common_attn_metadata=sub,
             sampling_metadata=args["sampling_metadata"], mm_embed_inputs=None,
             num_rejected_tokens_gpu=None, slot_mappings=None)
    st.counters["catchup_passes"] += 1
    st.counters["catchup_tokens"] += num_tokens


def skip_possible(runner: Any) -> str | None:
    """Why this runner never skips (None: it may)."""
    if getattr(runner, "use_async_scheduling", False):
        return "async scheduling (the CPU-side positions are optimistic)"
    if runner.parallel_config.data_parallel_size > 1:
        return "data parallel > 1 (a skip would desync the ranks' collectives)"
    return None


def _wrap_runner(fn):
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if drafter is None or not applies(drafter) or skip_possible(self) is not None:
            return fn(self, scheduler_output, *args, **kwargs)
        st = state_for(drafter)
        # Finished requests' gaps were noted for the prefix cache by the core before this step
        # was scheduled (`_wrap_step`); a preempted request's blocks went back to the cache
        # while this step was scheduled, and are dropped before the next one.
        st.forget(scheduler_output.finished_req_ids)
        st.leave_holes(scheduler_output.preempted_req_ids or ())
        # and any request the runner no longer holds (finished on a step that ran no drafter),
        # so stash slots cannot leak (a request left out of one step, still running, keeps its gap)
        st.leave_holes([rid for rid in st.slot if rid not in self.requests], finished=True)
        st.step = (scheduler_output, self.input_batch)
        try:
            return fn(self, scheduler_output, *args, **kwargs)
        finally:
            st.step = None
    propose_draft_token_ids._peagle_k0 = True
    return propose_draft_token_ids


def _core_state(core: Any) -> State | None:
    """The K=0 skip state of the core's drafter, where the runner is in the core's process
    (found once, on the core's first step); marks whether the core can evict its gaps."""
    st = getattr(core, "_peagle_k0_state", False)
    if st is False:
        try:
            runner = step_split._runner(core)
        except (ValueError, AttributeError):  # workers in other processes, or overlapping steps
            runner = None
        drafter = getattr(runner, "drafter", None)
        st = state_for(drafter) if drafter is not None and applies(drafter) else None
        if st is not None:
            why = blocks_differ(runner, st.block_size)
            if why:
                log.warning("P-EAGLE K=0 skip: gaps stay in the prefix cache and prompts are not skipped: %s", why)
            st.core_evicts = why is None
        core._peagle_k0_state = st
    return st


def blocks_differ(runner: Any, block_size: int) -> str | None:
    """Why the block ids in the drafter's block table are not the prefix cache's (None: they
    are). An attention kernel with a smaller block than the cache's splits each cache block
    into several kernel blocks, and the table then holds the kernel's ids."""
    kernel = [int(b) for b in getattr(runner, "_kernel_block_sizes", None) or ()]
    if any(b != block_size for b in kernel):
        return f"kernel block sizes {kernel!r} differ from the cache's block size {block_size!r}"
    return None


def next_step_may_draft(scheduler: Any) -> bool:
    """Whether the step about to be scheduled may draft: the K the scheduler's batch-size
    table gives for the requests running and waiting (the batch it would schedule with room
    for all of them). False with nothing to schedule."""
    n = min(len(scheduler.running) + len(scheduler.waiting), scheduler.max_num_running_reqs)
    if n == 0:
        return False
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    if isinstance(lookup, _Cycle):  # a forced cycle (tests): its next K, without taking it
        return lookup.peek() > 0
    return (list.__getitem__(lookup, n) if lookup is not None else scheduler.num_spec_tokens) > 0


def evict_holes(scheduler: Any, st: State) -> None:
    """Before a step is scheduled: drop from the prefix cache the blocks of every gap its
    request left without head KV, so that no request hits them and drafts over the hole; it
    recomputes them instead. A preempted request's go now; a finished one's are kept while
    the step will not draft (K = 0: a hit costs nothing), and go before one that may."""
    if st.evict_holes and st.core_evicts:
        for rid in scheduler.finished_req_ids & st.gap_start.keys():
            st.kept_holes.update(st.blocks.get(rid, ()))
    spell = st.enabled and st.steps_since_draft >= st.keep_after_steps  # off: K = 0 runs the head again
    if st.kept_holes and (not spell or next_step_may_draft(scheduler)):
        st.holes |= st.kept_holes
        st.kept_holes = set()
    if st.holes:
        holes, st.holes = st.holes, set()
        scheduler.kv_cache_manager.evict_blocks(holes)
        st.counters["evicted_blocks"] += len(holes)


def _wrap_step(fn):
    def step(self, *args, **kwargs):
        st = _core_state(self)
        if st is not None and (st.enabled and st.gap_start or st.holes or st.kept_holes):
            try:
                evict_holes(self.scheduler, st)
            except Exception as exc:  # never take the engine down: stop skipping instead
                log.exception("P-EAGLE K=0 skip: evicting gaps from the prefix cache failed")
                st.holes, st.kept_holes = set(), set()
                st.disable(f"{type(exc).__name__}: {exc}")
        return fn(self, *args, **kwargs)
    setattr(step, ATTR, True)
    return step


def plain_sample_applies(spec_decode_metadata: Any, sampling_metadata: Any) -> bool:
    """Whether a speculating engine's step can be sampled as a plain engine's: no request
    has a draft to verify, so rejection sampling reduces to sampling the bonus token from
    the target's distribution (the plain sampler, same logits rows: one per request).
    Steps that return logprobs or track a thinking budget keep vLLM's own path, whose
    handling of those differs in form."""
    if spec_decode_metadata is None or spec_decode_metadata.max_spec_len != 0:
        return False
    if sampling_metadata.max_num_logprobs is not None:
        return False
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return holder is None or not holder.has_tracked_requests()


def _wrap_sample(fn):
    def _sample(self, logits, spec_decode_metadata):
        if plain_sample_applies(spec_decode_metadata, self.input_batch.sampling_metadata):
            drafter = getattr(self, "drafter", None)
            if drafter is not None and applies(drafter):
                state_for(drafter).counters["plain_sampled_steps"] += 1
            return fn(self, logits, None)
        return fn(self, logits, spec_decode_metadata)
    setattr(_sample, ATTR, True)
    return _sample


def _utility(core: Any, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Engine-core utility: apply `settings` (any of catch_up: bool, skip: bool,
    skip_prompts: bool, evict_holes: bool, keep_after_steps: int, stash_tokens: int, reset: bool,
    force_k_cycle: list[int] | None, record_drafts: bool, inject_fault: bool,
    reset_prefix_cache: bool), return the counters (and the drafts recorded, on
    record_drafts=False)."""
    runner = step_split._runner(core)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not applies(drafter):
        raise ValueError("the K=0 skip needs a P-EAGLE drafter (parallel drafting, EAGLE-3 head)")
    st = state_for(drafter)
    settings = dict(settings or {})
    unknown = set(settings) - {"catch_up", "skip", "skip_prompts", "evict_holes", "keep_after_steps", "stash_tokens",
                              "reset", "force_k_cycle", "record_drafts", "inject_fault", "reset_prefix_cache"}
    if unknown:
        raise ValueError(f"unknown K=0 skip settings {sorted(unknown)!r}")
    if "catch_up" in settings:
        st.catch_up = bool(settings["catch_up"])
    if "skip" in settings:
        st.enabled = bool(settings["skip"])
        if not st.enabled:
            st.forget(list(st.slot))
    if "skip_prompts" in settings:
        st.skip_prompts = bool(settings["skip_prompts"])
    if "evict_holes" in settings:
        st.evict_holes = bool(settings["evict_holes"])
    if "keep_after_steps" in settings:
        if int(settings["keep_after_steps"]) < 0:
            raise ValueError(f"keep_after_steps must be >= 0, got {settings['keep_after_steps']!r}")
        st.keep_after_steps = int(settings["keep_after_steps"])
    if settings.get("reset_prefix_cache"):
        if not core.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset (requests still hold blocks)")
        st.holes, st.kept_holes = set(), set()  # nothing cached is left to hit
    if "stash_tokens" in settings:
        st.forget(list(st.slot))
        st.width, st.hidden, st.tokens = int(settings["stash_tokens"]), None, None
    if "inject_fault" in settings:
        st.fail_next = bool(settings["inject_fault"])
    if settings.get("reset"):
        st.counters = dict.fromkeys(COUNTERS, 0)
        st.steps_since_draft = 0
    if "force_k_cycle" in settings:
        sched = core.scheduler
        base = getattr(sched, "_peagle_k0_saved_lookup", None) or sched.dynamic_sd_lookup
        if settings["force_k_cycle"]:
            sched._peagle_k0_saved_lookup = base
            sched.dynamic_sd_lookup = _Cycle(settings["force_k_cycle"], list(base))
        elif base is not None:
            sched.dynamic_sd_lookup, sched._peagle_k0_saved_lookup = base, None
    drafts = _record_drafts(core, settings["record_drafts"]) if "record_drafts" in settings else None
    return {"enabled": st.enabled, "drafts": drafts, "catch_up": st.catch_up, "why_never": skip_possible(runner),
            "skip_prompts": st.skip_prompts and st.core_evicts, "evict_holes": st.evict_holes and st.core_evicts,
            "stash_tokens": None if st.hidden is None else st.hidden.shape[1],
            "open_gaps": len(st.gap_start), "kept_holes": len(st.kept_holes),
            "keep_after_steps": st.keep_after_steps, **st.counters}


def _record_drafts(core: Any, on: bool) -> list[list] | None:
    """Test-only: record each request's drafts by (prompt, position of the first draft),
    keys that do not depend on timing; `on=False` stops and returns the records."""
    sched = core.scheduler
    records = getattr(sched, "_peagle_k0_drafts", None)
    if records is not None:
        del sched.update_draft_token_ids, sched._peagle_k0_drafts  # the class's method shows through
    if not on:
        return [[h, pos, drafts] for (h, pos), drafts in (records or {}).items()]
    records, update = {}, sched.update_draft_token_ids

    def recording(draft_token_ids):
        for req_id, ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            req = sched.requests.get(req_id)
            if req is not None and not req.is_finished() and not req.is_prefill_chunk and len(ids):
                records[(hash(tuple(req.prompt_token_ids)), req.num_tokens)] = [int(t) for t in ids]
        return update(draft_token_ids)

    sched.update_draft_token_ids, sched._peagle_k0_drafts = recording, records
    return None


def install() -> None:
    """Chained from `actors.any_k.install`: the runner wrappers, the core's step wrapper
    (gaps out of the prefix cache) and the utility method."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.propose_draft_token_ids, ATTR, False):
        GPUModelRunner.propose_draft_token_ids = _wrap_runner(GPUModelRunner.propose_draft_token_ids)
    sample = getattr(GPUModelRunner, "_sample", None)
    if sample is None:
        log.warning("plain sampling of steps without drafts not installed: vLLM's GPUModelRunner lacks _sample")
    elif not getattr(sample, ATTR, False):
        GPUModelRunner._sample = _wrap_sample(sample)
    if not getattr(EngineCore.step, ATTR, False):
        EngineCore.step = _wrap_step(EngineCore.step)
    if getattr(EngineCore, METHOD, None) is None:
        setattr(EngineCore, METHOD, _utility)
