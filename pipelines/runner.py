"""Runs a shard job end to end from its spec: resume plan, reader, engine step, exactly-once
commit, and the engines' reports. A new shard job is a `ShardJobSpec` (a parser, an engine
stage, a render and a tally) and a summary of its own.

    shards to do = input shards (spec.inputs) - committed ones (a marker in _commits/)
      --(ReadRows + spec.parse)--> rows --(spec's engine step)--> rows + result
      --> ShardCommitter(spec.render, spec.tally): results/, errors/, _commits/ per shard

The resolved config is written next to the outputs first. Owns the order of these steps
and nothing else: row shape (`pipelines.shardjob`), engines (`actors.batch_host`),
commits (`pipelines.sink`) and storage (`pipelines.storage`) live where they are named.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.batch_host import EngineReports, EngineStage, engine_pool, read_board, start_board
from configs.load import dump_config
from configs.schema import AppConfig
from control.plan import RunPlan, resolve
from pipelines.shardjob import Parser, drain, read_stage, shard_item
from pipelines.sink import Render, ShardCommitter, Tally
from pipelines.storage import FsSpec, OutputStore, Shard, list_shards

if TYPE_CHECKING:  # Ray is imported where it is used (actors/batch_host.py says why)
    import ray.data

log = logging.getLogger(__name__)

EngineStep = Callable[["ray.data.Dataset", "AppConfig", RunPlan, Any], "ray.data.Dataset"]
Listing = list[tuple[str, list[Shard]]]  # (shard name, its files in reading order) per shard
Inputs = Callable[[FsSpec, str], Listing]


def input_files(fs_spec: FsSpec, input_uri: str) -> Listing:
    """Each input file is a shard (`pipelines.storage.list_shards`)."""
    return [(s.name, [s]) for s in list_shards(fs_spec, input_uri)]


@dataclass(frozen=True)
class ShardJobSpec:
    """What a shard job is. `stage(cfg=..., board=..., **stage_kwargs)` runs on the engine
    pool, or `engine_step(ds, cfg, plan, board)` replaces that step altogether; `inputs`
    names the shards of `cfg.input` and the files (read in order) of each."""

    name: str
    parse: Parser
    render: Render
    tally: Tally = lambda result: {}
    stage: type = EngineStage
    stage_kwargs: dict[str, Any] = field(default_factory=dict)
    engine_step: EngineStep | None = None
    inputs: Inputs = input_files


@dataclass
class ShardJobRun:
    """What a run did, for the job's summary."""

    store: OutputStore
    shards: list[str]
    committed_before: dict[str, dict[str, Any]]
    todo: list[str]
    committer: ShardCommitter
    engines: EngineReports
    plan: RunPlan
    started_at: float
    elapsed_s: float


def run_shard_job(cfg: "AppConfig", spec: ShardJobSpec,
                  plan_for: Callable[[FsSpec, list[Shard]], RunPlan] | None = None,
                  status: Callable[[EngineReports], str] | None = None,
                  shards: Listing | None = None) -> ShardJobRun:
    """Run (or resume) `spec` on `cfg.input` -> `cfg.output`. `plan_for(fs_spec, files)`
    sizes the pool to the files still to read (default: the config's plan); `status`
    adds the job's words to the progress line; `shards`: the input as the command line
    already listed it (`spec.inputs`), so it is listed once."""
    import ray.data

    started, started_at = time.monotonic(), time.time()
    fs_spec = FsSpec(cfg.s3_endpoint_url)
    store = OutputStore(fs_spec, cfg.output)
    shards = spec.inputs(fs_spec, cfg.input) if shards is None else shards
    committed = store.committed()
    todo = [(name, files) for name, files in shards if name not in committed]
    log.info("%s: %d shards, %d already committed, %d to run", spec.name, len(shards), len(committed), len(todo))
    store.write_text("_config.yaml", dump_config(cfg))
    committer = ShardCommitter(store, store.committed_ids(list(committed)), spec.render, spec.tally)
    plan = plan_for(fs_spec, [f for _, files in todo for f in files]) if plan_for else resolve(cfg)
    board = start_board()
    if todo:
        items = [shard_item(name, files) for name, files in todo]
        ds = read_stage(ray.data.from_items(items, override_num_blocks=len(items)), fs_spec, spec.parse,
                        cfg.read_tasks, nice=cfg.batch_client.nice if cfg.serve_app else 0)
        if spec.engine_step is not None:
            ds = spec.engine_step(ds, cfg, plan, board)
        else:
            ds = engine_pool(ds, plan, spec.stage, board=board, **spec.stage_kwargs)
        drain(ds, committer, [name for name, _ in todo], status and (lambda: status(read_board(board))))
    return ShardJobRun(store, [name for name, _ in shards], committed, [name for name, _ in todo], committer,
                       read_board(board), plan, started_at, time.monotonic() - started)
