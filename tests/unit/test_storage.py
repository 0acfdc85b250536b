import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.codegen import ParseRequests
from pipelines.shardjob import ReadRows, shard_item
from pipelines.storage import FsSpec, list_shards

pytestmark = pytest.mark.unit


def test_parquet_and_jsonl_shards_are_listed_and_read_into_rows(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["p1", "p2"], "prompt": ["def a():", "def b():"]}),
                   tmp_path / "in" / "sub" / "part.parquet")
    (tmp_path / "in" / "lines.jsonl").write_text(
        json.dumps({"task_id": "HumanEval/1", "prompt": "def c():"}) + "\n\n{oops\n")
    (tmp_path / "in" / "_SUCCESS.json").write_text("{}")  # underscore files are not shards
    shards = list_shards(FsSpec(), str(tmp_path / "in"))
    assert [(s.name, s.format) for s in shards] == [("lines", "jsonl"), ("sub__part", "parquet")]
    read = ReadRows(FsSpec(), ParseRequests())
    parquet_rows = read(shard_item(shards[1].name, [shards[1]]))
    assert [r["custom_id"] for r in parquet_rows] == ["p1", "p2"]
    assert all(r["shard_rows"] == 2 and r["error"] is None for r in parquet_rows)
    jsonl_rows = read(shard_item(shards[0].name, [shards[0]]))
    assert [r["custom_id"] for r in jsonl_rows] == ["HumanEval/1", None]  # blank line skipped
    assert json.loads(jsonl_rows[1]["error"])["reason"] == "bad_json"


def test_glob_selects_matching_shards_only(tmp_path):
    for name in ("a.jsonl", "b.jsonl", "c.parquet"):
        (tmp_path / name).write_text("")
    shards = list_shards(FsSpec(), str(tmp_path / "*.jsonl"))
    assert [s.name for s in shards] == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="nothing"):
        list_shards(FsSpec(), str(tmp_path / "nothing*.jsonl"))
