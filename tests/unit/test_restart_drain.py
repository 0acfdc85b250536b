"""A restart asked for while a batch row is paused for online traffic (the row keeps its
tokens on our side and holds nothing in the engine): the drain does not wait for the
row, which online requests held at the closed gate would keep paused until the drain's
600 s timeout; the row goes on once the new engine admits. Stand-in engine, no vLLM, no
timing: every wait is an event, bounded."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine_lifecycle import EngineLifecycle
from actors.spec_stats import StepWindow
from configs import load_config

pytestmark = pytest.mark.unit

BOUND_S = 30.0  # never reached when the drain is right


class StandInLLM:
    output_handler = None
    errored = False

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


class Host(EngineLifecycle):
    def __init__(self):
        self.device, self.cfg = "cpu", load_config("tiny").engine
        self.speculating, self._openai, self.step_window = True, None, StepWindow()
        self._llm = StandInLLM()
        self.engines_started = 0
        self._init_lifecycle()

    def _start_llm(self, kwargs) -> None:
        self.engines_started += 1
        self._llm = StandInLLM()


def test_a_restart_does_not_wait_for_a_batch_row_paused_for_online_traffic():
    async def run():
        host = Host()
        online_left = asyncio.Event()  # set only after the restart: the row stays paused through it
        row_paused, events = asyncio.Event(), []

        async def batch_row():
            async with host.admitted():
                async with host.stepped_out():
                    row_paused.set()
                    await online_left.wait()
                events.append(("row back in the engine", host.engine_generation, host.num_active))

        row = asyncio.ensure_future(batch_row())
        await asyncio.wait_for(row_paused.wait(), BOUND_S)
        await asyncio.wait_for(host.restart_engine(False, drain_timeout_s=BOUND_S), BOUND_S)
        events.append(("restarted", host.engine_generation, host.num_active))
        online_left.set()
        await asyncio.wait_for(row, BOUND_S)
        return host, events

    host, events = asyncio.run(run())
    assert events == [("restarted", 1, 0), ("row back in the engine", 1, 1)]
    assert host.engines_started == 1 and host.num_active == 0 and host.speculating is False
