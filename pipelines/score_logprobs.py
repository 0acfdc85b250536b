"""Likelihood scoring: (prompt, completion) rows -> log p(completion | prompt) per row.

Rows: {"custom_id" or "id", "prompt", "completion"}, both strings, nothing else. The
engine stage runs every row of a batch concurrently on one `actors.engine.Engine`
(`Engine.score`: one prefill with prompt log-probs; see there for how text becomes
tokens), on the same kind of actor pool as codegen (same engine config, so the same
actors could serve both). Per row: total and mean log-probability (natural log) of the
completion's tokens, their number, perplexity = exp(-mean); optionally per-token ids
and log-probs and the top-N alternatives. Knows nothing about S3 or commits.
"""

from __future__ import annotations

import math
from typing import Any

from actors.batch_host import EngineStage
from configs.schema import LogprobScoringConfig
from pipelines.rows import RowError
from pipelines.runner import ShardJobSpec
from pipelines.shardjob import load_json_line

ROW_KEYS = {"custom_id", "id", "prompt", "completion"}


def parse_logprob_row(raw: Any, shard: str, line_no: int) -> list[tuple[str, dict[str, Any]]]:
    obj = load_json_line(raw)
    if not isinstance(obj, dict):
        raise RowError("invalid_request", f"row must be a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id", obj.get("id"))
    if not isinstance(cid, str) or not cid:
        raise RowError("missing_field", f"custom_id (or id) must be a non-empty string, got {cid!r}")
    extra = set(obj) - ROW_KEYS
    if extra:
        raise RowError("invalid_request", f"unsupported field(s) {sorted(extra)!r}", cid)
    for key in ("prompt", "completion"):
        if not isinstance(obj.get(key), str):
            raise RowError("missing_field", f"{key} must be a string, got {obj.get(key)!r}", cid)
    return [(cid, {"prompt": obj["prompt"], "completion": obj["completion"]})]


def likelihood(token_logprobs: list[float]) -> dict[str, Any]:
    """Total and mean log-probability (nats), token count, perplexity = exp(-mean)."""
    total = math.fsum(token_logprobs)
    mean = total / len(token_logprobs)
    return {"total_logprob": total, "mean_logprob": mean, "num_tokens": len(token_logprobs),
            "perplexity": math.exp(-mean) if -mean < 709 else math.inf}


class ScoreStage(EngineStage):
    """The engine stage, scoring: a row -> its completion's log-probabilities."""

    def __init__(self, cfg: dict[str, Any], scoring: dict[str, Any], board=None):
        super().__init__(cfg, board)
        self.scoring = LogprobScoringConfig.model_validate(scoring)

    async def run(self, custom_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        out = await self.engine.score(custom_id, payload["prompt"], payload["completion"],
                                      num_top_logprobs=self.scoring.num_top_logprobs)
        if not out["ok"]:
            return out
        result = {**likelihood(out["token_logprobs"]), "num_prompt_tokens": out["num_prompt_tokens"]}
        if self.scoring.token_logprobs:
            result["token_ids"] = out["token_ids"]
            result["token_logprobs"] = out["token_logprobs"]
        if self.scoring.num_top_logprobs:
            result["top_logprobs"] = out["top_logprobs"]
        return result


def logprob_spec(scoring: "LogprobScoringConfig", stage_cls: type = ScoreStage) -> ShardJobSpec:
    return ShardJobSpec("score_logprobs", parse_logprob_row, render_score, tally_score, stage=stage_cls,
                        stage_kwargs={"scoring": scoring.model_dump()})


def render_score(custom_id: str, result: dict) -> dict:
    return {"custom_id": custom_id, "score": result}


def tally_score(result: dict) -> dict[str, float]:
    return {"num_tokens": result["num_tokens"], "total_logprob": result["total_logprob"]}
