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

import asyncio
import json
import math
import os
import time
from typing import TYPE_CHECKING, Any

from pipelines.rows import RowError
from pipelines.scoring import READ_CPUS, ReadRows, columns, error_json, load_json_line, plain_rows

if TYPE_CHECKING:
    import ray.data

    from configs.schema import AppConfig
    from pipelines.scoring import LogprobScoringConfig
    from pipelines.storage import FsSpec

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


class LogprobStage:
    """map_batches callable class (actor pool): rows -> rows + `result` JSON."""

    def __init__(self, cfg: dict[str, Any], scoring: dict[str, Any]):
        from actors.engine import Engine
        from configs.schema import AppConfig
        from pipelines.scoring import LogprobScoringConfig

        app = AppConfig.model_validate(cfg)
        self.scoring = LogprobScoringConfig.model_validate(scoring)
        self.engine = Engine(app.engine, app.sampling, device=app.pool.device)
        self.engine_key = f"{os.getpid()}-{time.time_ns()}"

    async def _run_row(self, row: dict[str, Any]) -> dict[str, Any]:
        row["result"] = None
        if row["error"] is not None:
            return row
        payload = json.loads(row["payload"])
        out = await self.engine.score(row["custom_id"], payload["prompt"], payload["completion"],
                                      num_top_logprobs=self.scoring.num_top_logprobs)
        if not out["ok"]:
            row["error"] = error_json(out["error"]["reason"], out["error"]["message"])
            return row
        result = {**likelihood(out["token_logprobs"]), "num_prompt_tokens": out["num_prompt_tokens"]}
        if self.scoring.token_logprobs:
            result["token_ids"] = out["token_ids"]
            result["token_logprobs"] = out["token_logprobs"]
        if self.scoring.num_top_logprobs:
            result["top_logprobs"] = out["top_logprobs"]
        row["result"] = json.dumps(result)
        return row

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = await asyncio.gather(*(self._run_row(r) for r in plain_rows(batch)))
        return columns(list(rows))


def build_logprob_dataset(cfg: "AppConfig", items: list[dict], fs_spec: "FsSpec",
                          scoring: "LogprobScoringConfig") -> "ray.data.Dataset":
    import ray.data

    from configs.plan import resource_plan
    from pipelines.codegen import engine_batch_size

    plan = resource_plan(cfg)
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds = ds.flat_map(ReadRows(fs_spec, parse_logprob_row), num_cpus=READ_CPUS)
    remote_args = {"accelerator_type": plan.accelerator_type} if plan.accelerator_type else {}
    return ds.map_batches(
        LogprobStage,
        fn_constructor_kwargs={"cfg": cfg.model_dump(mode="json"), "scoring": scoring.model_dump()},
        compute=ray.data.ActorPoolStrategy(min_size=plan.min_actors, max_size=plan.max_actors),
        batch_size=engine_batch_size(cfg),
        batch_format="numpy",
        num_cpus=plan.cpus_per_actor,
        num_gpus=plan.gpus_per_actor,
        **remote_args,
    )


def render_score(custom_id: str, result: dict) -> dict:
    return {"custom_id": custom_id, "score": result}


def tally_score(result: dict) -> dict[str, float]:
    return {"num_tokens": result["num_tokens"], "total_logprob": result["total_logprob"]}
