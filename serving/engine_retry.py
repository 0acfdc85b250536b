"""Online requests across an engine-core death: run again on the rebuilt engine, or
answered in OpenAI's error shape with what the client should do; never vLLM's internal
message.

When a replica's engine core dies, vLLM's OpenAI layer answers the requests inside with
HTTP 500 "EngineCore encountered an issue. See stack trace (above) for the root cause."
(a streamed request: an error event). The replica rebuilds its engine in place
(`actors.engine_lifecycle`); this wrapper makes that invisible to the client where it
can be:

- the response of a request whose engine died under it is held back while it is an
  error and nothing of it has reached the client (a 5xx, or a stream whose first event
  is an error); the request then waits for the rebuilt engine and runs again on it,
  alone among the requests that were in flight at that death (`quarantined()`), so its
  client sees one ordinary answer;
- if the engine dies under it again, it is the one to blame: it is failed alone with a
  500 whose message carries an error id, logged with the request's path;
- if the rebuild does not finish within `serve.engine_recovery_wait_s`, or fails, the
  answer is 503 with `Retry-After` (Serve replaces a replica whose rebuild failed);
- a stream whose tokens had already been sent when the engine died cannot be taken
  back: its error event is rewritten to say what happened, with an error id;
- a stream refused before its first token (vLLM checks a streamed request's values only
  once the stream has begun, so the refusal came as an error event inside a 200) is
  answered with that 4xx and its OpenAI error body, as without `stream`.

vLLM's OpenAI layer has no hook for this, and `ray.serve.llm` restarts the whole
replica instead of the engine inside it, losing every request in flight; hence ours.
Plain ASGI around the app; the engine is seen only through `EngineDeaths`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any, Awaitable, Callable, Protocol

from serving.middleware import openai_error, replay_body, send_json

log = logging.getLogger(__name__)

RETRY_AFTER_S = 10
ERROR_EVENT_PREFIX = b'data: {"error"'


class EngineDeaths(Protocol):
    """What this wrapper needs of the engine (`actors.engine_lifecycle.EngineLifecycle`)."""

    engine_generation: int

    def died_since(self, generation: int) -> bool: ...

    async def recover(self, generation: int) -> bool: ...

    async def wait_until_serving(self) -> bool: ...

    def quarantined(self) -> contextlib.AbstractAsyncContextManager: ...


class HeldResponse:
    """An ASGI `send` that holds a response back while it is an error nobody has seen
    (status >= 500, or a stream whose first event is an error), and passes everything
    else through from its first body chunk on."""

    def __init__(self, send):
        self._send = send
        self._held: list[dict[str, Any]] = []
        self.status = 0
        self.passing = False  # something of this response reached the client
        self.streaming = False
        self.error_first = False
        self.rewrite_error: Callable[[bytes], bytes | None] | None = None

    @property
    def failed(self) -> bool:
        return not self.passing and bool(self._held)

    async def send(self, message: dict[str, Any]) -> None:
        if self.passing:
            if self.streaming and self.rewrite_error is not None and message["type"] == "http.response.body":
                rewritten = self.rewrite_error(message.get("body", b""))
                if rewritten is not None:
                    message = {**message, "body": rewritten}
            return await self._send(message)
        self._held.append(message)
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = dict(message.get("headers") or [])
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            return
        if message["type"] != "http.response.body" or self.status >= 500 or self.error_first:
            return
        if self.streaming and message.get("body", b"").startswith(ERROR_EVENT_PREFIX):
            self.error_first = True  # a stream that starts with an error: held like a 5xx
            return
        await self.flush()

    async def flush(self) -> None:
        self.passing = True
        held, self._held = self._held, []
        for message in held:
            await self._send(message)

    async def finish(self) -> None:
        """Send what was held. A stream refused before its first token (its first event an
        error with a 4xx code) goes out as that 4xx with the error body, as the same request
        without `stream` does: vLLM checks a streamed request's values only once its stream
        has begun, after the 200 is on its way."""
        refusal = self._refusal() if self.error_first else None
        if refusal is None:
            return await self.flush()
        self.passing, self._held = True, []
        await send_json(self._send, *refusal)

    def _refusal(self) -> tuple[int, bytes] | None:
        first = next((m.get("body", b"") for m in self._held if m["type"] == "http.response.body"), b"")
        try:
            error = json.loads(first[len(b"data: "):].split(b"\n\n", 1)[0])["error"]
        except (ValueError, KeyError, TypeError):
            return None
        code = error.get("code") if isinstance(error, dict) else None
        if not isinstance(code, int) or not 400 <= code < 500:
            return None
        return code, json.dumps({"error": error}).encode()


async def serve_across_deaths(run: Callable[..., Awaitable[None]], scope, body: bytes, after: list[dict], receive,
                              send, *, engine: EngineDeaths, wait_s: float, retries: int) -> None:
    """Run the ASGI call `run(scope, receive, send)` for one generation request whose
    body was read already; when the engine dies under it before the client saw anything,
    run it again on the rebuilt engine, at most `retries` more times (see the module
    docstring for what the client gets otherwise)."""
    path = scope.get("path", "")
    for tries in range(1, retries + 2):
        async with engine.quarantined() if tries > 1 else contextlib.nullcontext():
            if not await _within(engine.wait_until_serving(), wait_s):
                return await _unavailable(send)
            generation = engine.engine_generation
            held = HeldResponse(send)
            held.rewrite_error = lambda chunk, g=generation: _stream_error(chunk, engine, g, path)
            await run(scope, replay_body(body, after, receive), held.send)
            if not (held.failed and engine.died_since(generation)):
                return await held.finish()
        log.warning("online request %s: the engine core died under it before it answered (try %d of %d)",
                    path, tries, retries + 1)
        if not await _within(engine.recover(generation), wait_s):
            return await _unavailable(send)
    error_id = uuid.uuid4().hex[:12]
    log.error("online request %s (error id %s) was in flight at %d engine-core deaths in a row (the last with no "
              "other suspect beside it); failed alone, not retried again", path, error_id, retries + 1)
    await send_json(send, 500, openai_error(
        500, f"the engine failed {retries + 1} times in a row while running this request (it was rebuilt each "
        f"time, and the last time this request ran alone); it is not retried again. Error id {error_id}.",
        "internal_server_error", code="engine_died"))


async def _within(awaitable: Awaitable[bool], wait_s: float) -> bool:
    try:
        return await asyncio.wait_for(awaitable, wait_s)
    except asyncio.TimeoutError:
        return False


async def _unavailable(send) -> None:
    await send_json(send, 503, openai_error(
        503, f"this replica's engine is being rebuilt after a failure and is not serving yet; retry in "
        f"{RETRY_AFTER_S} s", "service_unavailable", code="engine_recovering"),
        extra_headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])


def _stream_error(chunk: bytes, engine: EngineDeaths, generation: int, path: str) -> bytes | None:
    """An error event of a stream that had sent tokens when its engine died, in our words."""
    if not chunk.startswith(ERROR_EVENT_PREFIX) or not engine.died_since(generation):
        return None
    error_id = uuid.uuid4().hex[:12]
    log.error("online request %s (error id %s): the engine core died while it was streaming; the tokens sent "
              "cannot be taken back, so it was not retried", path, error_id)
    message = (f"the engine failed while streaming this response; the part already sent cannot be taken back, "
               f"so the request was not retried. Error id {error_id}.")
    event = {"error": {"message": message, "type": "internal_server_error", "param": None, "code": "engine_died"}}
    return b"data: " + json.dumps(event).encode() + b"\n\n"
