"""Batch rows pause for online traffic in the real engine and lose nothing: a paused row
goes on from its prompt plus the tokens it had, and ends with the very text it would have
had without the pause (greedy, P-EAGLE on)."""

import asyncio

import pytest

from engine_loop import wait_until
from serving.batch_gate import BatchGate

pytestmark = pytest.mark.integration

PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
           "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\""]


def test_paused_batch_rows_end_with_the_text_they_would_have_had(tiny_models, loop):
    engine = loop.start_engine(["engine.max_num_seqs=8"])
    rows = [{"id": f"r{i}", "prompt": p, "max_tokens": 160, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    try:
        async def run():
            reference = await asyncio.gather(*(engine.generate(r) for r in rows))
            gate = BatchGate(max_rows=len(rows), max_rows_with_online=1)
            slots = [gate.try_admit() for _ in rows]
            for slot in slots:
                await slot.turn()
            tasks = [asyncio.ensure_future(engine.generate(r, pause=s)) for r, s in zip(rows, slots)]
            before = engine.stats.num_output_tokens
            await wait_until(lambda: engine.stats.num_output_tokens >= before + 4 * len(rows), "batch tokens")
            with gate.online_request():
                await wait_until(lambda: gate.num_paused == len(rows) - 1 or all(t.done() for t in tasks),
                                 "the newest rows to pause")
                paused_while_online = gate.num_paused
                online = await engine.generate({"id": "online", "prompt": "def add(a, b):", "max_tokens": 16,
                                                "priority": 0})
            return reference, await asyncio.gather(*tasks), online, paused_while_online

        reference, results, online, paused_while_online = loop.run(run())
    finally:
        engine.shutdown()
    assert online["ok"]
    assert paused_while_online == len(rows) - 1  # only the oldest row ran beside the online request
    assert [r["num_pauses"] for r in results] == [0, 1, 1, 1]
    for got, want in zip(results, reference):
        assert got["ok"] and got["num_output_tokens"] == 160
        assert got["token_ids"] == want["token_ids"]
        assert got["text"] == want["text"]
