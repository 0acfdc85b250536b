"""A shard job of one's own is one spec: the README's example, run as written, on the real
engine and a real S3 server on loopback."""

import json
import re
from pathlib import Path

import pytest

from configs import load_config

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_spec() -> dict:
    """The README's example block, executed: what a reader would paste into a file."""
    block = re.search(r"<!-- spec-example -->\n```python\n(.*?)```\n<!-- /spec-example -->", README.read_text(), re.S)
    assert block, "README lost its shard-job example"
    namespace = {"__name__": "readme_spec_example"}  # not importable: Ray ships its code by value
    exec(compile(block.group(1), str(README), "exec"), namespace)
    return namespace


def test_readme_classification_spec_labels_rows_and_sends_bad_records_to_errors(s3, ray_local, tiny_models):
    s3.create_bucket("spec-tests")
    rows = [{"id": "add", "text": "def add(a, b):\n    return", "labels": [" a + b", " zebra zebra zebra"]},
            {"id": "sub", "text": "def sub(a, b):\n    return", "labels": [" a - b", " ("]},
            {"id": "nolabels", "text": "x = 1"}]
    s3.filesystem().pipe_file("spec-tests/in/a.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = _readme_spec()
    cfg = load_config("tiny", ["input=s3://spec-tests/in", "output=s3://spec-tests/out",
                               f"s3_endpoint_url={s3.endpoint_url}"])
    run = spec["run_shard_job"](cfg, spec["CLASSIFY"])
    fs = s3.filesystem()
    results = {r["custom_id"]: r for r in map(json.loads, fs.cat_file("spec-tests/out/results/a.jsonl").decode().splitlines())}
    errors = [json.loads(line) for line in fs.cat_file("spec-tests/out/errors/a.jsonl").decode().splitlines()]
    assert set(results) == {"add", "sub"}
    for row in rows[:2]:
        got = results[row["id"]]
        assert set(got["logprobs"]) == set(row["labels"]) and all(lp < 0 for lp in got["logprobs"].values())
        assert got["label"] == max(got["logprobs"], key=got["logprobs"].get)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(None, "invalid_request")]
    assert "labels" in errors[0]["error"]["message"] and errors[0]["error"]["line"] == 3
    marker = run.committer.markers["a"]
    assert (marker["rows"], marker["ok"], marker["errors"]) == (3, 2, 1)
    assert run.engines.engine_events()["num_engines"] == 1  # the engine reported through the side channel


def test_a_job_reads_at_most_read_tasks_shards_at_once(ray_local, tmp_path):
    """Every read task runs in a worker process of its own: a job must not start a dozen at
    once on a node it shares with engines and online requests. Each task holds its shard
    (bounded) until all shards are in, so without the cap the others start meanwhile."""
    import time

    import ray
    import ray.data

    from pipelines.shardjob import read_stage, shard_item
    from pipelines.storage import FsSpec, Shard

    @ray.remote(num_cpus=0)
    class Gauge:
        def __init__(self):
            self.now, self.most, self.entered = 0, 0, 0

        def enter(self):
            self.now, self.entered = self.now + 1, self.entered + 1
            self.most = max(self.most, self.now)

        def leave(self):
            self.now -= 1

        def state(self):
            return self.most, self.entered

    gauge, num_shards = Gauge.remote(), 6

    def parse(raw, shard, line_no):
        ray.get(gauge.enter.remote())
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and ray.get(gauge.state.remote())[1] < num_shards:
            time.sleep(0.05)
        ray.get(gauge.leave.remote())
        return [(f"{shard}-{line_no}", json.loads(raw))]

    items = []
    for i in range(num_shards):
        path = tmp_path / f"s{i}.jsonl"
        path.write_text('{"x": 1}\n')
        items.append(shard_item(f"s{i}", [Shard(f"s{i}", str(path), "jsonl")]))
    ds = read_stage(ray.data.from_items(items, override_num_blocks=num_shards), FsSpec(), parse, max_tasks=2)
    rows = ds.take_all()
    assert sorted(r["custom_id"] for r in rows) == [f"s{i}-1" for i in range(num_shards)]
    assert all(r["error"] is None for r in rows)
    most, entered = ray.get(gauge.state.remote())
    assert entered == num_shards and most <= 2, f"{most} read tasks ran at once (cap 2)"
