"""Batch code generation: prompt shards from S3 (or local) -> P-EAGLE engines -> S3.

    python -m jobs.codegen --config tiny input=s3://bucket/prompts/ output=s3://bucket/out/ \
        [s3_endpoint_url=http://127.0.0.1:5555] [a.b=value ...] [--dry-run]

Also as `ray job submit --working-dir . -- python -m jobs.codegen ...`. Committed shards
(a `_commits/NAME.json` marker under `output`) are skipped, so re-running after a crash
finishes the job without recomputing or duplicating anything. Writes `_summary.json` and
`_config.yaml` next to the outputs and prints the summary.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.batch_host import EngineStage, shards_to_keep_busy
from configs import AppConfig
from control.capacity import steady_state_vs_paper
from control.plan import ResourcePlan, RunPlan, resolve, run_engine_tokens_per_s
from jobs.cli import OUTPUTS, job_main
from jobs.job_report import TIMELINE_FILE, write_report
from pipelines.codegen import codegen_spec
from pipelines.runner import Listing, run_shard_job
from pipelines.sink import summary_head
from pipelines.storage import FsSpec, Shard, count_rows

log = logging.getLogger("jobs.codegen")

COUNT_THREADS = 8


def run_codegen(cfg: AppConfig, stage_cls: type | None = None, shards: Listing | None = None) -> dict[str, Any]:
    """Run (or resume) the job on `shards` (default: list `cfg.input`); returns the
    summary it also writes to `_summary.json`."""
    started = time.monotonic()
    run = run_shard_job(cfg, codegen_spec(cfg, stage_cls or EngineStage),
                        plan_for=lambda fs_spec, files: job_plan(cfg, fs_spec, files),
                        status=lambda engines: _status_line(engines, started), shards=shards)
    summary = build_summary(cfg, run)
    if run.plan.resources.capacity is not None:
        summary["capacity"] = capacity_summary(cfg, run.plan.resources, summary, len(run.todo),
                                               run.engines.per_engine)
    written = write_report(run.store, summary, run.committer.markers, run.started_at,
                           spec_control=run.engines.spec_control())
    if TIMELINE_FILE in written:
        summary["speculation"]["timeline_plot"] = run.store.uri_of(TIMELINE_FILE)
    run.store.write_text("_summary.json", json.dumps(summary, indent=2))
    return summary


def job_plan(cfg: AppConfig, fs_spec: FsSpec, todo: list[Shard]) -> RunPlan:
    """The run's plan (`control.plan.resolve`) for the shard files still to read. Where
    the config names a calibration, their rows are counted (`count_rows`: footers and
    heads, COUNT_THREADS shards at a time) for the capacity estimate, which also sizes the
    pool to `pool.deadline_hours`; the job's own engines only (not `serve_app`). The
    estimate is advice: if counting fails (a store fault the reader's retries would ride
    out), the job runs on the configured pool."""
    if cfg.serve_app or cfg.capacity_calibration() is None:
        return resolve(cfg)
    try:
        with ThreadPoolExecutor(COUNT_THREADS) as pool:
            rows = sum(pool.map(lambda shard: count_rows(fs_spec, shard), todo))
    except Exception as exc:  # advice only: any failure to count leaves the configured pool
        log.warning("capacity estimate skipped (pool.deadline_hours not applied), pool %d..%d as configured: "
                    "%s: %s", cfg.pool.min_actors, cfg.pool.max_actors, type(exc).__name__, exc)
        return resolve(cfg)
    run_plan = resolve(cfg, rows)
    plan = run_plan.resources
    log.info("capacity (%s, on paper): %s; pool %d..%d engines", plan.capacity["calibration"],
             plan.capacity["reason"], plan.min_actors, plan.max_actors)
    if todo and len(todo) < shards_to_keep_busy(plan.max_actors):
        log.warning("%d shards to run for up to %d engines: some will idle; split the input into >= %d shards",
                    len(todo), plan.max_actors, shards_to_keep_busy(plan.max_actors))
    return run_plan


def capacity_summary(cfg: AppConfig, plan: ResourcePlan, summary: dict[str, Any], num_shards_run: int,
                     per_engine: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The estimate on paper next to what this run measured: end to end (its hours, and
    output tokens/s per engine over the estimate's, engine start-up included), and in
    steady state (`control.capacity.steady_state_vs_paper`: the engines' time generating
    against the paper for the same work: the decode at the rate for this run's prompt and
    output lengths (`run_engine_tokens_per_s`), plus the prefill of its prompts), with the
    engines' start-up apart."""
    run = summary["this_run"]
    rows = run.get("rows") or 0
    paper_engine = (run_engine_tokens_per_s(cfg, run["prompt_tokens"] / rows, run["output_tokens"] / rows)
                    if rows else None) or plan.capacity["engine_tokens_per_s"]
    engines = max(1, min(summary["engines"]["num_engines"], plan.max_actors))
    per_engine_rate = run["output_tokens"] / run["elapsed_s"] / engines if run["elapsed_s"] > 0 else None
    generation_s = sum(max(0.0, (d.get("last_token_time_s") or 0.0) - (d.get("first_token_time_s") or 0.0))
                       for d in per_engine.values())
    startups = [d["startup_s"] for d in per_engine.values() if d.get("startup_s") is not None]
    steady = steady_state_vs_paper(run["output_tokens"], run["prompt_tokens"], generation_s,
                                   paper_engine, plan.capacity["prefill_s_per_token"])
    return {**plan.capacity, "engines_started_plain": plan.engines_start_plain, "shards_run": num_shards_run,
            "shards_to_keep_engines_busy": shards_to_keep_busy(plan.max_actors),
            "measured_hours": round(run["elapsed_s"] / 3600, 4),
            "measured_output_tokens": run["output_tokens"],
            "measured_engine_tokens_per_s": _sig4(per_engine_rate),
            "measured_vs_paper": _sig4(per_engine_rate / plan.capacity["engine_tokens_per_s"] if per_engine_rate else None),
            "measured_engine_startup_s": _sig4(max(startups)) if startups else None,
            "measured_generation_s": _sig4(generation_s),
            "engine_tokens_per_s_this_run": _sig4(paper_engine),
            **{k: _sig4(v) for k, v in steady.items()}}


def _sig4(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def _status_line(engines, started: float) -> str:
    stats = engines.spec_stats()
    line = f"{stats.num_output_tokens / max(time.monotonic() - started, 1e-9):.0f} output tok/s"
    if stats.mean_acceptance_length is not None:
        line += f" | acceptance length {stats.mean_acceptance_length:.2f}"
    ks = sorted({c["k_in_force"] for c in engines.spec_control().values()})
    if ks:
        line += f" | K in force {'/'.join(map(str, ks))}"
    return line


def controller_summary(per_engine: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What the speculation controllers did, per engine: the decided table, what was in
    force at the end (the table, or a one-interval probe; none on an engine restarted
    without speculation) and its K, how many times the table on the engine changed, how
    many intervals were probes, the latest decided changes and restarts with their
    reasons, the restart rule's latest verdict, and any advice to the operator."""
    if not per_engine:
        return None
    return {key: {"engine": c.get("engine"), "k_in_force": c["k_in_force"], "table": c.get("table"),
                  "schedule": c["schedule"], "changes": c["changes"], "probes": c.get("probes"),
                  "steps_by_k": c.get("steps_by_k", {}),
                  "reason": c["reason"], "recent_changes": c["recent_changes"][-5:],
                  "restarts": c.get("restarts", 0), "recent_restarts": c.get("recent_restarts", [])[-5:],
                  "replacement": c.get("replacement"), "capacity": c.get("capacity"), "advice": c.get("advice")}
            for key, c in per_engine.items()}


def build_summary(cfg: AppConfig, run) -> dict[str, Any]:
    markers = {**run.committed_before, **run.committer.markers}
    tokens = {k: sum(m[k] for m in markers.values()) for k in ("prompt_tokens", "output_tokens")}
    run_output_tokens = sum(m["output_tokens"] for m in run.committer.markers.values())
    stats = run.engines.spec_stats()
    return {
        **summary_head("codegen", cfg.input, cfg.output, len(run.shards), run.committed_before, run.committer.markers),
        "prompt_tokens": tokens["prompt_tokens"],
        "output_tokens": tokens["output_tokens"],
        "this_run": {
            "elapsed_s": round(run.elapsed_s, 2),
            "rows": sum(m["rows"] for m in run.committer.markers.values()),
            "prompt_tokens": sum(m["prompt_tokens"] for m in run.committer.markers.values()),
            "output_tokens": run_output_tokens,
            "output_tokens_per_s": round(run_output_tokens / run.elapsed_s, 1) if run.elapsed_s > 0 else None,
        },
        "speculation": {
            **cfg.engine.spec.brief(),
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_per_pos": [round(a, 4) for a in stats.acceptance_per_pos],
            "mean_acceptance_length": stats.mean_acceptance_length,
            "controller": controller_summary(run.engines.spec_control()),
        },
        "engines": run.engines.engine_events(),
        "per_shard": {name: {k: m[k] for k in ("rows", "ok", "errors")} for name, m in sorted(markers.items())},
        "config": cfg.model_dump(mode="json"),
    }


def main(argv: list[str] | None = None) -> int:
    return job_main(argv, __doc__, lambda cfg, shards: run_codegen(cfg, shards=shards), OUTPUTS)


if __name__ == "__main__":
    sys.exit(main())
