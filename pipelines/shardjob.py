"""What every shard job shares: reading shards into rows and draining a dataset into the
job's committer (`pipelines.sink.ShardCommitter`).

A shard job is a short spec over these: a parser (raw record -> [(custom_id, payload)]),
a stage that adds `result` to rows (`actors.row_stage.RowStage`, the base of the engine
stage `actors.batch_host.EngineStage` and of the Serve client `pipelines.serve_stage`, or
any other map_batches callable), and a render and tally for the committer. Codegen
(`pipelines.codegen`), likelihood scoring (`pipelines.score_logprobs`) and code scoring
(`pipelines.score_code`) are three such specs.

Rows carry `actors.row_stage.ROW_COLUMNS`: row_no is unique within the shard (one input
line may give several rows, e.g. n samples), line_no 1-based across the shard's files.
Errors belong to rows: a bad line is one error row, an unreadable file one error row;
only a store that refuses (retries spent) stops the job. Knows nothing about engines, S3
layout or commit semantics.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from actors.row_stage import error_json
from pipelines.cpu_priority import give_way
from pipelines.rows import RowError
from pipelines.sink import ShardCommitter
from pipelines.storage import FsSpec, Shard, StorageError, read_shard

if TYPE_CHECKING:  # Ray is imported where it is used (actors/batch_host.py says why)
    import ray.data

log = logging.getLogger(__name__)

# Reading and parsing is light; a fraction of a CPU keeps it from competing with the
# engines for whole cores on small nodes.
READ_CPUS = 0.25
PROGRESS_EVERY_S = 10.0

Parser = Callable[[Any, str, int], list[tuple[str, dict[str, Any]]]]


def shard_item(name: str, files: list[Shard]) -> dict[str, Any]:
    """One unit of work: a shard name and the files (read in order) that make it up."""
    return {"shard": name, "files": json.dumps([[f.uri, f.format] for f in files])}


def read_stage(ds: "ray.data.Dataset", fs_spec: FsSpec, parse: Parser, max_tasks: int,
               nice: int = 0) -> "ray.data.Dataset":
    """shard items -> rows, as light CPU tasks, at most `max_tasks` at once, at CPU nice
    value `nice` (pipelines.cpu_priority). Without the cap Ray Data starts as many as the
    CPUs allow (16 on 4 logical CPUs), and every one is a new worker process importing Ray:
    seconds of CPU taken at once from the engines and the online requests on the same node."""
    import ray.data

    return ds.flat_map(ReadRows(fs_spec, parse, nice), num_cpus=READ_CPUS,
                       compute=ray.data.TaskPoolStrategy(size=max_tasks))


class ReadRows:
    """flat_map callable: a shard item -> one row per parsed record. `parse(raw, shard,
    line_no)` returns [(custom_id, payload)] or raises `RowError` (any other exception is
    an `invalid_request` naming it); a bad line becomes one error row, an unreadable file
    one error row: never a failed job."""

    def __init__(self, fs_spec: FsSpec, parse: Parser, nice: int = 0):
        self.fs_spec = fs_spec
        self.parse = parse
        self.nice = nice

    def __call__(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        give_way(self.nice)
        rows: list[dict[str, Any]] = []
        line_no = 0

        def add(custom_id, payload, error):
            rows.append({"shard": item["shard"], "row_no": len(rows), "line_no": line_no, "shard_rows": 0,
                         "custom_id": custom_id, "payload": payload, "error": error})

        for uri, fmt in json.loads(item["files"]):
            try:
                raws = list(read_shard(self.fs_spec, Shard(item["shard"], uri, fmt)))
            except StorageError:  # the store refused (retries spent): stop the job, commit nothing of it
                raise
            except Exception as exc:  # a corrupt file: one error row
                line_no += 1
                add(None, None, error_json("unreadable_shard", f"{uri}: {type(exc).__name__}: {exc}"))
                continue
            for raw in raws:
                line_no += 1
                try:
                    for custom_id, payload in self.parse(raw, item["shard"], line_no):
                        add(custom_id, json.dumps(payload), None)
                except RowError as err:
                    add(err.custom_id, None, error_json(err.reason, err.message))
                except Exception as exc:  # a parser that did not foresee this record: still the row's error
                    add(None, None, error_json("invalid_request", f"{type(exc).__name__}: {exc}"))
        for row in rows:
            row["shard_rows"] = len(rows)
        return rows


def load_json_line(raw: Any) -> Any:
    """A JSONL line decoded (a Parquet row arrives decoded already)."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RowError("bad_json", f"{exc.msg} at column {exc.colno}: {raw[:80]!r}") from None


def drain(ds: "ray.data.Dataset", committer: "ShardCommitter", todo: list[str],
          status: Callable[[], str] | None = None) -> None:
    """Stream the dataset into the committer; every shard in `todo` ends committed. Logs
    progress every PROGRESS_EVERY_S (`status()` adds the job's own words)."""
    started = last = time.monotonic()
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        for row in batch.to_pylist():
            committer.add(row)
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            line = f"rows {committer.num_rows_seen} | shards committed {len(committer.markers)} | {last - started:.0f}s"
            log.info(line + (f" | {status()}" if status else ""))
    for name in todo:
        if name not in committer.markers and name not in committer.pending:
            committer.commit_empty(name)  # a shard with no rows at all
    if committer.incomplete:
        raise RuntimeError(f"shards ended incomplete (seen, expected): {committer.incomplete}")


def totals(markers: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: sum(m.get(k, 0) for m in markers.values()) for k in keys}
