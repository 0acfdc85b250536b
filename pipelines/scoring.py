"""What the two scoring jobs share: their typed options, reading shards into rows,
committing each shard exactly once, and draining a dataset into the committer.

Row columns (all plain values): shard, row_no (unique within the shard: one input line
may give several rows, e.g. n choices), line_no (1-based, across the shard's files),
shard_rows, custom_id, payload (JSON for the stage), error (JSON {reason, message} or
None); a stage adds `result` (JSON or None). The commit protocol is codegen's
(`pipelines.storage.OutputStore.commit_shard`: results, errors, then the marker), so
resume and exactly-once hold the same way: a committed shard is never redone; a row
seen twice counts once; a custom_id already committed becomes a `duplicate_custom_id`
error. Job-specific parsing, stages and lazy builders live in `pipelines.code_scoring`
and `pipelines.logprob_scoring`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from configs.schema import CodeScoringConfig, LogprobScoringConfig, ScoringConfig  # noqa: F401 (re-export)
from pipelines.rows import RowError, error_line
from pipelines.sink import ShardCollector
from pipelines.storage import FsSpec, OutputStore, Shard, StorageError, read_shard

if TYPE_CHECKING:
    import ray.data

log = logging.getLogger(__name__)

ROW_COLUMNS = ("shard", "row_no", "line_no", "shard_rows", "custom_id", "payload", "error")
READ_CPUS = 0.25
PROGRESS_EVERY_S = 10.0


def split_scoring_overrides(overrides: list[str]) -> tuple[list[str], ScoringConfig]:
    """`scoring.*` overrides alone -> a validated `ScoringConfig` (unknown keys rejected,
    named), and the other overrides. Jobs read `AppConfig.scoring`; this is for callers
    that build scoring options without a whole config."""
    from configs.load import ConfigError, apply_overrides
    from pydantic import ValidationError

    mine = [o[len("scoring."):] for o in overrides if o.startswith("scoring.")]
    rest = [o for o in overrides if not o.startswith("scoring.")]
    try:
        return rest, ScoringConfig.model_validate(apply_overrides({}, mine))
    except ValidationError as exc:
        problems = [f"  scoring.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                    + (f" (got {e['input']!r})" if e["type"] != "missing" else "") for e in exc.errors()]
        raise ConfigError("invalid scoring options:\n" + "\n".join(problems)) from None


# -- reading ----------------------------------------------------------------------------

Parser = Callable[[Any, str, int], list[tuple[str, dict[str, Any]]]]


def shard_item(name: str, files: list[Shard]) -> dict[str, Any]:
    """One unit of work: a shard name and the files (read in order) that make it up."""
    return {"shard": name, "files": json.dumps([[f.uri, f.format] for f in files])}


class ReadRows:
    """flat_map callable: a shard item -> one row per parsed record. `parse(raw, shard,
    line_no)` returns [(custom_id, payload)] or raises `RowError`; a bad line becomes one
    error row, an unreadable file one error row: never a failed job."""

    def __init__(self, fs_spec: FsSpec, parse: Parser):
        self.fs_spec = fs_spec
        self.parse = parse

    def __call__(self, item: dict[str, Any]) -> list[dict[str, Any]]:
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
        for row in rows:
            row["shard_rows"] = len(rows)
        return rows


def error_json(reason: str, message: str) -> str:
    return json.dumps({"reason": reason, "message": message})


def load_json_line(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RowError("bad_json", f"{exc.msg} at column {exc.colno}: {raw[:80]!r}") from None


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


def columns(rows: list[dict[str, Any]], extra: tuple[str, ...] = ("result",)) -> dict[str, list]:
    return {k: [r.get(k) for r in rows] for k in (*ROW_COLUMNS, *extra)}


# -- committing -------------------------------------------------------------------------


class ScoreCommitter(ShardCollector):
    """Driver-side sink: when the last row of a shard arrives, write its result lines
    (`render(custom_id, result)`), its error lines, then its marker, whose counters are
    the sums of `tally(result)` over the shard's results."""

    key_column = "row_no"  # one input line may give several rows

    def __init__(self, store: OutputStore, seen_ids: set[str],
                 render: Callable[[str, dict], dict], tally: Callable[[dict], dict[str, float]]):
        super().__init__(seen_ids)
        self.store, self.render, self.tally = store, render, tally

    def _commit(self, shard: str) -> None:
        results, errors, sums = [], [], {}
        for _, row in sorted(self.pending.pop(shard).items()):
            cid, error = row["custom_id"], self.duplicate_error(row)
            if error is not None:
                err = json.loads(error)
                errors.append(error_line(cid, err["reason"], err["message"], row["line_no"]))
            else:
                result = json.loads(row["result"])
                results.append(self.render(cid, result))
                for key, value in self.tally(result).items():
                    sums[key] = sums.get(key, 0) + value
        marker = {"shard": shard, "rows": len(results) + len(errors), "ok": len(results), "errors": len(errors),
                  **sums, "committed_at": time.time()}
        self.store.commit_shard(shard, results, errors, marker)
        self.markers[shard] = marker
        log.info("committed shard %s: %d ok, %d errors", shard, len(results), len(errors))


def drain(ds: "ray.data.Dataset", committer: ScoreCommitter, todo: list[str]) -> None:
    """Stream the dataset into the committer; every shard in `todo` ends committed."""
    started = last = time.monotonic()
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        for row in batch.to_pylist():
            committer.add(row)
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info("rows %d | shards committed %d | %.0fs", committer.num_rows_seen,
                     len(committer.markers), last - started)
    for name in todo:
        if name not in committer.markers and name not in committer.pending:
            committer.commit_empty(name)  # a shard with no rows at all
    if committer.incomplete:
        raise RuntimeError(f"shards ended incomplete (seen, expected): {committer.incomplete}")


def totals(markers: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: sum(m.get(k, 0) for m in markers.values()) for k in keys}
