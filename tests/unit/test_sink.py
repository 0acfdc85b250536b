import json

import pytest

from pipelines.codegen import render, tally
from actors.batch_host import EngineReports
from pipelines.sink import ShardCommitter
from pipelines.storage import FsSpec, OutputStore

pytestmark = pytest.mark.unit


def _row(shard, line_no, total, cid, ok=True):
    result = {"text": f"out-{cid}", "finish_reason": "stop", "num_prompt_tokens": 2, "num_output_tokens": 3,
              "kind": "completion"}
    return {
        "shard": shard, "row_no": line_no - 1, "line_no": line_no, "shard_rows": total, "custom_id": cid,
        "payload": "{}", "error": None if ok else json.dumps({"reason": "bad_json", "message": "x"}),
        "result": json.dumps(result) if ok else None,
    }


def _codegen_committer(store, seen_ids):
    return ShardCommitter(store, seen_ids, render("tiny"), tally)


def test_shard_commits_once_all_rows_arrive_out_of_order(tmp_path):
    store = OutputStore(FsSpec(), str(tmp_path))
    sink = _codegen_committer(store, seen_ids=set())
    assert sink.add(_row("s1", 3, 3, "c")) is None
    assert sink.add(_row("s1", 1, 3, "a")) is None
    assert sink.add(_row("s1", 3, 3, "c")) is None  # a retried task's duplicate
    assert sink.add(_row("s1", 2, 3, "b", ok=False)) == "s1"
    results = [json.loads(l) for l in (tmp_path / "results" / "s1.jsonl").read_text().splitlines()]
    errors = [json.loads(l) for l in (tmp_path / "errors" / "s1.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "c"]
    assert results[0]["response"]["body"]["choices"][0]["text"] == "out-a"
    assert [e["custom_id"] for e in errors] == ["b"] and errors[0]["error"]["line"] == 2
    marker = store.committed()["s1"]
    assert marker["rows"] == 3 and marker["output_tokens"] == 6 and marker["error_reasons"] == {"bad_json": 1}


def test_engine_counters_total_over_engines_as_last_reported():
    stats = {"num_drafts": 4, "num_accepted_tokens": 6, "num_accepted_tokens_per_pos": [3, 2, 1]}
    reports = EngineReports({"e1": {**stats, "node_id": "n1"}, "e2": {**stats, "num_restarts": 1, "node_id": "n1"},
                             "e3": {**stats, "num_engine_deaths": 2, "num_requests_failed_alone": 1}})
    assert reports.spec_stats().mean_acceptance_length == pytest.approx(2.5)
    assert reports.spec_stats().num_drafts == 12
    assert reports.engine_events() == {"num_engines": 3, "engines_by_node": {"n1": 2, "unknown": 1},
                                       "num_engine_deaths": 2, "num_restarts": 1, "num_requests_failed_alone": 1}


def test_custom_id_committed_earlier_becomes_duplicate_error(tmp_path):
    store = OutputStore(FsSpec(), str(tmp_path))
    sink = _codegen_committer(store, seen_ids={"a"})
    sink.add(_row("s2", 1, 2, "a"))
    sink.add(_row("s2", 2, 2, "z"))
    marker = store.committed()["s2"]
    assert (marker["ok"], marker["errors"]) == (1, 1)
    err = json.loads((tmp_path / "errors" / "s2.jsonl").read_text())
    assert err["error"]["code"] == "duplicate_custom_id" and "'a'" in err["error"]["message"]
    assert store.committed_ids(["s2"]) == {"a", "z"}
