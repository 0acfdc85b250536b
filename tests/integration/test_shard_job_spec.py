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
