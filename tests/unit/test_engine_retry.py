"""What an online client sees when the engine core dies under its request
(serving.engine_retry behind serving.middleware.Guards): an app that answers the way
vLLM's OpenAI layer does on a dead engine (500, or a stream whose first event is an
error), and a stand-in engine whose deaths and rebuilds the test decides. No vLLM, no
timing: the rebuild that never ends is an event that is never set."""

import asyncio
import contextlib
import functools
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.engine_retry import RETRY_AFTER_S, serve_across_deaths
from serving.middleware import Guards

pytestmark = pytest.mark.unit

VLLM_DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                       "type": "InternalServerError", "param": None, "code": 500}}


class StandInEngine:
    """Deaths on demand: `kill_on[i]` says whether the i-th run dies (its engine with it)."""

    def __init__(self, kill_on: list[bool], rebuild_ok: bool = True, rebuild_ends: bool = True):
        self.kill_on = list(kill_on)
        self.rebuild_ok, self.rebuild_ends = rebuild_ok, rebuild_ends
        self.engine_generation = 0
        self.dead = False
        self.runs: list[int] = []  # generation each run started on
        self.quarantined_runs = 0
        self.in_quarantine = False

    def died_since(self, generation: int) -> bool:
        return self.dead or generation != self.engine_generation

    async def recover(self, generation: int) -> bool:
        if not self.rebuild_ends:
            await asyncio.Event().wait()  # never set: a rebuild that does not finish
        if self.dead and self.rebuild_ok:
            self.dead = False
            self.engine_generation += 1
        return not self.dead

    async def wait_until_serving(self) -> bool:
        return await self.recover(self.engine_generation) if self.dead else True

    @contextlib.asynccontextmanager
    async def quarantined(self):
        self.in_quarantine = True
        try:
            yield
        finally:
            self.in_quarantine = False

    def run_dies(self) -> bool:
        self.runs.append(self.engine_generation)
        self.quarantined_runs += self.in_quarantine
        dies = self.kill_on.pop(0) if self.kill_on else False
        self.dead = self.dead or dies
        return dies


def build(engine: StandInEngine, wait_s: float = 30.0):
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if engine.run_dies():
            if body.get("stream"):
                async def error_stream():
                    yield f"data: {json.dumps(VLLM_DEAD)}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(error_stream(), media_type="text/event-stream")
            return JSONResponse(VLLM_DEAD, status_code=500)
        if body.get("stream") and body.get("logit_bias"):  # refused only once the stream has begun, as vLLM does
            async def refusal():
                error = {"message": "logit_bias is not yet supported with speculative decoding",
                         "type": "BadRequestError", "param": None, "code": 400}
                yield f"data: {json.dumps({'error': error})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(refusal(), media_type="text/event-stream")
        if body.get("stream"):
            async def tokens():
                yield 'data: {"choices": [{"text": "ok"}]}\n\n'
                yield "data: [DONE]\n\n"
            return StreamingResponse(tokens(), media_type="text/event-stream")
        return {"choices": [{"text": "ok"}], "prompt": body["prompt"]}

    across = functools.partial(serve_across_deaths, engine=engine, wait_s=wait_s, retries=1)
    return Guards(app, 1 << 16, None, across_deaths=across)


def post(guards, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=guards)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.post("/v1/completions", json=body)
    return asyncio.run(go())


def test_a_request_whose_engine_died_under_it_is_answered_by_the_rebuilt_engine():
    engine = StandInEngine(kill_on=[True])
    response = post(build(engine), {"prompt": "def f():"})
    assert response.status_code == 200 and response.json()["prompt"] == "def f():"  # the body was replayed
    assert engine.runs == [0, 1] and engine.quarantined_runs == 1  # the retry ran alone, on the new engine


def test_a_stream_that_died_before_its_first_token_is_retried_too():
    engine = StandInEngine(kill_on=[True])
    response = post(build(engine), {"prompt": "def f():", "stream": True})
    assert response.status_code == 200 and '"text": "ok"' in response.text and "error" not in response.text
    assert engine.runs == [0, 1]


def test_a_request_present_at_two_deaths_in_a_row_fails_alone_with_an_error_id_not_vllms_message():
    engine = StandInEngine(kill_on=[True, True])
    response = post(build(engine), {"prompt": "poison"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "engine_died" and "Error id" in error["message"]
    assert "EngineCore" not in response.text
    assert engine.runs == [0, 1]  # tried twice, not three times
    assert post(build(engine), {"prompt": "next"}).status_code == 200  # the engine serves the others


def test_a_rebuild_that_fails_or_does_not_finish_in_time_answers_503_with_retry_after():
    failed = post(build(StandInEngine(kill_on=[True], rebuild_ok=False)), {"prompt": "x"})
    never = post(build(StandInEngine(kill_on=[True], rebuild_ends=False), wait_s=0.05), {"prompt": "x"})
    for response in (failed, never):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == str(RETRY_AFTER_S)
        assert response.json()["error"]["code"] == "engine_recovering"


def test_an_ordinary_error_is_passed_through_unchanged_and_not_retried():
    engine = StandInEngine(kill_on=[])
    app = build(engine)
    inner = app.app

    @inner.post("/v1/chat/completions")
    async def chat():
        return JSONResponse({"error": {"message": "model 'x' not found", "type": "NotFoundError", "param": None,
                                       "code": 404}}, status_code=404)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/chat/completions", json={"model": "x", "messages": []})
    response = asyncio.run(go())
    assert response.status_code == 404 and "not found" in response.json()["error"]["message"]
    assert engine.runs == []


def test_a_stream_refused_before_its_first_token_is_answered_with_that_4xx_not_a_200():
    engine = StandInEngine(kill_on=[])
    response = post(build(engine), {"prompt": "x", "stream": True, "logit_bias": {"5": 1}})
    assert response.status_code == 400
    assert "logit_bias" in response.json()["error"]["message"]
    assert engine.runs == [0]  # refused, not retried
