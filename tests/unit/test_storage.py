import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import cli
from pipelines.codegen import ParseRequests
from pipelines.runner import input_files
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


def test_the_command_line_lists_the_input_once_and_the_job_reads_that_listing(tmp_path, monkeypatch, capsys):
    (tmp_path / "in").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "in" / name).write_text('{"prompt": "x"}\n')
    listings, runs = [], []

    def inputs(fs_spec, uri):
        listings.append(uri)
        return input_files(fs_spec, uri)

    def run(cfg, shards):
        runs.append(shards)
        return {"reconciled": True}

    monkeypatch.setattr(cli, "start_runtime", lambda: None)  # no Ray: the run above is a stand-in
    argv = [f"input={tmp_path / 'in'}", f"output={tmp_path / 'out'}"]
    assert cli.job_main(argv, "a job", run, "{out}", inputs=inputs) == 0
    assert listings == [str(tmp_path / "in")]
    assert [[name for name, _ in shards] for shards in runs] == [["a", "b"]]
    assert runs[0][0][1][0].size == len('{"prompt": "x"}\n')  # sizes come with the listing


def test_scoring_a_job_output_with_nothing_committed_stops_before_ray_naming_it(tmp_path):
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "_config.yaml").write_text("input: somewhere\n")  # a codegen output, no commits yet
    proc = subprocess.run([sys.executable, "-m", "jobs.score_code", f"input={tmp_path / 'gen'}",
                           f"output={tmp_path / 'scored'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no committed shard yet" in proc.stderr and str(tmp_path / "gen") in proc.stderr
    assert "ray" not in proc.stderr.lower()  # refused before any runtime started
