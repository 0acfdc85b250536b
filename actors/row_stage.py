"""The row protocol's stage side: what every host of it shares, as a Ray Data
map_batches callable (`RowStage`: the job's own engines, `actors.batch_host.EngineStage`;
a Serve app's replicas, `pipelines.serve_stage.ServeStage`), and the batch <-> rows
conversion the code-scoring stage uses too.

Row columns (all plain values; `pipelines.shardjob` reads them): shard, row_no, line_no,
shard_rows, custom_id, payload (JSON for the stage), error (JSON {reason, message} or
None); a stage adds `result` (JSON or None). Below `pipelines` in the layers so that the
engine's hosts in `actors` share it; knows nothing about S3, row formats or commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any

ROW_COLUMNS = ("shard", "row_no", "line_no", "shard_rows", "custom_id", "payload", "error")


def error_json(reason: str, message: str) -> str:
    return json.dumps({"reason": reason, "message": message})


def plain_rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A numpy batch -> row dicts of Python values; an all-null column arrives as NaN."""
    rows = []
    for values in zip(*batch.values()):
        row = {}
        for key, value in zip(batch, values):
            value = value.item() if hasattr(value, "item") else value
            row[key] = None if isinstance(value, float) and math.isnan(value) else value
        rows.append(row)
    return rows


def columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows with their `result` -> a batch of columns."""
    return {k: [r.get(k) for r in rows] for k in (*ROW_COLUMNS, "result")}


class RowStage:
    """What every host of the row protocol shares, as a Ray Data map_batches callable: the
    job's own engines (`actors.batch_host.EngineStage`) and a Serve app's replicas
    (`pipelines.serve_stage.ServeStage`). Every row of a batch runs concurrently; a row
    that already carries an error passes through untouched; `run`'s answer becomes the
    row's `result` (JSON), or its `error` where the answer is
    {"ok": False, "error": {reason, message}}. A host says what one row asks (`run`) and,
    where it needs to, how a row is admitted (`_admit`) and what follows a batch
    (`_after_batch`)."""

    async def run(self, custom_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _admit(self) -> Any:
        """An async context manager each row runs inside (default: none)."""
        return contextlib.nullcontext()

    async def _after_batch(self) -> None:
        """Runs once a batch's rows are done, before they go on (default: nothing)."""

    async def _run_row(self, row: dict[str, Any]) -> dict[str, Any]:
        row["result"] = None
        if row["error"] is None:
            async with self._admit():
                out = await self.run(row["custom_id"], json.loads(row["payload"]))
            if out.get("ok", True):
                row["result"] = json.dumps(out)
            else:
                row["error"] = error_json(out["error"]["reason"], out["error"]["message"])
        return row

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = await asyncio.gather(*(self._run_row(r) for r in plain_rows(batch)))
        await self._after_batch()
        return columns(list(rows))
