"""The HTTP door's guards (serving.middleware) in front of a FastAPI app that answers
the way FastAPI does: what an OpenAI client sees for abuse and for malformed bodies."""

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request

from serving.middleware import Guards, choices_requested

pytestmark = pytest.mark.unit

LIMIT = 4096


def build_app():
    app = FastAPI()
    seen = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        return {"choices": [{"text": "ok"}] * body.get("n", 1)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return {"choices": [{"message": {"content": "ok"}}]}

    @app.post("/v1/refuse")
    async def refuse():
        raise HTTPException(status_code=400, detail="bad thing named 'x'")

    @app.get("/v1/typed/{count}")
    async def typed(count: int):
        return {"count": count}

    @app.get("/health")
    async def health():
        return {}

    return Guards(app, LIMIT, api_key=None, max_choices=8), seen


def post(app, path, content, headers=None):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if isinstance(content, (bytes, str)):
                return await client.post(path, content=content, headers=headers or {})
            return await client.post(path, content=content(), headers=headers or {})  # async generator: chunked
    return asyncio.run(go())


def get(app, path):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path)
    return asyncio.run(go())


def openai_error_of(response):
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


@pytest.mark.parametrize("body, param, value", [
    ({"prompt": "x", "n": 1000}, "n", "1000"),
    ({"prompt": "x", "n": 2, "best_of": 50}, "best_of", "50"),
    ({"prompt": ["a"] * 9}, "prompt", "9 prompts"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "n", "9 completions"),
])
def test_requests_asking_for_too_many_completions_get_400_naming_the_value(body, param, value):
    app, seen = build_app()
    r = post(app, "/v1/completions", json.dumps(body))
    assert r.status_code == 400
    error = openai_error_of(r)
    assert error["param"] == param and value in error["message"] and "serve.max_n" in error["message"]
    assert seen == []  # never reached the engine's app
    ok = post(app, "/v1/completions", json.dumps({"prompt": ["a", "b"], "n": 4}))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_chat_n_is_capped_and_token_id_prompts_count_as_one():
    assert choices_requested("/v1/chat/completions", {"messages": [], "n": 9}) == (9, "n")
    assert choices_requested("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]}) == (1, "n")
    assert choices_requested("/v1/completions", {"prompt": [[1, 2], [3]], "n": 2}) == (4, "n")
    app, _ = build_app()
    assert post(app, "/v1/chat/completions", json.dumps({"messages": [], "n": 9})).status_code == 400


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "x", "max_tok', "not valid JSON"),  # truncated
    (b'{"prompt": "\xff\xfe"}', "not valid JSON"),  # invalid UTF-8
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),  # under the size limit below
])
def test_bodies_that_are_not_json_get_an_openai_400(raw, words):
    app, seen = build_app()
    app.max_request_bytes = 200_000
    r = post(app, "/v1/completions", raw)
    assert r.status_code == 400 and words in openai_error_of(r)["message"]
    assert seen == []


def test_framework_errors_on_v1_are_rewritten_to_openai_shape():
    app, _ = build_app()
    r = post(app, "/v1/refuse", b"{}")
    assert r.status_code == 400 and "bad thing named 'x'" in openai_error_of(r)["message"]
    r = get(app, "/v1/typed/notanumber")  # FastAPI's 422 list of validation errors
    assert r.status_code == 422 and "count" in openai_error_of(r)["message"]
    r = get(app, "/v1/nowhere")
    assert r.status_code == 404 and openai_error_of(r)["code"] == 404
    assert get(app, "/health").headers["x-peagle-replica-pid"]


def test_chunked_body_over_the_limit_gets_413_without_reading_it_all():
    app, seen = build_app()
    sent = []

    async def chunks():
        for _ in range(1000):  # 1000 x 1 KiB = far over the 4 KiB limit
            sent.append(1)
            yield b" " * 1024

    r = post(app, "/v1/completions", chunks)
    assert r.status_code == 413 and str(LIMIT) in openai_error_of(r)["message"]
    assert seen == [] and len(sent) < 10  # stopped reading at the limit

    async def small():
        yield json.dumps({"prompt": "x", "n": 2}).encode()

    ok = post(app, "/v1/completions", small)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_generation_requests_count_as_online_traffic_while_they_run_and_others_do_not():
    """The batch gate learns of online traffic from here: every generation request from
    arrival to its last byte, refused ones and other routes not."""
    from serving.batch_gate import BatchGate

    gate = BatchGate(max_rows=4, max_rows_with_online=1)
    app, _ = build_app()
    inner = app.app
    seen_in_flight = []

    async def watching(scope, receive, send):
        seen_in_flight.append((scope["path"], gate.online_in_flight))
        await inner(scope, receive, send)

    guarded = Guards(watching, LIMIT, api_key=None, max_choices=8, on_generation=gate.online_request)
    assert post(guarded, "/v1/completions", json.dumps({"prompt": "x"})).status_code == 200
    assert post(guarded, "/v1/chat/completions", json.dumps({"messages": []})).status_code == 200
    assert get(guarded, "/v1/typed/3").status_code == 200
    assert post(guarded, "/v1/completions", json.dumps({"prompt": "x", "n": 99})).status_code == 400
    assert seen_in_flight == [("/v1/completions", 1), ("/v1/chat/completions", 1), ("/v1/typed/3", 0)]
    assert gate.online_in_flight == 0  # and out again, each one
