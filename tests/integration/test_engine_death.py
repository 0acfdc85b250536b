"""When vLLM's engine core process dies under the engine (on GPUs: a CUDA error, the OOM
killer), the host rebuilds its engine and redoes the requests that were in flight:
nothing is lost, greedy outputs are what they would have been, a request that kills the
engine every time ends alone as an error with its reason after two deaths in a row while
the others go on, and a death with nothing in flight is noticed and repaired by itself."""

import asyncio
import logging
import os
import signal

import pytest

from actors.engine_lifecycle import ENGINE_DEATH_RETRIES
from humaneval_inputs import humaneval_requests

pytestmark = pytest.mark.integration

PROMPTS = [{"id": r["id"], "prompt": r["prompt"], "max_tokens": 96}
           for r in humaneval_requests(limit=6)]


def core_pids(engine) -> list[int]:
    """The engine core's process ids (vLLM's process manager inside AsyncLLM)."""
    return [p.pid for p in engine._llm.engine_core.resources.engine_manager.processes]


def kill_core(engine) -> None:
    for pid in core_pids(engine):
        os.kill(pid, signal.SIGKILL)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def wait_until(predicate, what: str, timeout_s: float = 240.0):
    for _ in range(int(timeout_s / 0.05)):  # bounded poll
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def engine(tiny_models, loop):
    engine = loop.start_engine(["sampling.temperature=0", "engine.max_num_seqs=8"])
    yield engine
    if not engine.closed:
        engine.shutdown()


async def _generate(engine, prompts):
    return await asyncio.gather(*(engine.generate(p) for p in prompts))


def test_requests_in_flight_when_the_core_dies_are_redone_and_unchanged(engine, loop):
    reference = {r["id"]: r["token_ids"] for r in loop.run(_generate(engine, PROMPTS))}
    old_pids = core_pids(engine)

    async def kill_mid_load():
        run = asyncio.ensure_future(_generate(engine, PROMPTS))
        steps = engine.stats.num_steps
        # 96 tokens take at least 20 steps at K=4: after 5, every request is mid-generation.
        await wait_until(lambda: engine.stats.num_steps >= steps + 5, "the requests to be decoding")
        kill_core(engine)
        return await run

    results = loop.run(kill_mid_load())
    assert [r["error"] for r in results if not r["ok"]] == []
    assert {r["id"]: r["token_ids"] for r in results} == reference  # redone, not truncated or changed
    assert engine.num_engine_deaths == 1 and engine.num_requests_rerun >= len(PROMPTS)
    assert set(core_pids(engine)).isdisjoint(old_pids)  # a new engine core serves now


def test_a_death_with_nothing_in_flight_is_repaired_by_the_watchdog(engine, loop):
    deaths = engine.num_engine_deaths
    kill_core(engine)

    async def after():
        await wait_until(lambda: engine.num_engine_deaths == deaths + 1 and not engine.restarting,
                         "the watchdog to rebuild the engine")
        await engine.check_health()
        return await engine.generate({"id": "after", "prompt": "def f(x):", "max_tokens": 8})

    result = loop.run(after())
    assert result["ok"] and result["num_output_tokens"] == 8


def test_a_request_that_kills_the_engine_every_time_fails_alone_and_the_others_in_flight_go_on(engine, loop):
    """A poison request among others: after the first death every request that was in
    flight runs again, one at a time; the poison kills the engine again while it runs
    alone, so it is the one failed (two deaths in a row), and every other request
    finishes with its greedy output unchanged."""
    run = engine._run
    reference = {r["id"]: r["token_ids"] for r in loop.run(_generate(engine, PROMPTS))}

    async def poisoned(req, *args, **kwargs):  # this input takes the engine down, every time
        if req.id == "poison":
            asyncio.get_running_loop().call_later(0.2, kill_core, engine)
        return await run(req, *args, **kwargs)

    engine._run = poisoned
    deaths, failed_alone = engine.num_engine_deaths, engine.num_requests_failed_alone
    poison_row = {"id": "poison", "prompt": "def g():", "max_tokens": 2000, "ignore_eos": True}
    try:
        results = loop.run(_generate(engine, [*PROMPTS, poison_row]))
    finally:
        del engine._run
    by_id = {r["id"]: r for r in results}
    poison = by_id.pop("poison")
    assert not poison["ok"] and poison["error"]["reason"] == "engine_died", poison
    assert [r["error"] for r in by_id.values() if not r["ok"]] == []
    assert {i: r["token_ids"] for i, r in by_id.items()} == reference
    assert engine.num_engine_deaths == deaths + ENGINE_DEATH_RETRIES + 1
    assert engine.num_requests_failed_alone == failed_alone + 1
    healthy = loop.run(engine.generate({"id": "next", "prompt": "def h():", "max_tokens": 8}))
    assert healthy["ok"] and healthy["num_output_tokens"] == 8


def test_an_engine_shut_down_on_purpose_is_not_rebuilt_and_logs_no_error(engine, loop):
    restarts = engine.num_restarts
    errors = _Records()
    vllm_log = logging.getLogger("vllm.v1.engine.async_llm")  # vLLM's loggers do not propagate
    vllm_log.addHandler(errors)
    try:
        # From another thread than the engine's loop, as Ray Data retires a stage.
        engine.shutdown()  # vLLM's engine now reports itself errored, as a dead one does

        async def watchdog_gone():
            await wait_until(lambda: engine._watchdog is None or engine._watchdog.done(), "the watchdog to stop")
            await wait_until(engine._llm.output_handler.done, "vLLM's output handler to end")
            return await engine.recover(engine.engine_generation)

        assert loop.run(watchdog_gone()) is False
    finally:
        vllm_log.removeHandler(errors)
    assert errors.messages == []  # a clean stop is not "AsyncLLM output_handler failed"
    assert engine.num_restarts == restarts
    result = loop.run(engine.generate({"id": "late", "prompt": "def f():", "max_tokens": 4}))
    assert not result["ok"] and result["error"]["reason"] == "engine_closed"
