"""Drive an in-process `Engine` from synchronous tests.

vLLM's async engine binds its output handler to the event loop of its first request, so
an engine must live on one loop for its whole life: this keeps that loop in a thread.
"""

import asyncio
import threading
import time

from actors.engine import Engine
from configs import load_config
from control.plan import startup_engine


class LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_engine(self, overrides: list[str]) -> Engine:
        cfg = load_config("tiny", overrides)

        async def build():
            return Engine(startup_engine(cfg.engine), cfg.sampling)

        return self.run(build())

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def generate_all(engine: Engine, prompts: list[dict]) -> dict[str, list[int]]:
    """Every prompt through the engine at once; fails unless all are answered. Returns
    each request's output token ids by its id."""
    results = await asyncio.gather(*(engine.generate(p) for p in prompts))
    assert all(r["ok"] for r in results), [r.get("error") for r in results if not r["ok"]]
    return {r["id"]: r["token_ids"] for r in results}


async def wait_until(predicate, what: str, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
    """Poll `predicate` on the engine's loop until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)
