"""Ray Data stages of the batch pipeline: read+parse a shard, and run rows on an engine.

`ReadShard` turns one shard reference into rows (shard, line_no, shard_rows, custom_id,
kind, request JSON or error JSON). `EngineStage` holds one `Engine` per Ray Data actor and
runs every row of a batch concurrently, and Ray Data runs several batches per actor at
once, so vLLM keeps batching across rows and batches (no idle engine while the slowest
row of one batch finishes).
Rows that already carry an error pass through untouched. Knows nothing about S3 output
or commit semantics (`pipelines.sink`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from typing import Any

from pipelines.rows import RowError, parse_line, parse_row
from pipelines.storage import FsSpec, Shard, StorageError, read_shard

ROW_COLUMNS = ("shard", "line_no", "shard_rows", "custom_id", "kind", "request", "error")
# Batches one actor works on at once: Ray Data runs up to this many calls of an async
# UDF concurrently per task (RAY_DATA_DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY, 4). A slow
# row holds back only its own batch's output; the engine keeps batching the others.
CONCURRENT_BATCHES_PER_ACTOR = 4


def _error_json(reason: str, message: str) -> str:
    return json.dumps({"reason": reason, "message": message})


class ReadShard:
    """flat_map callable: one {shard, uri, format} item -> one row per input line."""

    def __init__(self, fs_spec: FsSpec):
        self.fs_spec = fs_spec

    def __call__(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        shard = Shard(name=item["shard"], uri=item["uri"], format=item["format"])
        rows = []
        try:
            raw_rows = list(read_shard(self.fs_spec, shard))
        except StorageError:  # the store refused (retries spent): stop the job, commit nothing of it
            raise
        except Exception as exc:  # an unreadable shard (corrupt file) is one error row, not a dead job
            raw_rows = None
            rows.append(self._row(shard, 1, None, None, None, _error_json(
                "unreadable_shard", f"{shard.uri}: {type(exc).__name__}: {exc}")))
        for line_no, raw in enumerate(raw_rows or [], start=1):
            try:
                custom_id, request, kind = parse_line(raw) if isinstance(raw, str) else parse_row(raw)
                rows.append(self._row(shard, line_no, custom_id, kind, json.dumps(request), None))
            except RowError as err:
                rows.append(self._row(shard, line_no, err.custom_id, None, None,
                                      _error_json(err.reason, err.message)))
        for row in rows:
            row["shard_rows"] = len(rows)
        return rows

    @staticmethod
    def _row(shard, line_no, custom_id, kind, request, error) -> dict[str, Any]:
        return {"shard": shard.name, "line_no": line_no, "shard_rows": 0, "custom_id": custom_id,
                "kind": kind, "request": request, "error": error}


class EngineStage:
    """map_batches callable class (run on an actor pool): rows -> rows + `result` JSON.

    Each output row also carries this actor's cumulative engine statistics
    (`engine_key`, `engine_stats`), so the driver can total them without another
    channel to the actors."""

    def __init__(self, cfg: dict[str, Any]):
        from actors.engine import Engine
        from configs.schema import AppConfig

        app = AppConfig.model_validate(cfg)
        self.engine = Engine(app.engine, app.sampling, device=app.pool.device)
        self.engine_key = f"{os.getpid()}-{time.time_ns()}"
        # Rows in the engine at once, across all batches and blocks this actor holds.
        self.slots = asyncio.Semaphore(app.pool.max_requests_in_flight)

    async def _run_row(self, row: dict[str, Any]) -> dict[str, Any]:
        out = {k: row[k] for k in ROW_COLUMNS}
        if row["error"] is None:
            async with self.slots:
                result = await self.engine.generate(json.loads(row["request"]))
            if result["ok"]:
                out["result"] = json.dumps(result)
            else:
                out["error"] = _error_json(result["error"]["reason"], result["error"]["message"])
                out["result"] = None
        else:
            out["result"] = None
        return out

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = [_plain(dict(zip(batch, values))) for values in zip(*batch.values())]
        done = await asyncio.gather(*(self._run_row(r) for r in rows))
        return self._columns(list(done))

    def __del__(self):
        # Ray Data calls this when it retires the actor: stop the engine core first, so
        # teardown does not log a spurious EngineDeadError from the output handler.
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # best effort at teardown; the process is going away anyway
                pass

    def _columns(self, rows: list[dict[str, Any]]) -> dict[str, list]:
        stats = json.dumps(self.engine.stats_dict())
        cols = {k: [r[k] for r in rows] for k in (*ROW_COLUMNS, "result")}
        cols["engine_key"] = [self.engine_key] * len(rows)
        cols["engine_stats"] = [stats] * len(rows)
        return cols


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """numpy scalars -> Python values (Ray Data hands numpy batches). A column that is
    null in every row of a block arrives as float NaN; it means None."""
    out = {}
    for key, value in row.items():
        value = value.item() if hasattr(value, "item") else value
        out[key] = None if isinstance(value, float) and math.isnan(value) else value
    return out
