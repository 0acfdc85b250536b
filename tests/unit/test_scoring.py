"""Pure parts of the scoring jobs: sample parsing, codegen input, report, commits."""

import json
import subprocess
import sys

import pytest

from configs.load import split_scoring_overrides
from pipelines.score_code import (ParseSamples, codegen_input_rows, humaneval_program, pass_at_k_report,
                                    render_result, tally_result, task_of)
from pipelines.score_logprobs import likelihood, parse_logprob_row
from pipelines.rows import RowError
from pipelines.sink import ShardCommitter
from pipelines.storage import FsSpec, OutputStore

pytestmark = pytest.mark.unit

PROBLEMS = {
    "HumanEval/0": {"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
                    "entry_point": "f"},
    "HumanEval/1": {"task_id": "HumanEval/1", "prompt": "def g():\n", "test": "def check(c):\n    pass\n",
                    "entry_point": "g"},
}


def _codegen_line(cid, *texts):
    choices = [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]
    return json.dumps({"custom_id": cid, "response": {"body": {"choices": choices}}, "error": None})


def test_codegen_lines_become_samples_with_their_task_and_program():
    parse = ParseSamples(PROBLEMS, "MARK")
    [(cid, payload)] = parse(_codegen_line("HumanEval/0#3", "    return 1\n"), "s", 1)
    assert cid == "HumanEval/0#3" and payload["task_id"] == "HumanEval/0"
    assert payload["program"] == humaneval_program(PROBLEMS["HumanEval/0"], "    return 1\n", "MARK")
    assert payload["program"].endswith("check(f)\nprint('MARK')\n")
    two = parse(_codegen_line("HumanEval/1", "    pass\n", "    return 2\n"), "s", 2)
    assert [c for c, _ in two] == ["HumanEval/1#c0", "HumanEval/1#c1"]
    assert {task_of(c) for c, _ in two} == {"HumanEval/1"}


def test_generation_errors_and_empty_completions_are_verdicts_without_a_run():
    parse = ParseSamples(PROBLEMS, "MARK")
    err = json.dumps({"custom_id": "HumanEval/0#1", "response": None,
                      "error": {"code": "prompt_too_long", "message": "too long", "line": 3}})
    [(_, payload)] = parse(err, "s", 1)
    assert payload["verdict"] == {"status": "generation_error", "detail": "prompt_too_long: too long"}
    [(_, payload)] = parse(_codegen_line("HumanEval/0#2", "  \n"), "s", 2)
    assert payload["verdict"]["status"] == "empty_completion" and "program" not in payload


def test_human_eval_sample_lines_get_unique_ids_and_bad_lines_raise_row_errors():
    parse = ParseSamples(PROBLEMS, "MARK")
    [(cid, _)] = parse({"task_id": "HumanEval/1", "completion": "    pass\n"}, "shard-3", 7)
    assert cid == "HumanEval/1#shard-3:7"
    for raw, reason in (("{nope", "bad_json"), ({"task_id": "Other/1", "completion": "x"}, "unknown_task"),
                        ({"foo": 1}, "missing_field"), (json.dumps({"custom_id": "HumanEval/0", "response": {}}),
                                                        "missing_field")):
        with pytest.raises(RowError) as exc:
            parse(raw, "s", 1)
        assert exc.value.reason == reason


def _samples(rows):
    from pipelines.rows import parse_row, sample_requests

    return [sample for row in rows for sample in sample_requests(*parse_row(row)[:2])]


def test_codegen_input_gives_n_samples_per_task_with_distinct_ids_and_seeds():
    rows = codegen_input_rows(PROBLEMS, n=3, temperature=0.8, seed=10, max_tokens=64)
    samples = _samples(rows)
    assert [sid for sid, _ in samples] == [f"HumanEval/{t}#{i}" for t in range(2) for i in range(3)]
    assert [r["seed"] for _, r in samples[:3]] == [10, 11, 12] and all(r["temperature"] == 0.8 for _, r in samples)
    greedy = _samples(codegen_input_rows(PROBLEMS, n=1))
    assert [sid for sid, _ in greedy] == ["HumanEval/0", "HumanEval/1"] and "temperature" not in greedy[0][1]
    with pytest.raises(ValueError, match="temperature > 0"):
        codegen_input_rows(PROBLEMS, n=2, temperature=0.0)
    with pytest.raises(ValueError, match="got 0"):
        codegen_input_rows(PROBLEMS, n=0)


def test_codegen_input_rows_are_valid_codegen_requests():
    from pipelines.rows import parse_row

    for row in codegen_input_rows(PROBLEMS, n=2):
        custom_id, request, kind = parse_row(row)
        assert custom_id == row["id"] and kind == "completion" and request["seed"] == row["seed"]


def test_report_gives_per_task_and_overall_pass_at_k():
    results = [{"task_id": "HumanEval/1", "passed": p, "status": "passed" if p else "failed"} for p in (True, False)]
    results += [{"task_id": "HumanEval/0", "passed": False, "status": "timeout"}] * 2
    tasks, overall = pass_at_k_report(results, {**PROBLEMS, "HumanEval/2": {}}, [1, 2, 5])
    assert [t["task_id"] for t in tasks] == ["HumanEval/0", "HumanEval/1"]
    assert tasks[1] == {"task_id": "HumanEval/1", "n": 2, "c": 1, "pass_at_k": {"1": 0.5, "2": 1.0},
                        "statuses": {"passed": 1, "failed": 1}}
    assert overall["pass_at_k"] == {"1": 0.25, "2": 0.5, "5": None}
    assert overall["num_tasks_missing"] == 1 and overall["statuses"] == {"passed": 1, "failed": 1, "timeout": 2}


def _row(shard, row_no, total, cid, passed=True, error=None):
    result = None if error else json.dumps({"task_id": "HumanEval/0", "passed": passed, "status": "x", "detail": "y"})
    return {"shard": shard, "row_no": row_no, "line_no": row_no + 1, "shard_rows": total, "custom_id": cid,
            "payload": "{}", "error": error, "result": result}


def test_committer_commits_a_shard_once_whatever_the_row_order(tmp_path):
    store = OutputStore(FsSpec(), str(tmp_path))
    sink = ShardCommitter(store, {"old"}, render_result, tally_result)
    assert sink.add(_row("s", 2, 4, "c", passed=False)) is None
    assert sink.add(_row("s", 0, 4, "a")) is None
    assert sink.add(_row("s", 2, 4, "c", passed=False)) is None  # a retried task's duplicate
    assert sink.add(_row("s", 3, 4, "old")) is None
    assert sink.add(_row("s", 1, 4, None, error=json.dumps({"reason": "bad_json", "message": "m"}))) == "s"
    results = [json.loads(line) for line in (tmp_path / "results" / "s.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "errors" / "s.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "c"]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        (None, "bad_json", 2), ("old", "duplicate_custom_id", 4)]
    marker = json.loads((tmp_path / "_commits" / "s.json").read_text())
    assert (marker["rows"], marker["ok"], marker["errors"], marker["passed"]) == (4, 2, 2, 1)
    assert sink.add(_row("s", 0, 4, "a")) is None  # late duplicate after the commit


def test_logprob_rows_and_likelihood():
    assert parse_logprob_row('{"id": "a", "prompt": "p", "completion": "c"}', "s", 1) == [
        ("a", {"prompt": "p", "completion": "c"})]
    with pytest.raises(RowError, match="unsupported"):
        parse_logprob_row({"id": "a", "prompt": "p", "completion": "c", "n": 2}, "s", 1)
    with pytest.raises(RowError, match="completion must be a string"):
        parse_logprob_row({"custom_id": "a", "prompt": "p"}, "s", 1)
    got = likelihood([-1.0, -2.0, -3.0])
    assert got == {"total_logprob": -6.0, "mean_logprob": -2.0, "num_tokens": 3, "perplexity": pytest.approx(7.389056)}


def test_scoring_overrides_are_typed_and_unknown_keys_refused():
    rest, cfg = split_scoring_overrides(["engine.seed=1", "scoring.code.k=[1,5]", "scoring.code.timeout_s=3"])
    assert rest == ["engine.seed=1"] and cfg.code.k == [1, 5] and cfg.code.sandbox_limits().timeout_s == 3
    for bad in ("scoring.code.timeout=3", "scoring.code.k=[0]", "scoring.logprobs.num_top_logprobs=3"):
        with pytest.raises(ValueError, match="scoring"):
            split_scoring_overrides([bad])


def test_scoring_modules_do_not_import_vllm_torch_or_ray():
    code = ("import sys, pipelines.shardjob, pipelines.sink, actors.batch_host, pipelines.codegen, pipelines.score_code, pipelines.score_logprobs, sandbox.launch, "
            "pipelines.passk, jobs.score_code, jobs.score_logprobs; "
            "print(sorted(m for m in ('vllm', 'torch', 'ray') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
