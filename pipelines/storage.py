"""Where shards live: input listing, shard reading, and the output layout.

Paths are `s3://bucket/key` or local; S3 goes through s3fs (fsspec), so a non-AWS
endpoint (a local S3 server on 127.0.0.1) is one setting. Output layout under the job's
`output` prefix, one set of objects per input shard NAME:
    results/NAME.jsonl    OpenAI Batch output lines (custom_id, response)
    errors/NAME.jsonl     OpenAI Batch error lines (custom_id, error with reason)
    _commits/NAME.json    written last: the shard is done; its presence means skip it
    _summary.json, _config.yaml   the job's summary and resolved config
Every object is written whole with one PUT, so a reader never sees half a file.
Knows nothing about engines or row formats.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec

log = logging.getLogger(__name__)

SHARD_SUFFIXES = (".jsonl", ".json", ".parquet")


# Transient S3 failures (503 SlowDown, 500, a reset connection, a read that stalls) are
# normal at scale: botocore's standard retry mode retries them with jittered exponential
# back-off, up to this many attempts per call, and a stalled read times out and is retried.
# Persistent ones (no such bucket, access denied) are not retried and surface at once.
S3_MAX_ATTEMPTS = 10
S3_CONNECT_TIMEOUT_S = 10
S3_READ_TIMEOUT_S = 60

# What planning reads of a JSONL shard to count its rows (`count_rows`).
ROW_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class FsSpec:
    """Picklable recipe for a filesystem, so Ray workers open their own."""

    endpoint_url: str | None = None

    def open_fs(self, uri: str) -> fsspec.AbstractFileSystem:
        if uri.startswith("s3://"):
            import s3fs

            kwargs: dict[str, Any] = {}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            config = {"retries": {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"},
                      "connect_timeout": S3_CONNECT_TIMEOUT_S, "read_timeout": S3_READ_TIMEOUT_S}
            # Fresh instance: s3fs caches listings per instance, and markers change.
            return s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config, **kwargs)
        return fsspec.filesystem("file", auto_mkdir=True)


@dataclass(frozen=True)
class Shard:
    name: str  # unique, flat: used to name this shard's outputs
    uri: str
    format: str  # jsonl | parquet
    size: int | None = None  # bytes, as the listing gave them


class StorageError(OSError):
    """A store that refuses or lacks what the job needs (no such bucket, access denied,
    retries exhausted): persistent, so the job stops with this message naming the path."""


@contextlib.contextmanager
def storage_errors(action: str, uri: str):
    """Re-raise a filesystem error as a StorageError that says what was done where
    (s3fs says "Forbidden" or "The specified bucket does not exist", naming no path)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(f"{action} {uri}: {type(exc).__name__}: {exc}") from exc


def _strip(uri: str) -> str:
    return uri[len("s3://"):] if uri.startswith("s3://") else uri


def _with_scheme(uri_like: str, original: str) -> str:
    return f"s3://{uri_like}" if original.startswith("s3://") else uri_like


def list_shards(fs_spec: FsSpec, input_uri: str) -> list[Shard]:
    """Shards under a prefix/directory, or matching a glob, sorted by path."""
    fs = fs_spec.open_fs(input_uri)
    raw = _strip(input_uri)
    with storage_errors("listing input", input_uri):
        if any(c in raw for c in "*?["):
            found = fs.glob(raw, detail=True)
            base = raw[: min(raw.find(c) for c in "*?[" if c in raw)].rsplit("/", 1)[0]
        elif fs.isfile(raw):
            found, base = {raw: fs.info(raw)}, raw.rsplit("/", 1)[0]
        else:
            base = raw.rstrip("/")
            found = fs.find(base, detail=True)
    shards = []
    for path, info in sorted(found.items()):
        if (info.get("type") == "directory" or not path.endswith(SHARD_SUFFIXES)
                or fnmatch.fnmatch(path.rsplit("/", 1)[-1], "_*")):
            continue
        rel = path[len(base):].lstrip("/") if path.startswith(base) else path.rsplit("/", 1)[-1]
        name = rel.rsplit(".", 1)[0].replace("/", "__")
        fmt = "parquet" if path.endswith(".parquet") else "jsonl"
        shards.append(Shard(name=name, uri=_with_scheme(path, input_uri), format=fmt, size=info.get("size")))
    if not shards:
        raise FileNotFoundError(
            f"no input shards ({', '.join(SHARD_SUFFIXES)}) found at {input_uri!r}"
        )
    return shards


def read_shard(fs_spec: FsSpec, shard: Shard) -> Iterator[str | dict[str, Any]]:
    """JSONL: each non-empty line as a string (parsed later, so a bad line is one error,
    not a failed shard). Parquet: each row as a dict."""
    fs = fs_spec.open_fs(shard.uri)
    with storage_errors("reading shard", shard.uri):
        if shard.format == "parquet":
            import pyarrow.parquet as pq

            with fs.open(_strip(shard.uri), "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                    yield from batch.to_pylist()
            return
        with fs.open(_strip(shard.uri), "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", errors="replace").strip()
                if line:
                    yield line


def count_rows(fs_spec: FsSpec, shard: Shard) -> int:
    """Rows `read_shard` will yield, before the job reads the shard: Parquet exactly, from
    its footer; JSONL from its first `ROW_SAMPLE_BYTES` (one ranged read; lines as
    `read_shard` takes them), exact when that is the whole file and else scaled by the
    file's size, so a large input is not read twice to plan the pool that reads it."""
    fs, path = fs_spec.open_fs(shard.uri), _strip(shard.uri)
    with storage_errors("counting rows of shard", shard.uri):
        if shard.format == "parquet":
            import pyarrow.parquet as pq

            with fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata.num_rows
        size = shard.size if shard.size is not None else fs.size(path)
        head = fs.cat_file(path, start=0, end=min(size, ROW_SAMPLE_BYTES))
    whole = len(head) >= size
    lines = head.split(b"\n") if whole else head.split(b"\n")[:-1]  # the last cut at the sample's edge
    rows = sum(1 for line in lines if line.decode("utf-8", errors="replace").strip())
    return rows if whole else round(rows * size / max(1, sum(len(line) + 1 for line in lines)))


class OutputStore:
    """The job's output prefix: per-shard results/errors/commit markers, summary."""

    def __init__(self, fs_spec: FsSpec, output_uri: str):
        self.uri = output_uri.rstrip("/")
        self.fs = fs_spec.open_fs(output_uri)
        self.root = _strip(self.uri)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def uri_of(self, *parts: str) -> str:
        return _with_scheme(self._path(*parts), self.uri)

    def committed(self) -> dict[str, dict[str, Any]]:
        """Commit markers already present: shard name -> marker."""
        marker_dir = self._path("_commits")
        with storage_errors("reading commit markers under", self.uri_of("_commits")):
            if not self.fs.exists(marker_dir):
                return {}
            out = {}
            for path in self.fs.find(marker_dir):
                if path.endswith(".json"):
                    out[path.rsplit("/", 1)[-1][: -len(".json")]] = json.loads(self.fs.cat_file(path))
            return out

    def committed_ids(self, names: list[str]) -> set[str]:
        """custom_ids in committed shards' outputs (to keep ids unique across resumes)."""
        ids: set[str] = set()
        for name in names:
            for kind in ("results", "errors"):
                path = self._path(kind, f"{name}.jsonl")
                with storage_errors("reading", self.uri_of(kind, f"{name}.jsonl")):
                    lines = self.fs.cat_file(path).splitlines() if self.fs.exists(path) else []
                for line in lines:
                    cid = json.loads(line).get("custom_id")
                    if cid is not None:
                        ids.add(cid)
        return ids

    def commit_shard(self, name: str, results: list[dict], errors: list[dict], marker: dict) -> None:
        """Results and errors first, the marker last: a marker implies complete outputs."""
        for kind, lines in (("results", results), ("errors", errors)):
            body = "".join(json.dumps(line) + "\n" for line in lines)
            self.write_bytes(f"{kind}/{name}.jsonl", body.encode())
        self.write_bytes(f"_commits/{name}.json", json.dumps(marker).encode())

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        with storage_errors("writing", self.uri_of(name)):
            self.fs.pipe_file(self._path(name), data)

    def read_json(self, name: str) -> Any:
        with storage_errors("reading", self.uri_of(name)):
            return json.loads(self.fs.cat_file(self._path(name)))
