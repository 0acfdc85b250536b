"""Driver-side sink: collects streamed rows per shard and commits each shard exactly once.

Ray Data's own writers name files per block, so they cannot say "shard X is complete";
this sink can, because every row carries its shard and the shard's row count. When the
last row of a shard arrives, its result lines (the job's `render`), its error lines, then
its commit marker are written (`pipelines.storage.OutputStore.commit_shard`); the
marker's counters are the sums of the job's `tally` over the shard's results, plus the
shard's errors by reason. A row seen twice (a retried task) counts once, keyed by
(shard, row_no); a custom_id already committed is turned into a `duplicate_custom_id`
error so no id appears twice across committed outputs. Memory holds only shards in
flight. Knows nothing about engines, Ray or what a result means.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pipelines.rows import error_line
from pipelines.storage import OutputStore

log = logging.getLogger(__name__)

Render = Callable[[str, dict[str, Any]], dict[str, Any]]
Tally = Callable[[dict[str, Any]], dict[str, float]]


class ShardCommitter:
    """`add(row)` each streamed row; a shard commits when its last row arrives."""

    def __init__(self, store: OutputStore, seen_ids: set[str], render: Render, tally: Tally):
        self.store, self.render, self.tally = store, render, tally
        self.seen_ids = set(seen_ids)
        self.pending: dict[str, dict[int, dict[str, Any]]] = {}
        self.expected: dict[str, int] = {}
        self.markers: dict[str, dict[str, Any]] = {}
        self.num_rows_seen = 0

    def add(self, row: dict[str, Any]) -> str | None:
        """Take one streamed row; returns the shard name if this row completed it."""
        shard = row["shard"]
        if shard in self.markers:
            return None  # late duplicate of a retried task
        rows = self.pending.setdefault(shard, {})
        if row["row_no"] not in rows:
            self.num_rows_seen += 1
        rows[row["row_no"]] = row
        self.expected[shard] = row["shard_rows"]
        if len(rows) == self.expected[shard]:
            self._commit(shard)
            return shard
        return None

    def commit_empty(self, shard: str) -> None:
        self.pending.setdefault(shard, {})
        self.expected[shard] = 0
        self._commit(shard)

    @property
    def incomplete(self) -> dict[str, tuple[int, int]]:
        """Shards with rows still missing: name -> (seen, expected)."""
        return {s: (len(r), self.expected[s]) for s, r in self.pending.items()}

    def _duplicate_error(self, row: dict[str, Any]) -> str | None:
        """The row's error, or a `duplicate_custom_id` error for a good row whose id is
        already committed; records the id as seen."""
        cid, error = row["custom_id"], row["error"]
        if error is None and cid in self.seen_ids:
            error = json.dumps({"reason": "duplicate_custom_id",
                                "message": f"custom_id {cid!r} already appears earlier in the job's output"})
        if cid is not None:
            self.seen_ids.add(cid)
        return error

    def _commit(self, shard: str) -> None:
        results, errors, sums, reasons = [], [], {}, Counter()
        for _, row in sorted(self.pending.pop(shard).items()):
            cid, error = row["custom_id"], self._duplicate_error(row)
            if error is not None:
                err = json.loads(error)
                errors.append(error_line(cid, err["reason"], err["message"], row["line_no"]))
                reasons[err["reason"]] += 1
            else:
                result = json.loads(row["result"])
                results.append(self.render(cid, result))
                for key, value in self.tally(result).items():
                    sums[key] = sums.get(key, 0) + value
        marker = {"shard": shard, "rows": len(results) + len(errors), "ok": len(results), "errors": len(errors),
                  **sums, "error_reasons": dict(reasons), "committed_at": time.time()}
        self.store.commit_shard(shard, results, errors, marker)
        self.markers[shard] = marker
        log.info("committed shard %s: %d ok, %d errors", shard, len(results), len(errors))


def summary_head(job: str, input_uri: str, output_uri: str, num_shards: int,
                 committed_before: dict[str, dict], committed_now: dict[str, dict]) -> dict[str, Any]:
    """The part every job's `_summary.json` shares: shards and row counts over all
    committed shards (earlier runs included), whether they reconcile, and errors by reason."""
    markers = {**committed_before, **committed_now}
    rows, ok, errors = (sum(m[k] for m in markers.values()) for k in ("rows", "ok", "errors"))
    reasons = Counter()
    for m in markers.values():
        reasons.update(m.get("error_reasons", {}))
    return {
        "job": job,
        "input": input_uri,
        "output": output_uri,
        "shards": {"total": num_shards, "committed": len(markers),
                   "skipped_already_committed": sorted(committed_before), "run_now": sorted(committed_now)},
        "rows_in": rows,
        "rows_ok": ok,
        "rows_error": errors,
        "errors_by_reason": dict(sorted(reasons.items())),
        "reconciled": rows == ok + errors,
    }
