import pytest

from actors.spec_stats import SpecDecodeStats, StepWindow

pytestmark = pytest.mark.unit


def test_acceptance_length_counts_bonus_token_and_per_pos_is_per_draft():
    s = SpecDecodeStats(num_spec_tokens=3)
    # 4 drafts of K=3: accepted 3, 1, 0, 2 tokens
    s.observe_drafts(2, 6, 4, [2, 1, 1])   # accepted 3 and 1
    s.observe_drafts(2, 6, 2, [1, 1, 0])   # accepted 0 and 2
    assert s.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert s.acceptance_per_pos == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s.draft_acceptance_rate == pytest.approx(6 / 12)


def test_no_drafts_means_no_acceptance_length():
    s = SpecDecodeStats()
    s.observe_tokens(10, 5, now_s=1.0)
    assert s.mean_acceptance_length is None
    assert s.output_tokens_per_s is None  # one instant: no span yet
    s.observe_tokens(0, 5, now_s=2.0)
    assert s.output_tokens_per_s == pytest.approx(10 / 1.0)


def test_merge_sums_counters_and_widens_positions():
    a = SpecDecodeStats()
    a.observe_drafts(1, 2, 2, [1, 1])
    a.observe_tokens(5, 3, now_s=10.0)
    b = SpecDecodeStats()
    b.observe_drafts(1, 4, 1, [1, 0, 0, 0])
    b.observe_tokens(7, 2, now_s=12.0)
    m = a.merge(b)
    assert m.num_drafts == 2 and m.num_accepted_tokens == 3
    assert m.num_accepted_tokens_per_pos == [2, 1, 0, 0]
    assert m.num_output_tokens == 5 and m.num_prompt_tokens == 12
    assert (m.first_token_time_s, m.last_token_time_s) == (10.0, 12.0)
    assert SpecDecodeStats.from_dict(m.as_dict()) == m


def test_step_window_infers_each_steps_k_and_counts_drafts_per_position():
    w = StepWindow(max_gap_s=0.5)
    w.observe_step(10.00, 4, 0, 0, [])  # first step: no previous step, so no time yet
    w.observe_step(10.05, 4, 4, 16, [3, 2, 1, 0])  # K=4
    w.observe_step(10.10, 4, 4, 16, [4, 3, 1, 1])
    w.observe_step(10.12, 8, 8, 16, [5, 1])  # K=2 at batch 8
    w.observe_step(12.00, 8, 8, 16, [6, 2])  # after an idle gap: counted, but not timed
    w.observe_step(12.03, 8, 8, 16, [0, 0], num_prefill_tokens=40)  # a prefill step: not timed
    w.observe_step(12.05, 0, 0, 0, [])  # idle
    w.observe_step(12.07, 2, 2, 4, [1, 1])  # first step after idle: not timed
    out = w.drain()
    assert out["drafts_per_pos"] == [34, 34, 8, 8]  # positions 3-4 drafted only at K=4
    assert out["accepted_per_pos"] == [19, 9, 2, 1]
    steps = {(s["batch_size"], s["num_speculative_tokens"]): s for s in out["steps"]}
    assert set(steps) == {(4, 4), (8, 2)}
    assert steps[(4, 4)]["num_steps"] == 2 and steps[(4, 4)]["mean_step_time_s"] == pytest.approx(0.05)
    assert steps[(8, 2)]["num_steps"] == 1 and steps[(8, 2)]["mean_step_time_s"] == pytest.approx(0.02)
    assert out["num_steps_by_k"] == {0: 1, 2: 4, 4: 2}  # every step with requests, timed or not
    assert w.drain() == {"drafts_per_pos": [], "accepted_per_pos": [], "steps": [], "busy": [],
                         "num_steps_by_k": {}}  # a new window


def test_step_window_keeps_prefill_steps_in_the_time_per_output_token():
    w = StepWindow(max_gap_s=0.5)
    w.observe_step(10.00, 2, 2, 8, [2, 1, 0, 0], num_output_tokens=5)  # first step: no time yet
    w.observe_step(10.02, 2, 2, 8, [2, 2, 1, 0], num_output_tokens=7)  # decode, K=4: 20 ms
    w.observe_step(10.10, 2, 2, 8, [1, 0, 0, 0], num_prefill_tokens=300, num_output_tokens=3)  # prefill: 80 ms
    w.observe_step(11.00, 2, 2, 8, [2, 2, 2, 2], num_output_tokens=10)  # after an idle gap: not timed
    out = w.drain()
    # Decode steps alone: one 20 ms step; as the engine ran: 100 ms for 10 tokens.
    assert [(s["batch_size"], s["num_steps"]) for s in out["steps"]] == [(2, 1)]
    assert out["busy"] == [{"batch_size": 2, "num_speculative_tokens": 4, "num_steps": 2,
                            "seconds": pytest.approx(0.10), "output_tokens": 10}]


def test_step_window_does_not_time_the_step_that_straddles_a_table_change():
    w = StepWindow(max_gap_s=0.5)
    w.observe_step(10.00, 1, 1, 4, [0])
    w.observe_step(10.01, 1, 1, 4, [0])  # timed: 10 ms
    w.skip_next_gap()  # a K table change handled between steps
    w.observe_step(10.05, 1, 0, 0, [])  # its gap holds the change: not timed
    w.observe_step(10.06, 1, 0, 0, [])  # timed: 10 ms
    steps = {(s["batch_size"], s["num_speculative_tokens"]): s for s in w.drain()["steps"]}
    assert steps[(1, 4)]["num_steps"] == 1 and steps[(1, 0)]["num_steps"] == 1
    assert steps[(1, 0)]["mean_step_time_s"] == pytest.approx(0.01)
