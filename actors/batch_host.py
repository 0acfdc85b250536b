"""The engine's Ray Data host: the engine step of every engine shard job, its actor pool,
and the side channel that brings the engines' counters to the driver.

`EngineStage` holds one `actors.engine.Engine` per Ray Data actor and runs every row of a
batch concurrently, at most `pool.max_requests_in_flight` rows in the engine at once;
Ray Data runs several batches per actor at once, so vLLM keeps batching across rows and
batches (no idle engine while the slowest row of one batch finishes). What one row asks
of the engine is `run` (generation here; `pipelines.score_logprobs.ScoreStage` scores).
Rows that already carry an error pass through untouched.
`engine_pool` maps a stage over a dataset on the actor pool a `RunPlan` sizes.
After each batch a stage reports its engine's cumulative statistics to the job's
`EngineBoard` (a small Ray actor), awaited before the batch's rows go on, so the driver
reads every engine's final counters once the dataset is drained; `EngineReports` totals
them. Knows nothing about S3, row formats or commits.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import TYPE_CHECKING, Any

from actors.engine import Engine
from actors.row_stage import RowStage
from actors.spec_stats import SpecDecodeStats
from configs.schema import AppConfig
from control.plan import RunPlan

# Ray is imported where it is used: importing the jobs (as jobs.cli's --dry-run does) must
# not start Ray's import (seconds; tests/unit/test_configs.py checks it).
if TYPE_CHECKING:
    import ray.data

# Batches one actor works on at once: Ray Data runs up to this many calls of an async
# UDF concurrently per task (RAY_DATA_DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY, 4). A slow
# row holds back only its own batch's output; the engine keeps batching the others.
CONCURRENT_BATCHES_PER_ACTOR = 4


def engine_batch_size(cfg: "AppConfig") -> int:
    """Rows per engine batch, so that the batches one actor runs at once add up to
    `pool.max_requests_in_flight` requests in the engine."""
    return max(1, math.ceil(cfg.pool.max_requests_in_flight / CONCURRENT_BATCHES_PER_ACTOR))


def shards_to_keep_busy(num_engines: int) -> int:
    """Input shards that keep `num_engines` engines busy: each reads as one block and an
    engine works on CONCURRENT_BATCHES_PER_ACTOR blocks at once, so that a block that ends
    (or a slow one) never drains it; fewer shards leave engines idle."""
    return num_engines * CONCURRENT_BATCHES_PER_ACTOR


class EngineStage(RowStage):
    """The row protocol (`actors.row_stage.RowStage`) on one engine of the job's own pool
    (a map_batches callable class, run on an actor pool)."""

    def __init__(self, cfg: dict[str, Any], board=None):
        app = AppConfig.model_validate(cfg)
        self.engine = Engine(app.engine, app.sampling, device=app.pool.device)
        self.node_id = _node_id()
        self.engine_key = f"{os.getpid()}-{time.time_ns()}"
        # Rows in the engine at once, across all batches and blocks this actor holds.
        self.slots = asyncio.Semaphore(app.pool.max_requests_in_flight)
        self.board = board

    async def run(self, custom_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One row -> the engine's answer: a result, or {"ok": False, "error": {reason, message}}."""
        out = await self.engine.generate(payload["request"])
        return {**out, "kind": payload["kind"]}

    def _admit(self) -> asyncio.Semaphore:
        return self.slots

    async def _after_batch(self) -> None:
        if self.board is not None:
            await self.board.report.remote(self.engine_key, {**self.engine.stats_dict(), "node_id": self.node_id})

    def __del__(self):
        # Ray Data calls this when it retires the actor: stop the engine core first, so
        # teardown does not log a spurious EngineDeadError from the output handler.
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # best effort at teardown; the process is going away anyway
                pass


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def engine_pool(ds: "ray.data.Dataset", plan: RunPlan, stage_cls: type,
                **stage_kwargs: Any) -> "ray.data.Dataset":
    """`stage_cls(cfg=..., **stage_kwargs)` mapped over `ds` on `plan`'s actor pool.

    Placement: an engine's tensor-parallel GPUs are one actor's resources, so Ray puts
    them whole on one node (what a STRICT_PACK group of one-GPU bundles gives, with no
    group to manage; vLLM runs its TP workers as processes of that actor). Engines spread
    over the nodes (SPREAD), so a node lost takes as few engines as it can. The engines
    start as the plan resolved them (`RunPlan.batch`: without the drafter where the
    capacity estimate found that faster for the job's work)."""
    import ray.data

    return ds.map_batches(
        stage_cls,
        fn_constructor_kwargs={"cfg": plan.batch.model_dump(mode="json"), **stage_kwargs},
        compute=ray.data.ActorPoolStrategy(min_size=plan.resources.min_actors, max_size=plan.resources.max_actors),
        batch_size=engine_batch_size(plan.batch),
        batch_format="numpy",
        # Several Ray Data tasks (blocks) per actor at once, so the engine does not drain
        # at a block/shard boundary; the stage caps the requests actually in flight.
        max_concurrency=CONCURRENT_BATCHES_PER_ACTOR,
        scheduling_strategy="SPREAD",
        **plan.resources.ray_actor_options(),
    )


class EngineBoard:
    """Ray actor (`start_board`): each engine's latest cumulative statistics, by key."""

    def __init__(self):
        self.latest: dict[str, dict[str, Any]] = {}

    def report(self, key: str, stats: dict[str, Any]) -> None:
        self.latest[key] = stats

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return dict(self.latest)


def start_board():
    """The board, on the driver's node: a node lost takes engines, never what the driver reads."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=here)(EngineBoard).remote()


def read_board(board, timeout_s: float = 60.0) -> "EngineReports":
    import ray

    return EngineReports(ray.get(board.snapshot.remote(), timeout=timeout_s))


class EngineReports:
    """The engines' statistics as last reported (each engine reports cumulative values; a
    restarted or replaced engine reports under a new key, so nothing is lost)."""

    def __init__(self, per_engine: dict[str, dict[str, Any]]):
        self.per_engine = per_engine

    def spec_control(self) -> dict[str, dict[str, Any]]:
        """Each engine's speculation controller (engines with a fixed K report none): K in
        force, table, changes and their reasons."""
        return {key: data["spec_control"] for key, data in sorted(self.per_engine.items())
                if data.get("spec_control")}

    def engine_events(self) -> dict[str, Any]:
        """Engines seen, the nodes they ran on (engines per node id), their rebuilds (after
        a dead engine core, and in all), and the rows failed alone as the cause of deaths."""
        nodes: dict[str, int] = {}
        for data in self.per_engine.values():
            node = data.get("node_id") or "unknown"
            nodes[node] = nodes.get(node, 0) + 1
        counts = {key: sum(d.get(key, 0) for d in self.per_engine.values())
                  for key in ("num_engine_deaths", "num_restarts", "num_requests_failed_alone")}
        return {"num_engines": len(self.per_engine), "engines_by_node": dict(sorted(nodes.items())), **counts}

    def spec_stats(self) -> SpecDecodeStats:
        """The engines' speculative-decoding counters, summed."""
        total = SpecDecodeStats()
        for data in self.per_engine.values():
            total = total.merge(SpecDecodeStats.from_dict(data))
        return total
