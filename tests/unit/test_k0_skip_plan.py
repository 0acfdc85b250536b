"""How a P-EAGLE K=0 skip's stashed gaps are cut into catch-up passes, which steps are
sampled as a plain engine's, which blocks a gap left open drops from the prefix cache,
and the test-only per-step K cycle (actors.k0_skip): plain numbers, no engine. The engine-level proof
(lossless, no head forward on skipped steps, acceptance after a gap = without one) is
in tests/integration/test_k0_skip.py."""

import pytest

from types import SimpleNamespace

import torch

from actors.k0_skip import (State, _Cycle, _core_state, evict_holes, next_step_may_draft, plain_sample_applies,
                             plan_passes)

pytestmark = pytest.mark.unit


def test_gaps_that_fit_run_as_one_pass_with_one_piece_per_request():
    assert plan_passes([(0, 10, 14), (3, 7, 9)], max_tokens=16) == [[(0, 10, 14), (3, 7, 9)]]


def test_a_long_gap_is_split_across_passes_in_position_order():
    passes = plan_passes([(0, 0, 10), (1, 5, 8)], max_tokens=4)
    assert passes == [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10), (1, 5, 7)], [(1, 7, 8)]]
    for p in passes:
        assert sum(e - a for _, a, e in p) <= 4
        assert len({row for row, _, _ in p}) == len(p)  # a request at most once per pass
    covered = {}
    for p in passes:
        for row, a, e in p:
            assert covered.get(row, a) == a  # each piece starts where the last one ended
            covered[row] = e
    assert covered == {0: 10, 1: 8}


def test_empty_gaps_run_nothing_and_a_zero_budget_is_refused_by_value():
    assert plan_passes([(0, 5, 5)], max_tokens=8) == []
    with pytest.raises(ValueError, match="got 0"):
        plan_passes([(0, 0, 1)], max_tokens=0)


def test_a_forced_k_cycle_answers_every_batch_size_in_turn_and_keeps_the_table_for_slices():
    lookup = _Cycle([4, 0, 0], base=[4] * 33)
    assert [lookup[b] for b in (1, 7, 32, 5)] == [4, 0, 0, 4]
    assert lookup[1:3] == [4, 4]


class _Holder:
    def __init__(self, tracked: bool):
        self.tracked = tracked

    def has_tracked_requests(self) -> bool:
        return self.tracked


def _sampling(logprobs=None, holder=None):
    return SimpleNamespace(max_num_logprobs=logprobs, thinking_budget_state_holder=holder)


def test_only_a_step_with_no_draft_to_verify_skips_the_rejection_sampler():
    no_drafts, drafts = SimpleNamespace(max_spec_len=0), SimpleNamespace(max_spec_len=3)
    assert plain_sample_applies(no_drafts, _sampling())
    assert plain_sample_applies(no_drafts, _sampling(holder=_Holder(False)))
    assert not plain_sample_applies(drafts, _sampling())
    assert not plain_sample_applies(None, _sampling())  # a plain engine: vLLM's path already


def test_steps_wanting_logprobs_or_a_thinking_budget_keep_vllms_path():
    no_drafts = SimpleNamespace(max_spec_len=0)
    assert not plain_sample_applies(no_drafts, _sampling(logprobs=0))
    assert not plain_sample_applies(no_drafts, _sampling(logprobs=5))
    assert not plain_sample_applies(no_drafts, _sampling(holder=_Holder(True)))


class _Scheduler:
    """What `evict_holes` reads and calls on vLLM's scheduler: the requests finished since
    the last step, those running and waiting, the batch-size -> K table, and the prefix
    cache's eviction by block id (recorded here). `table`: K at batch sizes 1..4."""

    def __init__(self, finished=(), running=1, waiting=0, table=(4, 4, 0, 0)):
        self.finished_req_ids = set(finished)
        self.running, self.waiting = [object()] * running, [object()] * waiting
        self.max_num_running_reqs, self.num_spec_tokens = 4, 4
        self.dynamic_sd_lookup = [4, *table]
        self.evicted = []
        self.kv_cache_manager = SimpleNamespace(evict_blocks=lambda ids: self.evicted.append(set(ids)))


def _state(block_size=32):
    proposer = SimpleNamespace(
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4),
                                    cache_config=SimpleNamespace(block_size=block_size)),
        max_model_len=512, model=SimpleNamespace(register_forward_pre_hook=lambda hook: None))
    st = State(proposer)
    st.core_evicts = True  # as `_core_state` marks it where the core reaches the runner
    return st


def _open_gap(st, rid, start, end, table, row):
    """rid's gap [start, end) as the stash leaves it, stashed one token at a time."""
    st.gap_start[rid], st.slot[rid] = start, len(st.slot)
    for pos in range(start, end):
        st.written_end[rid] = pos + 1
        st._note_blocks(rid, pos + 1, table, row)


TABLE = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])


def test_a_gap_records_the_blocks_under_it_from_its_first_block_on():
    st = _state()
    _open_gap(st, "a", 40, 70, TABLE, 0)  # positions 40..69: blocks 1 and 2 of 32 tokens
    _open_gap(st, "b", 0, 33, TABLE, 1)  # 0..32: blocks 0 and 1
    assert st.blocks == {"a": [11, 12], "b": [20, 21]}


def test_a_finished_requests_gap_stays_cached_under_k0_and_leaves_before_a_step_that_may_draft():
    st = _state()
    st.steps_since_draft = st.keep_after_steps  # a K=0 spell that has lasted
    _open_gap(st, "a", 40, 70, TABLE, 0)
    _open_gap(st, "b", 0, 10, TABLE, 1)
    busy = _Scheduler(finished={"a", "gone-without-a-gap"}, running=3, waiting=5)  # batch 4: K=0
    evict_holes(busy, st)
    assert busy.evicted == [] and st.kept_holes == {11, 12}  # a hit under K=0 costs nothing
    evict_holes(_Scheduler(running=2, waiting=1), st)  # batch 3: still K=0
    assert st.kept_holes == {11, 12} and st.counters["evicted_blocks"] == 0
    quiet = _Scheduler(running=1)  # batch 1: K=4, the next step may draft
    evict_holes(quiet, st)
    assert quiet.evicted == [{11, 12}] and st.counters["evicted_blocks"] == 2 and not st.kept_holes
    evict_holes(_Scheduler(), st)  # nothing new finished: nothing evicted twice
    assert st.counters["evicted_blocks"] == 2


def test_whether_the_next_step_may_draft_follows_the_table_at_the_batch_it_would_schedule():
    assert next_step_may_draft(_Scheduler(running=1, waiting=1))  # batch 2: K=4
    assert not next_step_may_draft(_Scheduler(running=2, waiting=1))  # batch 3: K=0
    assert not next_step_may_draft(_Scheduler(running=9, waiting=9))  # capped at 4: K=0
    assert not next_step_may_draft(_Scheduler(running=0, waiting=0))  # nothing to schedule
    sched = _Scheduler(running=1)
    sched.dynamic_sd_lookup = _Cycle([0, 4], base=[4] * 5)  # a forced cycle: its next K, not taken
    assert not next_step_may_draft(sched) and not next_step_may_draft(sched)
    assert [sched.dynamic_sd_lookup[1], sched.dynamic_sd_lookup[1]] == [0, 4]


def test_a_preempted_requests_gap_is_evicted_and_forgotten_a_running_one_kept():
    st = _state()
    _open_gap(st, "a", 40, 70, TABLE, 0)
    _open_gap(st, "b", 0, 10, TABLE, 1)
    st.leave_holes(["a"])
    assert "a" not in st.gap_start and "a" not in st.slot and "b" in st.gap_start
    sched = _Scheduler(running=4)  # K=0, yet it resumes on its own blocks: they go now
    evict_holes(sched, st)
    assert sched.evicted == [{11, 12}] and not st.holes
    st.leave_holes(["b"], finished=True)  # gone from the runner: finished, kept while K=0 holds
    assert st.kept_holes == {20} and "b" not in st.slot


def test_with_eviction_off_a_gap_left_open_stays_in_the_prefix_cache():
    st = _state()
    st.evict_holes = False
    _open_gap(st, "a", 40, 70, TABLE, 0)
    _open_gap(st, "b", 0, 10, TABLE, 1)
    st.leave_holes(["b"])
    sched = _Scheduler(finished={"a"})
    evict_holes(sched, st)
    assert sched.evicted == [] and st.counters["evicted_blocks"] == 0


def _core(kernel_block_sizes, workers=1, block_size=32):
    """A core whose executor holds `workers` workers, the first with a P-EAGLE drafter."""
    st = _state(block_size)
    st.core_evicts = False
    drafter = SimpleNamespace(parallel_drafting=True, method="eagle3", pass_hidden_states_to_model=True,
                              needs_extra_input_slots=True, _peagle_k0=st)
    runner = SimpleNamespace(drafter=drafter, _kernel_block_sizes=kernel_block_sizes)
    worker = SimpleNamespace(model_runner=runner)
    return SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker, workers=[worker] * workers),
                           batch_queue=None)


def test_the_core_evicts_gaps_and_skips_prompts_only_where_block_ids_are_the_caches():
    assert _core_state(_core([32])).core_evicts
    split = _core_state(_core([16]))  # a kernel block of 16 inside each 32-token cache block
    assert split is not None and not split.core_evicts
    assert _core_state(_core([32], workers=2)) is None  # the runner is out of the core's reach


def test_where_the_core_cannot_evict_a_gap_left_open_marks_no_blocks():
    st = _state()
    st.core_evicts = False
    _open_gap(st, "a", 40, 70, TABLE, 0)
    st.leave_holes(["a"])
    sched = _Scheduler(finished={"a"})
    evict_holes(sched, st)
    assert not st.holes and sched.evicted == [] and "a" not in st.slot


def test_in_a_k0_spell_too_short_to_last_a_finished_gap_leaves_at_once():
    # A closed loop that moves every few steps between a batch size that drafts and one that
    # does not: a request joining on a K=0 step would hit the hole, then draft over it.
    st = _state()
    st.steps_since_draft = st.keep_after_steps - 1
    _open_gap(st, "a", 40, 70, TABLE, 0)
    busy = _Scheduler(finished={"a"}, running=4)  # the next step will not draft either
    evict_holes(busy, st)
    assert busy.evicted == [{11, 12}] and not st.kept_holes
