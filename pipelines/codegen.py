"""The batch code-generation job as a shard-job spec (`pipelines.runner`).

shards --(ReadRows + `ParseRequests`: CPU tasks; a row per sample)--> rows
--(EngineStage: actor pool of vLLM engines, sized by the resource plan)--> rows with
results --> OpenAI Batch output lines (`render`), token counts per shard (`tally`).
With `serve_app` set, the engine step is `ServeStage` instead: rows go to the replicas of
a running Serve app, shared with online traffic (see `serving.app`).
Only chains transforms: never calls ray.init, never touches S3 itself, never
materializes; `pipelines.runner.run_shard_job` runs the spec.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from actors.batch_host import CONCURRENT_BATCHES_PER_ACTOR, EngineStage
from configs.schema import AppConfig, SamplingDefaults
from control.plan import RunPlan
from pipelines.rows import parse_line, parse_row, response_line, sample_requests
from pipelines.runner import ShardJobSpec
from pipelines.serve_stage import ServeStage

if TYPE_CHECKING:
    import ray.data


class ParseRequests:
    """`pipelines.shardjob.ReadRows` parser: one input row -> a (custom_id, {kind,
    request}) per sample (the row's `n`, else `sampling.n`; see `pipelines.rows`)."""

    def __init__(self, sampling: SamplingDefaults | None = None):
        self.default_n = sampling.n if sampling else 1
        self.default_temperature = sampling.temperature if sampling else 0.0

    def __call__(self, raw: Any, shard: str, line_no: int) -> list[tuple[str, dict[str, Any]]]:
        custom_id, request, kind = parse_line(raw) if isinstance(raw, str) else parse_row(raw)
        return [(sample_id, {"kind": kind, "request": sample})
                for sample_id, sample in sample_requests(custom_id, request, self.default_n, self.default_temperature)]


def codegen_spec(cfg: AppConfig, stage_cls: type = EngineStage) -> ShardJobSpec:
    """The job on its own engines (`stage_cls`, on the plan's actor pool) or, with
    `serve_app` set, on a running Serve app's replicas."""
    return ShardJobSpec("codegen", ParseRequests(cfg.sampling), render(cfg.engine.model), tally, stage=stage_cls,
                        engine_step=_via_serve if cfg.serve_app else None)


def render(model_name: str):
    """A committer's render: a result -> its OpenAI Batch output line."""
    return lambda custom_id, result: response_line(custom_id, result["kind"], result, model_name)


def tally(result: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": result["num_prompt_tokens"], "output_tokens": result["num_output_tokens"]}


# A client actor only waits on handles; a fraction of a CPU is plenty.
SERVE_CLIENT_CPUS = 0.25


def _via_serve(ds: "ray.data.Dataset", cfg: AppConfig, plan: RunPlan, board) -> "ray.data.Dataset":
    """Rows go to a running Serve app's replicas (shared with online traffic)."""
    import ray.data

    return ds.map_batches(
        ServeStage,
        fn_constructor_kwargs={"cfg": cfg.model_dump(mode="json"), "board": board},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=max(1, math.ceil(cfg.batch_client.max_in_flight / CONCURRENT_BATCHES_PER_ACTOR)),
        batch_format="numpy",
        num_cpus=SERVE_CLIENT_CPUS,
    )
