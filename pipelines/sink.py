"""Driver-side sink: collects streamed rows per shard and commits each shard exactly once.

Ray Data's own writers name files per block, so they cannot say "shard X is complete";
this sink can, because every row carries its shard and the shard's row count. When the
last row of a shard arrives, its results and errors are written, then its commit marker
(`pipelines.storage.OutputStore.commit_shard`). A row seen twice (a retried task) counts
once, keyed by (shard, line_no); a custom_id already committed is turned into a
`duplicate_custom_id` error so no id appears twice across committed outputs.
Memory holds only shards in flight. Knows nothing about engines or Ray.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from actors.spec_stats import SpecDecodeStats
from pipelines.rows import error_line, response_line
from pipelines.storage import OutputStore

log = logging.getLogger(__name__)


class ShardCollector:
    """Collects streamed rows per shard and commits a shard when its last row arrives.
    Rows are keyed by `key_column` within a shard (a retried task's duplicate counts
    once); subclasses write the shard in `_commit` and record its marker."""

    key_column = "line_no"

    def __init__(self, seen_ids: set[str]):
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
        self._observe(row)
        rows = self.pending.setdefault(shard, {})
        if row[self.key_column] not in rows:
            self.num_rows_seen += 1
        rows[row[self.key_column]] = row
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

    def duplicate_error(self, row: dict[str, Any]) -> str | None:
        """The row's error, or a `duplicate_custom_id` error for a good row whose id is
        already committed; records the id as seen."""
        cid, error = row["custom_id"], row["error"]
        if error is None and cid in self.seen_ids:
            error = json.dumps({"reason": "duplicate_custom_id",
                                "message": f"custom_id {cid!r} already appears earlier in the job's output"})
        if cid is not None:
            self.seen_ids.add(cid)
        return error

    def _observe(self, row: dict[str, Any]) -> None:
        """Hook for per-row side information (engine statistics)."""

    def _commit(self, shard: str) -> None:
        raise NotImplementedError


class ShardCommitter(ShardCollector):
    """Codegen's sink: OpenAI Batch result and error lines per shard."""

    def __init__(self, store: OutputStore, model_name: str, seen_ids: set[str]):
        super().__init__(seen_ids)
        self.store = store
        self.model_name = model_name
        self.engine_stats: dict[str, dict[str, Any]] = {}

    def _observe(self, row: dict[str, Any]) -> None:
        if row.get("engine_key"):
            self.engine_stats[row["engine_key"]] = json.loads(row["engine_stats"])

    def _commit(self, shard: str) -> None:
        results, errors = [], []
        prompt_tokens = output_tokens = 0
        for line_no, row in sorted(self.pending.pop(shard).items()):
            cid, error = row["custom_id"], self.duplicate_error(row)
            if error is not None:
                err = json.loads(error)
                errors.append(error_line(cid, err["reason"], err["message"], line_no))
            else:
                result = json.loads(row["result"])
                results.append(response_line(cid, row["kind"], result, self.model_name))
                prompt_tokens += result["num_prompt_tokens"]
                output_tokens += result["num_output_tokens"]
        marker = {
            "shard": shard,
            "rows": len(results) + len(errors),
            "ok": len(results),
            "errors": len(errors),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "committed_at": time.time(),
        }
        self.store.commit_shard(shard, results, errors, marker)
        self.markers[shard] = marker
        log.info("committed shard %s: %d ok, %d errors", shard, len(results), len(errors))

    def spec_control(self) -> dict[str, dict[str, Any]]:
        """Each engine's speculation controller as last reported (engines with a fixed K
        report none): K in force, table, changes and their reasons."""
        return {key: data["spec_control"] for key, data in sorted(self.engine_stats.items())
                if data.get("spec_control")}

    def engine_events(self) -> dict[str, int]:
        """Engines seen, and their rebuilds: after a dead engine core, and in all."""
        return {"num_engines": len(self.engine_stats),
                "num_engine_deaths": sum(d.get("num_engine_deaths", 0) for d in self.engine_stats.values()),
                "num_restarts": sum(d.get("num_restarts", 0) for d in self.engine_stats.values())}

    def spec_stats(self) -> SpecDecodeStats:
        """The engines' counters as last reported, summed (each engine reports cumulative
        values; a restarted engine reports under a new key, so nothing is lost)."""
        total = SpecDecodeStats()
        for data in self.engine_stats.values():
            total = total.merge(SpecDecodeStats.from_dict(data))
        return total


def summary_head(job: str, input_uri: str, output_uri: str, num_shards: int,
                 committed_before: dict[str, dict], committed_now: dict[str, dict]) -> dict[str, Any]:
    """The part every job's `_summary.json` shares: shards and row counts over all
    committed shards (earlier runs included), and whether they reconcile."""
    markers = {**committed_before, **committed_now}
    rows, ok, errors = (sum(m[k] for m in markers.values()) for k in ("rows", "ok", "errors"))
    return {
        "job": job,
        "input": input_uri,
        "output": output_uri,
        "shards": {"total": num_shards, "committed": len(markers),
                   "skipped_already_committed": sorted(committed_before), "run_now": sorted(committed_now)},
        "rows_in": rows,
        "rows_ok": ok,
        "rows_error": errors,
        "reconciled": rows == ok + errors,
    }
