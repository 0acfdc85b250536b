"""Fuzzing every sampling field the doors accept, on each speculation method: no
combination of valid values gets a 5xx, kills the engine core or is refused, and every
deliberately broken value is refused (4xx with an OpenAI error body on the HTTP door,
reason "invalid_request" on the batch door).

One in-process engine per method, served as a Serve replica serves it (serving/app.py's
`guarded`: vLLM's OpenAI app behind the door's guards and its retry across engine
deaths, which would hide a death from the client but not from the engine's count; batch rows through
`Engine.generate`), driven at concurrency 1, 4 and 16 with seeded request lists
(tests/integration/fuzz_requests.py). FUZZ_SEED=<int> draws other lists."""

import asyncio
import json
import os
import random
from collections import Counter
from typing import Any

import httpx
import pytest

from actors.engine import Engine
from configs import load_config
from fuzz_requests import Fuzzed, batch_row, chat_request, completion_request
from serving.app import guarded

pytestmark = pytest.mark.integration

METHODS = {
    "peagle": [],  # the tiny preset's default: artifacts/tiny/peagle-head, K=4
    "eagle3": ["engine.spec={method: eagle3, head: artifacts/tiny/eagle3-head, num_speculative_tokens: 4}"],
    "ngram": ["engine.spec={method: ngram, num_speculative_tokens: 4}"],
    "none": ["engine.spec={method: none}"],
}
# (concurrency, OpenAI requests, batch rows) per round; all rounds of a method on one engine.
ROUNDS = [(1, 8, 4), (4, 12, 8), (16, 20, 12)]
SEED = int(os.environ.get("FUZZ_SEED", "20240611"))
REQUEST_TIMEOUT_S = 120.0
ROUND_TIMEOUT_S = 300.0


def _spec_refuses(method: str, body: dict[str, Any]) -> bool:
    return method != "none" and ((body.get("min_p") or 0) > 0 or bool(body.get("logit_bias")))


def _greedy_with_n(method: str, body: dict[str, Any]) -> bool:
    temperature = body.get("temperature")
    return temperature is not None and temperature < 1e-5 and (body.get("n") or 1) > 1


# Valid-looking combinations vLLM refuses on purpose: (name, applies(method, body), a
# substring of vLLM's message, why). A valid request matching one may get a 400 with
# that message; any other refusal of a valid request is a failure.
ALLOWED_REFUSALS = [
    ("min_p or logit_bias under speculation", _spec_refuses, "not yet supported with speculative decoding",
     "vllm/sampling_params.py SamplingParams._validate_spec_decode: vLLM 0.32's rejection sampler "
     "applies neither, so it refuses them on an engine with a speculative config"),
    ("n > 1 with temperature 0", _greedy_with_n, "n must be 1 when using greedy sampling",
     "vllm/sampling_params.py SamplingParams._verify_greedy_sampling: n greedy samples would all be "
     "the same text (OpenAI itself accepts it and returns n copies)"),
]


def allowed_refusal(method: str, body: dict[str, Any], message: str) -> str | None:
    for name, applies, text, _why in ALLOWED_REFUSALS:
        if applies(method, body) and text in message:
            return name
    return None


def requests_for(round_index: int, num_http: int, num_rows: int, vocab_size: int) -> list[Fuzzed]:
    rng = random.Random(f"{SEED}-{round_index}")
    cases = [completion_request(rng, "tiny", vocab_size) if rng.random() < 0.5
             else chat_request(rng, "tiny", vocab_size) for _ in range(num_http)]
    cases += [batch_row(rng, round_index * 1000 + i) for i in range(num_rows)]
    rng.shuffle(cases)
    return cases


def _choices_wanted(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    return n if isinstance(n, int) and n > 0 else 1


def check_json_answer(case: Fuzzed, data: dict[str, Any]) -> list[str]:
    """What is wrong with a 200 answer's body."""
    choices = data.get("choices") or []
    finished = sorted(c["index"] for c in choices if c.get("finish_reason"))
    if finished != list(range(_choices_wanted(case.body))):
        return [f"choices with a finish_reason {finished}, asked n={case.body.get('n', 1)}"]
    return []


def stream_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def stream_error(text: str) -> dict[str, Any] | None:
    """The first error event of a stream (vLLM sends one, then [DONE], when a request
    fails after its 200 was sent)."""
    for event in stream_events(text):
        if event != "[DONE]" and "error" in (chunk := json.loads(event)):
            return chunk["error"]
    return None


def check_stream(case: Fuzzed, text: str) -> list[str]:
    """What is wrong with a 200 server-sent-event stream without an error event."""
    events = stream_events(text)
    if not events or events[-1] != "[DONE]":
        return [f"stream did not end with data: [DONE] (last event {events[-1:]!r})"]
    finished, usage = set(), None
    for event in events[:-1]:
        chunk = json.loads(event)
        finished |= {c["index"] for c in chunk.get("choices") or [] if c.get("finish_reason")}
        usage = chunk.get("usage") or usage
    problems = []
    if sorted(finished) != list(range(_choices_wanted(case.body))):
        problems.append(f"streamed choices with a finish_reason {sorted(finished)}, asked n={case.body.get('n', 1)}")
    if (case.body.get("stream_options") or {}).get("include_usage") and usage is None:
        problems.append("include_usage asked, no usage chunk")
    return problems


async def send_http(client: httpx.AsyncClient, method: str, case: Fuzzed) -> tuple[str, list[str]]:
    """(status label, problems) of one OpenAI request."""
    async with client.stream("POST", case.path, json=case.body) as response:
        raw = await response.aread()
    status, text = response.status_code, raw.decode("utf-8", "replace")
    if status >= 500:
        return str(status), [f"{status}: {text[:500]}"]
    if status == 200 and case.body.get("stream") and (error := stream_error(text)) is not None:
        # The status line is already sent: a refusal here is not a 4xx, a failure not a 5xx.
        code, message = error.get("code"), str(error.get("message"))
        if not isinstance(code, int) or code >= 500:
            kind = "engine failure"
        elif case.invalid is not None:
            kind = f"refusal of broken {case.invalid!r}"
        else:
            kind = f"refusal ({allowed_refusal(method, case.body, message) or 'not allow-listed'})"
        return f"200+error {code}", [f"{kind} sent as an error event in a 200 stream: {json.dumps(error)[:300]}"]
    if status == 200:
        if case.invalid is not None:
            return "200", [f"broken {case.invalid!r} was served (200)"]
        problems = check_stream(case, text) if case.body.get("stream") else check_json_answer(case, json.loads(text))
        return "200", problems
    try:
        message = json.loads(text)["error"]["message"]
        assert isinstance(message, str) and message
    except (ValueError, KeyError, TypeError, AssertionError):
        return str(status), [f"{status} without an OpenAI error body: {text[:300]}"]
    if status not in (400, 422):
        return str(status), [f"unexpected {status}: {message[:300]}"]
    if case.invalid is not None:
        return str(status), []
    allowed = allowed_refusal(method, case.body, message)
    if allowed is not None:
        return f"{status} allowed", []
    return str(status), [f"valid request refused {status}: {message[:300]}"]


async def send_row(engine, case: Fuzzed) -> tuple[str, list[str]]:
    try:
        result = await engine.generate(case.body)
    except Exception as exc:  # Engine.generate promises a result dict for every row
        return "row raised", [f"Engine.generate raised {type(exc).__module__}.{type(exc).__name__}: {exc}"]
    if result.get("id") != case.body["id"]:
        return "row mismatched", [f"result id {result.get('id')!r}"]
    if result["ok"]:
        if case.invalid is not None:
            return "row ok", [f"broken {case.invalid!r} was served"]
        if result["num_output_tokens"] > case.body["max_tokens"]:
            return "row ok", [f"{result['num_output_tokens']} tokens > max_tokens"]
        return "row ok", []
    reason = result["error"]["reason"]
    if case.invalid is not None and reason == "invalid_request":
        return "row invalid_request", []
    return f"row {reason}", [f"row error {reason}: {result['error']['message'][:300]}"]


async def fuzz_round(engine, guards, method: str, cases: list[Fuzzed], concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=guards)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=REQUEST_TIMEOUT_S) as client:
        async def one(case: Fuzzed):
            async with gate:
                try:
                    if case.path is None:
                        return await send_row(engine, case)
                    return await send_http(client, method, case)
                except Exception as exc:  # a timeout, a dropped connection, an unreadable body
                    return "no answer", [f"no answer: {type(exc).__name__}: {exc}"]

        return await asyncio.gather(*(one(c) for c in cases))


def start_replica_engine(loop, overrides: list[str]):
    """An Engine and its guarded OpenAI app, built as serving/app.py's EngineReplica does."""
    cfg = load_config("tiny", overrides)

    async def build():
        engine = Engine(cfg.serving_engine(), cfg.sampling, device="cpu")
        try:
            app = await engine.openai_app(cfg.name)
        except BaseException:
            engine.shutdown()
            raise
        return engine, guarded(app, engine, cfg, api_key=None)

    return loop.run(build(), 300)


@pytest.mark.parametrize("method", list(METHODS))
def test_fuzzed_requests_get_answers_or_4xx_and_never_kill_the_engine(tiny_models, loop, method):
    engine, guards = start_replica_engine(loop, METHODS[method])
    statuses: Counter = Counter()
    failures: list[str] = []
    num_cases = num_answers = 0
    try:
        vocab_size = engine._llm.model_config.get_vocab_size()
        for index, (concurrency, num_http, num_rows) in enumerate(ROUNDS):
            cases = requests_for(index, num_http, num_rows, vocab_size)
            outcomes = loop.run(fuzz_round(engine, guards, method, cases, concurrency), ROUND_TIMEOUT_S)
            num_cases += len(cases)
            num_answers += sum(label != "no answer" for label, _ in outcomes)
            for case, (label, problems) in zip(cases, outcomes):
                statuses[label] += 1
                failures += [f"c={concurrency} {case.path or 'batch'} {json.dumps(case.body)}\n    -> {p}"
                             for p in problems]
        # A death in the last round may not be counted yet: a last row goes through the
        # engine's own recovery, which notices and counts it before answering.
        probe = loop.run(engine.generate({"id": "probe", "prompt": "def f():", "max_tokens": 2}), ROUND_TIMEOUT_S)
        deaths = engine.num_engine_deaths
    finally:
        engine.shutdown()
    print(f"\nfuzz {method}: {num_cases} requests, {num_answers} answers, "
          f"statuses {dict(sorted(statuses.items()))}, engine deaths {deaths}, failures {len(failures)}")
    for failure in failures:
        print("  " + failure)
    assert num_answers == num_cases
    assert failures == []
    assert deaths == 0
    assert probe["ok"], probe
