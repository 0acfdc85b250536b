import pytest

from actors.spec_stats import SpecDecodeStats

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
