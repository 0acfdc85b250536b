"""benchmarks.online_vs_batch's batch input: past HumanEval's 164 problems the prompts repeat
under ids of their own, so a long batch phase never trips the job's duplicate-id check."""

from benchmarks.online_vs_batch import batch_rows


def test_rows_past_the_problem_set_repeat_prompts_under_new_ids():
    rows = batch_rows(400)
    assert len(rows) == 400 and len({r["task_id"] for r in rows}) == 400
    assert rows[0]["task_id"] == "HumanEval/0" and rows[164]["task_id"] == "HumanEval/0~1"
    assert rows[164]["prompt"] == rows[0]["prompt"] and rows[328]["task_id"] == "HumanEval/0~2"
