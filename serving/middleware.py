"""HTTP guards vLLM's OpenAI app lacks in the shape we need: an API key check whose 401
has an OpenAI error body (vLLM's answers `{"error": "Unauthorized"}`), a request-size
limit (413), and a response header naming the replica that served the request.

Also the admission gate for online requests: `admit` (the engine's `admitted`, an async
context manager) wraps every /v1 request, so a request waits while its engine restarts
(with or without speculation) and a restart waits for the requests inside to finish.

Plain ASGI middleware; knows nothing about engines or Serve.
"""

from __future__ import annotations

import hmac
import json
import os


def openai_error(status: int, message: str, err_type: str, code: str | int | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": None, "code": code or status}}
    ).encode()


async def _send_json(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Guards:
    """API key on /v1 routes (when a key is configured), body size limit, replica header."""

    def __init__(self, app, max_request_bytes: int, api_key: str | None, admit=None):
        self.app = app
        self.admit = admit
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key or None
        self.replica_header = (b"x-peagle-replica-pid", str(os.getpid()).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}"):
                return await _send_json(send, 401, openai_error(
                    401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    "invalid_request_error", "invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return await _send_json(send, 413, openai_error(
                413, f"request body is {int(length)} bytes; the limit is {self.max_request_bytes}",
                "invalid_request_error"))
        received = 0
        limit = self.max_request_bytes

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # chunked uploads without a Content-Length
                raise ValueError(f"request body exceeds {limit} bytes")
            return message

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.replica_header]}
            await send(message)

        if self.admit is not None and scope["path"].startswith("/v1"):
            async with self.admit():
                return await self.app(scope, limited_receive, send_with_header)
        return await self.app(scope, limited_receive, send_with_header)
