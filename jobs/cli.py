"""What every job's command line shares: `--config NAME|FILE`, typed `a.b=value`
overrides, and `--dry-run`, which prints the resolved vLLM kwargs and the resource plan
and starts nothing (no Ray, no vLLM import); with `--rows N` the plan also carries the
capacity estimate for N rows (tokens/s per engine, hours, the pool a deadline needs).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable

from actors.batch_host import shards_to_keep_busy
from configs import AppConfig, ConfigError, load_config, to_vllm_kwargs
from control.plan import resolve, resource_plan
from pipelines.cpu_priority import give_way
from pipelines.runner import Inputs, Listing, input_files
from pipelines.storage import FsSpec, StorageError


OUTPUTS = "results: {out}/results/  errors: {out}/errors/  summary: {out}/_summary.json"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--config", default="tiny", help="preset name (configs/presets) or YAML path; default tiny"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print resolved engine kwargs + resource plan, start nothing"
    )
    p.add_argument(
        "--rows", type=int, default=None, metavar="N",
        help="with --dry-run: the capacity estimate for N input rows (needs pool.calibration)",
    )
    p.add_argument(
        "--nodes", type=int, default=None, metavar="N",
        help="with --dry-run: plan a pool that fills N GPU nodes (pool.min_actors = pool.max_actors = "
        "N x engines per node)",
    )
    p.add_argument("overrides", nargs="*", metavar="a.b=value", help="typed config overrides")
    return p


def dry_run_report(cfg: AppConfig, num_rows: int | None = None) -> dict:
    """What the run would start (`control.plan.resolve`): the batch engines' vLLM kwargs,
    the start-up K table included, and the resource plan."""
    run = resolve(cfg, num_rows)
    plan = run.resources
    shown = plan.as_dict()
    if plan.capacity is not None:
        shown["capacity"]["shards_to_keep_engines_busy"] = shards_to_keep_busy(plan.max_actors)
    return {
        "name": cfg.name,
        "vllm_kwargs": to_vllm_kwargs(run.batch.engine),
        "resource_plan": {**shown, "summary": plan.describe()},
        "sampling": cfg.sampling.model_dump(),
        "input": cfg.input,
        "output": cfg.output,
        "notes": list(cfg.notes),
    }


def parse_config(args: argparse.Namespace) -> AppConfig:
    """Load the config or exit with status 2 and a message naming the bad key/value."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for note in cfg.notes:
        logging.getLogger(__name__).warning("config: %s", note)
    return cfg


def handle_dry_run(args: argparse.Namespace, cfg: AppConfig) -> bool:
    """Print the dry-run report if asked; True means the caller should stop. Exits 2
    naming the value where `--rows` / `--nodes` cannot be planned."""
    if not args.dry_run and (args.nodes is not None or args.rows is not None):
        print("error: --rows and --nodes plan a run (--dry-run); a job counts its own rows", file=sys.stderr)
        raise SystemExit(2)
    if args.nodes is not None:
        cfg = on_nodes(cfg, args.nodes)
    if args.rows is not None and (args.rows < 0 or cfg.capacity_calibration() is None):
        print(f"error: --rows {args.rows!r} needs rows >= 0 and a calibration to estimate from: set "
              "pool.calibration (a name under configs/calibration, or a path)", file=sys.stderr)
        raise SystemExit(2)
    if args.dry_run:
        print(json.dumps(dry_run_report(cfg, args.rows), indent=2))
    return args.dry_run


def on_nodes(cfg: AppConfig, num_nodes: int) -> AppConfig:
    """`cfg` with a pool that fills `num_nodes` GPU nodes; exits 2 naming the value where
    that means nothing (fewer than one node, a CPU pool)."""
    per_node = resource_plan(cfg).actors_per_node
    if num_nodes < 1 or per_node is None:
        print(f"error: --nodes {num_nodes!r} needs N >= 1 and a GPU pool (pool.device=gpu with "
              f"pool.gpus_per_node); got pool.device={cfg.pool.device!r}", file=sys.stderr)
        raise SystemExit(2)
    engines = num_nodes * per_node
    return cfg.model_copy(update={"pool": cfg.pool.model_copy(update={"min_actors": engines, "max_actors": engines})})


def require_input_output(cfg: AppConfig) -> bool:
    """Batch jobs need both; False (after saying which is missing) when not."""
    if cfg.input and cfg.output:
        return True
    print(f"error: input and output are required, got input={cfg.input!r} output={cfg.output!r}",
          file=sys.stderr)
    return False


def start_runtime() -> None:
    """Logging, and Ray: the cluster of `ray job submit` / RAY_ADDRESS, else a local one."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import ray
    import ray.data

    ray.init(ignore_reinit_error=True)
    # A stage's own exception (e.g. pipelines.storage.StorageError naming the path), not
    # Ray Data's UserCodeException around it: run_or_explain reports it as it is.
    ray.data.DataContext.get_current().raise_original_map_exception = True


def run_or_explain(run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """`run()`'s summary; None (after printing why) when storage failed persistently
    (no such bucket, access denied, retries exhausted), also inside a Ray task: the job
    stops with a message naming the path, not a traceback or a hang. Transient S3 errors
    never get here (pipelines.storage retries them)."""
    try:
        return run()
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, StorageError):
            cause = getattr(cause, "cause", None) or cause.__cause__
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        return None


def job_main(argv: list[str] | None, doc: str, run: Callable[[AppConfig, Listing], dict[str, Any]], where: str,
             dry_run: Callable[[AppConfig], dict[str, Any]] | None = None, inputs: Inputs = input_files,
             engines: bool = True) -> int:
    """A shard job's command line: parse, dry-run (the engines' plan unless the job runs
    none, then `dry_run(cfg)`'s own part), refuse a run without input/output, list the
    input (`inputs`; none there is refused before Ray starts), run on that listing, print
    the summary and `where` (`{out}`: the output prefix). Exit 0 when every row is
    accounted for, 1 when not, 2 on bad input."""
    args = parser(doc.strip().splitlines()[0]).parse_args(argv)
    cfg = parse_config(args)
    if (args.dry_run and not engines) or handle_dry_run(args, cfg):
        if dry_run is not None:
            print(json.dumps(dry_run(cfg), indent=2))
        return 0
    if not require_input_output(cfg):
        return 2
    if cfg.serve_app:  # this driver's work gives way to the replicas it shares a node with
        give_way(cfg.batch_client.nice)
    try:
        shards = inputs(FsSpec(cfg.s3_endpoint_url), cfg.input)
    except OSError as exc:  # no shards there, no such bucket, access denied
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start_runtime()
    summary = run_or_explain(lambda: run(cfg, shards))
    if summary is None:
        return 2
    return print_summary(summary, where.format(out=cfg.output.rstrip("/")))


def print_summary(summary: dict[str, Any], where: str) -> int:
    """The summary without the bulky parts, where the outputs are, and the exit status:
    0 only when every input row is accounted for."""
    brief = {k: v for k, v in summary.items() if k not in ("config", "per_shard", "scoring")}
    print(json.dumps(brief, indent=2))
    print(where)
    return 0 if summary["reconciled"] else 1
