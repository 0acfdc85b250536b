"""The batch code-generation pipeline, as a lazy Ray Data builder.

shards --(ReadShard: read + parse, CPU tasks)--> rows --(EngineStage: actor pool of
vLLM engines, min..max from pool config)--> rows with results.
With `serve_app` set, the engine step is `ServeStage` instead: rows go to the replicas of
a running Serve app, shared with online traffic (see `serving.app`).
Only chains transforms: never calls ray.init, never touches S3 itself, never
materializes. The job iterates the dataset into `pipelines.sink.ShardCommitter`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from configs.plan import ResourcePlan, resource_plan
from configs.schema import AppConfig
from pipelines.stages import CONCURRENT_BATCHES_PER_ACTOR, EngineStage, ReadShard
from pipelines.storage import FsSpec, Shard

if TYPE_CHECKING:
    import ray.data

# Reading and parsing is light; a fraction of a CPU keeps it from competing with the
# engines for whole cores on small nodes.
READ_CPUS = 0.25


def engine_batch_size(cfg: AppConfig) -> int:
    """Rows per engine batch, so that the batches one actor runs at once add up to
    `pool.max_requests_in_flight` requests in the engine."""
    return max(1, math.ceil(cfg.pool.max_requests_in_flight / CONCURRENT_BATCHES_PER_ACTOR))


def shards_to_keep_busy(num_engines: int) -> int:
    """Input shards that keep `num_engines` engines busy: each reads as one block and an
    engine works on CONCURRENT_BATCHES_PER_ACTOR blocks at once, so that a block that ends
    (or a slow one) never drains it; fewer shards leave engines idle."""
    return num_engines * CONCURRENT_BATCHES_PER_ACTOR


def build_codegen_dataset(
    cfg: AppConfig,
    shards: list[Shard],
    fs_spec: FsSpec,
    stage_cls: type = EngineStage,
    plan: ResourcePlan | None = None,
) -> "ray.data.Dataset":
    """`plan`: the resource plan to run (default: the config's, unsized to the input)."""
    import ray.data

    plan = plan or resource_plan(cfg)
    items = [{"shard": s.name, "uri": s.uri, "format": s.format} for s in shards]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds = ds.flat_map(ReadShard(fs_spec), num_cpus=READ_CPUS)
    if cfg.serve_app:
        return _via_serve(ds, cfg)
    remote_args = {}
    if plan.accelerator_type:
        remote_args["accelerator_type"] = plan.accelerator_type
    return ds.map_batches(
        stage_cls,
        fn_constructor_kwargs={"cfg": cfg.model_dump(mode="json")},
        compute=ray.data.ActorPoolStrategy(min_size=plan.min_actors, max_size=plan.max_actors),
        batch_size=engine_batch_size(cfg),
        batch_format="numpy",
        num_cpus=plan.cpus_per_actor,
        num_gpus=plan.gpus_per_actor,
        # Several Ray Data tasks (blocks) per actor at once, so the engine does not drain
        # at a block/shard boundary; EngineStage caps the requests actually in flight.
        max_concurrency=CONCURRENT_BATCHES_PER_ACTOR,
        **remote_args,
    )


# A client actor only waits on handles; a fraction of a CPU is plenty.
SERVE_CLIENT_CPUS = 0.25


def _via_serve(ds: "ray.data.Dataset", cfg: AppConfig) -> "ray.data.Dataset":
    """Rows go to a running Serve app's replicas (shared with online traffic)."""
    import ray.data

    from pipelines.serve_stage import ServeStage

    return ds.map_batches(
        ServeStage,
        fn_constructor_kwargs={"cfg": cfg.model_dump(mode="json")},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=max(1, math.ceil(cfg.batch_client.max_in_flight / CONCURRENT_BATCHES_PER_ACTOR)),
        batch_format="numpy",
        num_cpus=SERVE_CLIENT_CPUS,
    )
