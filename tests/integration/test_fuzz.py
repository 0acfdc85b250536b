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

import httpx
import pytest

from actors.engine import Engine
from configs import load_config
from control.plan import resolve
from fuzz_answers import send_http
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


def requests_for(round_index: int, num_http: int, num_rows: int, vocab_size: int) -> list[Fuzzed]:
    rng = random.Random(f"{SEED}-{round_index}")
    cases = [completion_request(rng, "tiny", vocab_size) if rng.random() < 0.5
             else chat_request(rng, "tiny", vocab_size) for _ in range(num_http)]
    cases += [batch_row(rng, round_index * 1000 + i) for i in range(num_rows)]
    rng.shuffle(cases)
    return cases


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
        engine = Engine(resolve(cfg).serve_engine, cfg.sampling, device="cpu")
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
