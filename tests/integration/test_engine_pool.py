"""The engine pool on the real vLLM engine (CPU, tiny model, float32)."""

import random

import pytest
import ray

from actors.pool import EnginePool, run_requests
from configs import load_config
from jobs.humaneval_pool import humaneval_requests

pytestmark = pytest.mark.integration

SPEC_OFF = "engine.spec={method: none}"
EAGLE3 = ["engine.spec.method=eagle3", "engine.spec.head=artifacts/tiny/eagle3-head"]


@pytest.fixture(scope="module")
def peagle_pool(tiny_models, ray_local):
    pool = EnginePool(load_config("tiny", ["sampling.max_tokens=16"]))
    yield pool
    pool.shutdown()


def test_pool_answers_all_164_humaneval_prompts_matched_by_id(peagle_pool, tiny_models):
    from transformers import AutoTokenizer

    requests = humaneval_requests()
    assert len(requests) == 164
    shuffled = random.Random(0).sample(requests, len(requests))
    order = [r["id"] for r in peagle_pool.generate(shuffled)]
    results = {}
    for r in peagle_pool.generate(requests):
        results[r["id"]] = r
    assert set(results) == {r["id"] for r in requests}
    assert all(r["ok"] and r["num_output_tokens"] > 0 for r in results.values())
    # Each result belongs to its own prompt: the prompt length the engine saw for an id
    # is that id's prompt, tokenized.
    tok = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    for req in requests:
        assert results[req["id"]]["num_prompt_tokens"] == len(tok.encode(req["prompt"])), req["id"]
    assert sorted(order) == sorted(results)  # the shuffled run returned every id once too


def test_spec_stats_equal_vllm_counters(peagle_pool):
    run_requests(peagle_pool, humaneval_requests(limit=8))
    actor = peagle_pool.actors[0]
    ours = ray.get(actor.stats.remote())
    theirs = ray.get(actor.vllm_spec_counters.remote())
    assert ours["num_drafts"] > 0
    assert ours["num_drafts"] == theirs["vllm:spec_decode_num_drafts"]
    assert ours["num_draft_tokens"] == theirs["vllm:spec_decode_num_draft_tokens"]
    assert ours["num_accepted_tokens"] == theirs["vllm:spec_decode_num_accepted_tokens"]
    assert ours["num_accepted_tokens_per_pos"] == theirs["vllm:spec_decode_num_accepted_tokens_per_pos"]
    expected_length = 1 + ours["num_accepted_tokens"] / ours["num_drafts"]
    assert ours["mean_acceptance_length"] == pytest.approx(expected_length)
    assert ours["output_tokens_per_s"] > 0


def test_bad_requests_come_back_as_row_errors_naming_the_value(peagle_pool):
    results = {r["id"]: r for r in peagle_pool.generate([
        {"id": "neg", "prompt": "def f():", "max_tokens": -4},
        {"id": "hot", "prompt": "def f():", "temperature": 9.0},
        {"id": "long", "prompt": "x = 1\n" * 3000},
        {"id": "fine", "prompt": "def f():", "max_tokens": 4},
    ])}
    assert results["neg"]["error"]["reason"] == "invalid_request" and "-4" in results["neg"]["error"]["message"]
    assert "9.0" in results["hot"]["error"]["message"]
    assert results["long"]["error"]["reason"] == "prompt_too_long"
    assert results["fine"]["ok"] and results["fine"]["num_output_tokens"] == 4


def _greedy_token_ids(overrides):
    cfg = load_config("tiny", ["sampling.max_tokens=48", "sampling.temperature=0", *overrides])
    pool = EnginePool(cfg)
    try:
        results = run_requests(pool, humaneval_requests(limit=24))
        stats = pool.stats()
    finally:
        pool.shutdown()
    return {i: r["token_ids"] for i, r in results.items()}, stats


def test_peagle_and_eagle3_are_lossless_against_no_speculation_float32(tiny_models, ray_local):
    baseline, _ = _greedy_token_ids([SPEC_OFF])
    peagle, peagle_stats = _greedy_token_ids([])
    eagle3, eagle3_stats = _greedy_token_ids(EAGLE3)
    assert peagle_stats.num_drafts > 0 and eagle3_stats.num_drafts > 0
    mismatched = [i for i in baseline if peagle[i] != baseline[i] or eagle3[i] != baseline[i]]
    assert not mismatched, f"greedy outputs differ from no-speculation for {mismatched}"
