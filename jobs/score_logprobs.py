"""Likelihood scoring: (prompt, completion) shards from S3 -> log-probabilities -> S3.

    python -m jobs.score_logprobs --config tiny input=s3://bucket/pairs/ \
        output=s3://bucket/logprobs/ [s3_endpoint_url=http://127.0.0.1:5555] \
        [scoring.logprobs.token_logprobs=true] [scoring.logprobs.num_top_logprobs=5] \
        [a.b=value ...] [--dry-run]

Also as `ray job submit --working-dir . -- python -m jobs.score_logprobs ...`. Input rows
{"custom_id" or "id", "prompt", "completion"}; output lines {"custom_id", "score":
{total_logprob, mean_logprob, num_tokens, perplexity, num_prompt_tokens[, token_ids,
token_logprobs, top_logprobs]}} in results/NAME.jsonl, rows that could not be scored in
errors/NAME.jsonl with a reason (bad_json, missing_field, invalid_request,
empty_prompt, empty_completion, too_long, duplicate_custom_id, engine_error), then
_commits/NAME.json: codegen's shard/commit/resume semantics. The engine keeps its
configured speculation; it cannot change a score (prefill only, see `Engine.score`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import Any

from configs import AppConfig
from configs.schema import LogprobScoringConfig
from jobs.cli import OUTPUTS, job_main
from jobs.job_report import write_report
from pipelines.score_logprobs import ScoreStage, logprob_spec
from pipelines.runner import Listing, run_shard_job
from pipelines.shardjob import totals
from pipelines.sink import summary_head

log = logging.getLogger("jobs.score_logprobs")


def run_score_logprobs(cfg: AppConfig, scoring: LogprobScoringConfig, stage_cls: type | None = None,
                       shards: Listing | None = None) -> dict[str, Any]:
    """Run (or resume) the job on `shards` (default: list `cfg.input`); returns the
    summary it also writes to `_summary.json`."""
    run = run_shard_job(cfg, logprob_spec(scoring, stage_cls or ScoreStage), shards=shards)
    markers = {**run.committed_before, **run.committer.markers}
    count = totals(markers, ("rows", "ok", "errors", "num_tokens", "total_logprob"))
    mean = count["total_logprob"] / count["num_tokens"] if count["num_tokens"] else None
    summary = {
        **summary_head("score_logprobs", cfg.input, cfg.output, len(run.shards), run.committed_before,
                       run.committer.markers),
        "num_tokens": count["num_tokens"],
        "total_logprob": count["total_logprob"],
        # Token-weighted over all scored rows (corpus perplexity), not a mean of rows.
        "mean_logprob_per_token": mean,
        "perplexity": math.exp(-mean) if mean is not None and -mean < 709 else None,
        "this_run": {"elapsed_s": round(run.elapsed_s, 2)},
        "engines": run.engines.engine_events(),
        "config": cfg.model_dump(mode="json"),
        "scoring": scoring.model_dump(),
    }
    write_report(run.store, summary, run.committer.markers, run.started_at)
    run.store.write_text("_summary.json", json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    return job_main(argv, __doc__, lambda cfg, shards: run_score_logprobs(cfg, cfg.scoring.logprobs, shards=shards),
                    OUTPUTS, dry_run=lambda cfg: {"scoring": {"logprobs": cfg.scoring.logprobs.model_dump()}})


if __name__ == "__main__":
    sys.exit(main())
