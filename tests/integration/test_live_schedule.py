"""K changed on a live engine: lossless at every K it may run, under a dynamic schedule,
and while requests are in flight (the real vLLM engine on CPU, tiny model, float32, greedy).

Upstream warns that P-EAGLE with a per-step K below the start-up K may mis-shape drafts
(vLLM fix #45695 pending). On vLLM 0.32 it does: the last test shows the engine dying on
it, which is why P-EAGLE runs only at 0 or its start-up K here (configs.vllm_args.
live_k_values) and any other K is refused by name. EAGLE-3 runs every K in 0..K_max.
Every output must be the no-speculation output token for token, and the drafts counted
must show that the K asked for is the K that ran.
"""

import asyncio
import random

import pytest

from configs import load_config
from humaneval_inputs import humaneval_requests

pytestmark = pytest.mark.integration

K_MAX = 4
# Different lengths, so the running batch falls 12 -> 1 as requests finish.
PROMPTS = [{"id": r["id"], "prompt": r["prompt"], "max_tokens": 8 + 8 * i}
           for i, r in enumerate(humaneval_requests(limit=12))]
BASE = ["sampling.temperature=0", "engine.max_num_seqs=32"]
PEAGLE = [*BASE, f"engine.spec.num_speculative_tokens={K_MAX}", f"engine.spec.schedule=[[1,32,{K_MAX}]]"]
EAGLE3 = [*PEAGLE, "engine.spec.method=eagle3", "engine.spec.head=artifacts/tiny/eagle3-head"]


def _start(loop, overrides):
    return loop.start_engine(overrides)


async def _generate_all(engine):
    results = await asyncio.gather(*(engine.generate(p) for p in PROMPTS))
    assert all(r["ok"] for r in results), [r.get("error") for r in results if not r["ok"]]
    return {r["id"]: r["token_ids"] for r in results}


@pytest.fixture(scope="module")
def reference(tiny_models, loop):
    engine = _start(loop, [*BASE, "engine.spec={method: none}"])
    try:
        return loop.run(_generate_all(engine))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def peagle(tiny_models, loop):
    engine = _start(loop, PEAGLE)
    yield engine
    engine.shutdown()


def _ks_run(window: dict) -> set[int]:
    return {k for k, n in window["num_steps_by_k"].items() if n}


@pytest.mark.parametrize("method,ks", [("peagle", [K_MAX, 0, K_MAX]), ("eagle3", range(K_MAX, -1, -1))])
def test_every_k_the_engine_may_run_is_lossless(method, ks, reference, peagle, loop):
    engine = peagle if method == "peagle" else _start(loop, EAGLE3)
    try:
        for k in ks:
            applied = loop.run(engine.set_spec_schedule([[1, 32, k]]))
            assert applied["schedule"] == [[1, 32, k]]
            engine.step_window.drain()
            out = loop.run(_generate_all(engine))
            window = engine.step_window.drain()
            mismatched = [i for i in reference if out[i] != reference[i]]
            assert not mismatched, f"{method} at K={k}: greedy output differs from no speculation for {mismatched}"
            # The K asked for is the K that ran: drafts reach position k and no further.
            drafts = window["drafts_per_pos"] + [0] * K_MAX
            assert all(d > 0 for d in drafts[:k]) and not any(drafts[k:]), (k, window["drafts_per_pos"])
    finally:
        if engine is not peagle:
            engine.shutdown()


def test_dynamic_batch_size_schedule_is_lossless(reference, peagle, loop):
    # Batch size falls from 12 to 1 as requests finish, so K changes step by step.
    loop.run(peagle.set_spec_schedule([[1, 2, 4], [3, 5, 0], [6, 8, 4], [9, 32, 0]]))
    peagle.step_window.drain()
    out = loop.run(_generate_all(peagle))
    window = peagle.step_window.drain()
    assert not [i for i in reference if out[i] != reference[i]]
    steps = {(s["batch_size"], s["num_speculative_tokens"]): s["num_steps"] for s in window["steps"]}
    assert _ks_run(window) == {0, K_MAX}, steps
    # Each range of batch sizes ran mostly the K the table gives it. (Not every step: the
    # drafts a step verifies were proposed at the previous step's batch size, so a step
    # where requests finish is counted at the new size with the old K.)
    for lo, hi, expected in [(3, 5, 0), (6, 8, K_MAX), (9, 12, 0)]:
        ran = {k: sum(n for (b, kk), n in steps.items() if lo <= b <= hi and kk == k) for k in (0, K_MAX)}
        assert ran[expected] > ran[K_MAX - expected], (lo, hi, steps)


def test_tables_swapped_while_requests_run_lose_and_change_nothing(reference, peagle, loop):
    tables = [[[1, 32, 0]], [[1, 32, K_MAX]], [[1, 4, K_MAX], [5, 32, 0]], [[1, 6, 0], [7, 32, K_MAX]]]
    rng = random.Random(7)
    swaps = []

    async def run():
        done = asyncio.Event()

        async def flip():
            for _ in range(400):  # bounded: at most 400 swaps, 20 ms apart
                if done.is_set():
                    return
                table = rng.choice(tables)
                await peagle.set_spec_schedule(table)
                swaps.append((table, peagle.signals.get("num_running_reqs", 0)))
                await asyncio.sleep(0.02)

        flipper = asyncio.get_running_loop().create_task(flip())
        try:
            return await _generate_all(peagle)
        finally:
            done.set()
            await flipper

    peagle.step_window.drain()
    out = loop.run(run())
    window = peagle.step_window.drain()
    assert set(out) == set(reference)  # every request answered once
    assert not [i for i in reference if out[i] != reference[i]]
    assert sum(1 for _, running in swaps if running) >= 10  # swaps really happened mid-flight
    assert _ks_run(window) == {0, K_MAX}


def test_a_bad_table_is_refused_by_name_and_the_engine_keeps_serving(peagle, loop):
    with pytest.raises(ValueError, match="9"):
        loop.run(peagle.set_spec_schedule([[1, 32, 9]]))
    with pytest.raises(ValueError, match="contiguous from 1"):
        loop.run(peagle.set_spec_schedule([[2, 32, 0]]))
    with pytest.raises(ValueError, match=r"K=\[2\] cannot run.*allowed K values are \[0, 4\]"):
        loop.run(peagle.set_spec_schedule([[1, 8, 4], [9, 32, 2]]))
    loop.run(peagle.set_spec_schedule([[1, 3, 4], [4, 32, 0]]))
    assert loop.run(peagle.spec_schedule())["schedule"] == [[1, 3, 4], [4, 32, 0]]
    result = loop.run(peagle.generate({"id": "after", "prompt": "def f(x):", "max_tokens": 8}))
    assert result["ok"] and result["num_output_tokens"] == 8


def test_an_engine_started_without_a_table_says_how_to_get_one(tiny_models, loop):
    engine = _start(loop, [*BASE, f"engine.spec.num_speculative_tokens={K_MAX}"])
    try:
        with pytest.raises(Exception, match="num_speculative_tokens_per_batch_size"):
            loop.run(engine.set_spec_schedule([[1, 32, 0]]))
        result = loop.run(engine.generate({"id": "after", "prompt": "def f(x):", "max_tokens": 8}))
        assert result["ok"] and result["num_output_tokens"] == 8  # refused, not broken
    finally:
        engine.shutdown()


def test_upstream_peagle_below_startup_k_is_still_broken_in_this_vllm(tiny_models, loop):
    """The combination the guard avoids, run on raw vLLM: P-EAGLE started at K=4 with a
    step K of 3. When this test fails, vLLM fixed it: widen live_k_values for P-EAGLE."""
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    from configs.vllm_args import to_vllm_kwargs

    kwargs = to_vllm_kwargs(load_config("tiny", PEAGLE).engine)
    kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = [[1, 32, 3]]

    async def start():
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    async def run_one(llm):
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3, 4]),
                                    SamplingParams(max_tokens=16, temperature=0.0), "k3"):
            pass

    llm = loop.run(start())  # the engine starts: a start-up failure is no evidence either way
    try:
        with pytest.raises(EngineDeadError):  # the step at K=3 kills the engine core
            loop.run(run_one(llm))
    finally:
        llm.shutdown()
