"""Input row formats -> engine requests, and engine results -> OpenAI Batch output lines.

Accepted input rows (one JSON object per JSONL line or Parquet row):
  * OpenAI Batch API: {"custom_id", "method", "url", "body": {"messages" | "prompt",
    "max_tokens" | "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n",
    "model"}}
  * plain: {"id", "prompt", optional sampling keys and "n"}
  * HumanEval: {"task_id", "prompt", ...}; the other HumanEval fields are carried along
    untouched but not used.
`n` (samples of one prompt) is validated here and left in the request for the job to
expand (`sample_requests`): sample i is its own request and output line, id `ID#i`.
Every failure becomes a `RowError` with a reason code, never an exception that would
stop the job. Pure functions over dicts and strings: no Ray, no vLLM, no I/O.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from actors.requests import RequestError, parse_request

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "stop", "seed")
HUMANEVAL_EXTRA_KEYS = {"canonical_solution", "test", "entry_point"}
# OpenAI body keys accepted and ignored: routing/format choices that a batch run fixes.
IGNORED_BODY_KEYS = {"model", "user", "stream"}
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
SAMPLE_SEP = "#"  # sample i of row ID is `ID#i`
MAX_SAMPLES_PER_ROW = 128


@dataclass(frozen=True)
class RowError(Exception):
    reason: str  # bad_json | missing_field | invalid_request | duplicate_custom_id | ...
    message: str
    custom_id: str | None = None


def parse_row(obj: Any) -> tuple[str, dict[str, Any], str]:
    """A decoded row -> (custom_id, validated request dict, kind: chat|completion)."""
    if not isinstance(obj, dict):
        raise RowError("invalid_request", f"row must be a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj or "body" in obj:
        return _parse_openai_batch(obj)
    if "task_id" in obj:
        custom_id = _require_str(obj, "task_id")
        extra = set(obj) - {"task_id", "prompt"} - HUMANEVAL_EXTRA_KEYS
        return custom_id, _validated(custom_id, obj, extra, prompt_key="prompt"), "completion"
    if "id" in obj:
        custom_id = _require_str(obj, "id")
        extra = set(obj) - {"id", "prompt", "messages", "n", *SAMPLING_KEYS}
        kind = "chat" if "messages" in obj else "completion"
        return custom_id, _validated(custom_id, obj, extra), kind
    raise RowError(
        "missing_field",
        f"row has none of custom_id/task_id/id; keys: {sorted(obj)!r}",
    )


def parse_line(line: str) -> tuple[str, dict[str, Any], str]:
    """One JSONL line -> `parse_row`, with bad JSON reported as such."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RowError("bad_json", f"{exc.msg} at column {exc.colno}: {line[:80]!r}") from None
    return parse_row(obj)


def _require_str(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "":
        raise RowError("missing_field", f"{key} must be a non-empty string, got {value!r}")
    return str(value)


def _parse_openai_batch(obj: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    custom_id = _require_str(obj, "custom_id")
    url = obj.get("url", "/v1/chat/completions")
    if url not in ENDPOINTS:
        raise RowError("invalid_request", f"url must be one of {sorted(ENDPOINTS)}, got {url!r}", custom_id)
    method = obj.get("method", "POST")
    if method != "POST":
        raise RowError("invalid_request", f"method must be 'POST', got {method!r}", custom_id)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RowError("missing_field", f"body must be an object, got {body!r}", custom_id)
    body = dict(body)
    if "max_completion_tokens" in body and "max_tokens" not in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    if body.get("stream"):
        raise RowError("invalid_request", "body.stream must be false in a batch", custom_id)
    extra = set(body) - {"prompt", "messages", "n", *SAMPLING_KEYS} - IGNORED_BODY_KEYS
    kind = ENDPOINTS[url]
    prompt_key = "messages" if kind == "chat" else "prompt"
    if prompt_key not in body:
        raise RowError("missing_field", f"body.{prompt_key} is required for {url}", custom_id)
    body = {k: v for k, v in body.items() if k not in IGNORED_BODY_KEYS}
    return custom_id, _validated(custom_id, body, extra, prefix="body."), kind


def _validated(
    custom_id: str,
    obj: dict[str, Any],
    extra: set[str],
    prompt_key: str | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    if extra:
        raise RowError(
            "invalid_request", f"unsupported field(s) {sorted(prefix + k for k in extra)!r}", custom_id
        )
    if prompt_key and prompt_key not in obj:
        raise RowError("missing_field", f"{prompt_key} is required", custom_id)
    request = {k: obj[k] for k in ("prompt", "messages", *SAMPLING_KEYS) if k in obj}
    request["id"] = custom_id
    try:
        parse_request(request)
    except RequestError as exc:
        raise RowError("invalid_request", f"{prefix}{exc}", custom_id) from None
    if "n" in obj:
        n = obj["n"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES_PER_ROW:
            raise RowError("invalid_request", f"{prefix}n must be an int in 1..{MAX_SAMPLES_PER_ROW}, got {n!r}",
                           custom_id)
        request["n"] = n
    return request


def sample_requests(custom_id: str, request: dict[str, Any], default_n: int = 1,
                    default_temperature: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
    """A validated request -> one (custom_id, request) per sample: the row's `n`, else
    `default_n`. With n > 1 sample i is `ID#i`, and a row's seed becomes seed + i (each
    sample reproducible and distinct). n > 1 greedy samples would be n copies: refused."""
    request = dict(request)
    n = request.pop("n", default_n)
    if n == 1:
        return [(custom_id, request)]
    if request.get("temperature", default_temperature) <= 0:
        raise RowError("invalid_request", f"n={n} samples need temperature > 0 (greedy gives {n} copies), "
                       f"got temperature {request.get('temperature', default_temperature)!r}", custom_id)
    samples = []
    for i in range(n):
        sample_id = f"{custom_id}{SAMPLE_SEP}{i}"
        sample = {**request, "id": sample_id}
        if "seed" in request:
            sample["seed"] = request["seed"] + i
        samples.append((sample_id, sample))
    return samples


# -- output lines -----------------------------------------------------------------------


def response_line(custom_id: str, kind: str, result: dict[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI Batch output line for a successful request."""
    usage = {
        "prompt_tokens": result["num_prompt_tokens"],
        "completion_tokens": result["num_output_tokens"],
        "total_tokens": result["num_prompt_tokens"] + result["num_output_tokens"],
    }
    choice: dict[str, Any] = {"index": 0, "finish_reason": result["finish_reason"]}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": result["text"]}
        obj = "chat.completion"
    else:
        choice["text"] = result["text"]
        obj = "text_completion"
    request_id = f"req-{custom_id}"
    return {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": request_id,
            "body": {
                "id": request_id,
                "object": obj,
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage,
            },
        },
        "error": None,
    }


def error_line(custom_id: str | None, reason: str, message: str, line_no: int) -> dict[str, Any]:
    """An OpenAI Batch error line; `line` points at the input line (1-based) it came from."""
    return {
        "id": f"batch_req_{custom_id}" if custom_id else None,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": reason, "message": message, "line": line_no},
    }
