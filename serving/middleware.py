"""HTTP guards vLLM's OpenAI app lacks in the shape we need, in front of it:

- an API key check whose 401 has an OpenAI error body (vLLM's answers `{"error": "Unauthorized"}`);
- a request-size limit (413), enforced while the body streams in, so a chunked upload
  without Content-Length is refused the same way and never more than the limit is held;
- a cap on what one request multiplies the engine's work by: choices per request
  (`n`, or `best_of` when larger, times the prompts of a completions request) at most
  `max_choices` (400 naming the value; vLLM has no such cap);
- a body that is not JSON (truncated, invalid UTF-8, nested past the parser's depth) gets
  a 400 here instead of whatever the framework makes of it;
- every 4xx/5xx from /v1 carries OpenAI's error shape `{"error": {"message", "type",
  "param", "code"}}`: FastAPI's own answers (`{"detail": ...}`) are rewritten;
- a response header naming the replica that served the request.

Also the admission gate for online requests: `admit` (the engine's `admitted`, an async
context manager) wraps every /v1 request, so a request waits while its engine restarts
(with or without speculation) and a restart waits for the requests inside to finish.
`on_generation` (a context manager) wraps every admitted generation request from its
arrival to its last byte: the replica's batch rows yield while any is in flight.
`across_deaths` runs each generation request so that it outlives an engine-core death
(`serving.engine_retry`).

Plain ASGI middleware; knows nothing about engines or Serve.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
from typing import Any

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def openai_error(status: int, message: str, err_type: str, code: str | int | None = None,
                 param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code or status}}
    ).encode()


async def send_json(send, status: int, body: bytes, extra_headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(extra_headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    pass


async def read_body(receive, limit: int) -> tuple[bytes, list[dict]]:
    """The whole request body, at most `limit` bytes (BodyTooLarge past it, without
    reading on), plus any non-body messages seen (a disconnect) to replay."""
    chunks, size, other = [], 0, []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            other.append(message)
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks), other


def choices_requested(path: str, body: Any) -> tuple[int, str] | None:
    """(completions the request asks the engine for, the parameter that drives it), or
    None when the body is not a generation request we can read."""
    if not isinstance(body, dict):
        return None
    n, best_of = body.get("n", 1), body.get("best_of")
    if not isinstance(n, int) or isinstance(n, bool):
        return None  # the OpenAI layer names a wrongly typed n itself
    per_prompt, param = n, "n"
    if isinstance(best_of, int) and not isinstance(best_of, bool) and best_of > n:
        per_prompt, param = best_of, "best_of"
    prompts = 1
    prompt = body.get("prompt") if path.endswith("/v1/completions") else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = len(prompt)  # a list of prompts (text or token ids); a flat int list is one prompt
        if per_prompt == 1:
            param = "prompt"
    return per_prompt * prompts, param


def as_openai_error(status: int, body: bytes) -> bytes | None:
    """An OpenAI error body for a framework error body (`{"detail": ...}`, or anything
    without an "error" object); None when it already has OpenAI's shape."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {"detail": body.decode("utf-8", "replace")[:500]}
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return None
    detail = data.get("detail", data) if isinstance(data, dict) else data
    if isinstance(detail, list):  # FastAPI validation errors: [{"loc": [...], "msg": ...}, ...]
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}"
                           if isinstance(d, dict) else str(d) for d in detail)
    err_type = "invalid_request_error" if status < 500 else "internal_server_error"
    return openai_error(status, str(detail) or f"HTTP {status}", err_type)


class Guards:
    """API key and limits on /v1 routes, OpenAI error bodies, replica header."""

    def __init__(self, app, max_request_bytes: int, api_key: str | None, admit=None, max_choices: int = 128,
                 on_generation=None, across_deaths=None):
        self.app = app
        self.admit = admit
        self.on_generation = on_generation
        # (run, scope, body, after, receive, send): a generation request's run that outlives
        # an engine-core death (serving.engine_retry); None = run it once.
        self.across_deaths = across_deaths
        self.max_request_bytes = max_request_bytes
        self.max_choices = max_choices
        self.api_key = api_key or None
        self.replica_header = (b"x-peagle-replica-pid", str(os.getpid()).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if not path.startswith("/v1"):
            return await self.app(scope, receive, self._with_header(send))
        refusal, read = self._check_headers(scope), None
        if refusal is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            try:
                read = await read_body(receive, self.max_request_bytes)
            except BodyTooLarge as exc:
                refusal = (413, openai_error(413, f"request body is over {exc.args[0]} bytes (sent without "
                                             f"Content-Length); the limit is {self.max_request_bytes}",
                                             "invalid_request_error"))
            else:
                refusal = self._check_body(path, read[0])
        if refusal is not None:
            return await send_json(send, *refusal, extra_headers=[self.replica_header])
        send = _openai_errors(self._with_header(send))
        if not path.endswith(GENERATION_PATHS):
            return await self._admitted(scope, replay_body(*read, receive) if read else receive, send)
        with self.on_generation() if self.on_generation is not None else contextlib.nullcontext():
            if self.across_deaths is not None and read is not None:
                return await self.across_deaths(self._admitted, scope, *read, receive, send)
            return await self._admitted(scope, replay_body(*read, receive) if read else receive, send)

    async def _admitted(self, scope, receive, send):
        if self.admit is not None:
            async with self.admit():
                return await self.app(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check_headers(self, scope) -> tuple[int, bytes] | None:
        headers = dict(scope.get("headers") or [])
        if self.api_key:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}"):
                return 401, openai_error(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                         "invalid_request_error", "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return 413, openai_error(413, f"request body is {int(length)} bytes; the limit is "
                                     f"{self.max_request_bytes}", "invalid_request_error")
        return None

    def _check_body(self, path: str, raw: bytes) -> tuple[int, bytes] | None:
        if not path.endswith(GENERATION_PATHS):
            return None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            return 400, openai_error(400, f"request body is not valid JSON: {reason}", "invalid_request_error")
        asked = choices_requested(path, body)
        if asked is not None and asked[0] > self.max_choices:
            count, param = asked
            value = body.get(param) if param != "prompt" else f"a list of {len(body['prompt'])} prompts"
            return 400, openai_error(
                400, f"{param}={value!r} asks for {count} completions in one request; this server allows at most "
                f"{self.max_choices} (serve.max_n: n, or best_of when larger, times the number of prompts)",
                "invalid_request_error", param=param)
        return None

    def _with_header(self, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.replica_header]}
            await send(message)
        return send_with_header


def replay_body(body: bytes, after: list[dict], receive):
    """A receive() that gives the app the body already read, then what came after."""
    pending = [{"type": "http.request", "body": body, "more_body": False}, *after]

    async def replay():
        return pending.pop(0) if pending else await receive()
    return replay


def _openai_errors(send):
    """Rewrites error responses that lack OpenAI's shape; everything else passes as sent."""
    held: dict[str, Any] = {}

    async def rewrite(message):
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held["start"], held["body"] = message, b""
            return
        if "start" not in held or message["type"] != "http.response.body":
            return await send(message)
        held["body"] += message.get("body", b"")
        if message.get("more_body", False):
            return
        start, body = held.pop("start"), held.pop("body")
        new = as_openai_error(start["status"], body)
        if new is not None:
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
            start = {**start, "headers": [*headers, (b"content-type", b"application/json"),
                                          (b"content-length", str(len(new)).encode())]}
            body = new
        await send(start)
        await send({"type": "http.response.body", "body": body})
    return rewrite
