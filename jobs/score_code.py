"""Functional scoring: code samples -> sandboxed runs against HumanEval's tests -> pass@k.

    python -m jobs.score_code --config tiny input=s3://bucket/codegen-out/ \
        output=s3://bucket/scores/ [s3_endpoint_url=http://127.0.0.1:5555] \
        [scoring.code.k=[1,10]] [scoring.code.timeout_s=10] [a.b=value ...] [--dry-run]

Also as `ray job submit --working-dir . -- python -m jobs.score_code ...`. `input` is a
`jobs.codegen` output prefix (only its committed shards are read: results/NAME.jsonl and
errors/NAME.jsonl), or JSONL shards of human-eval samples {"task_id", "completion"}.
Each sample runs in `sandbox.launch` (Ray tasks, at most
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
import sys
from typing import Any

from configs import AppConfig
from configs.schema import CodeScoringConfig
from jobs.cli import job_main
from jobs.job_report import write_report
from pipelines.score_code import code_scoring_spec, pass_at_k_report, read_problems
from pipelines.runner import Listing, input_files, run_shard_job
from pipelines.sink import summary_head
from pipelines.storage import FsSpec, OutputStore, Shard
from sandbox.launch import check_available

log = logging.getLogger("jobs.score_code")


def input_shards(fs_spec: FsSpec, input_uri: str) -> Listing:
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
    return input_files(fs_spec, input_uri)


def run_score_code(cfg: AppConfig, scoring: CodeScoringConfig, shards: Listing | None = None) -> dict[str, Any]:
    """Run (or resume) the job on `shards` (default: `input_shards` of `cfg.input`);
    returns the summary it also writes to `_summary.json`."""
    check_available(scoring.sandbox_limits())  # on the driver too: fail fast, never unsandboxed
    fs_spec = FsSpec(cfg.s3_endpoint_url)
    problems = read_problems(fs_spec, scoring.problems)
    marker = f"__passed_{secrets.token_hex(16)}__"
    run = run_shard_job(cfg, code_scoring_spec(problems, scoring, marker, input_shards), shards=shards)
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


def main(argv: list[str] | None = None) -> int:
    return job_main(argv, __doc__, lambda cfg, shards: run_score_code(cfg, cfg.scoring.code, shards),
                    "per sample: {out}/results/  per task: {out}/pass_at_k.jsonl  summary: {out}/_summary.json",
                    dry_run=lambda cfg: {"input": cfg.input, "output": cfg.output,
                                         "scoring": {"code": cfg.scoring.code.model_dump()},
                                         "sandbox": cfg.scoring.code.sandbox_limits().__dict__},
                    inputs=input_shards, engines=False)


if __name__ == "__main__":
    sys.exit(main())
