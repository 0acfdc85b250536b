"""Where an engine's restart may overlap the old engine's teardown (`actors.engine_lifecycle`):
on a CPU the new engine starts while the old core stops (it holds no request by then); on a
GPU the old engine must be gone first, since the new one sizes its KV cache from the memory
left free. Stand-in engines record the order; no vLLM, no timing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from actors.engine_lifecycle import EngineLifecycle
from actors.spec_stats import StepWindow
from configs import load_config

pytestmark = pytest.mark.unit

WAIT_S = 30.0  # bound on waiting for the other side; never reached when the order is right


class OldEngine:
    """What `stop_engine` touches of vLLM's AsyncLLM. Its shutdown waits (bounded) for the
    new engine to start when told to: that only returns early if the two overlap."""

    output_handler = None

    def __init__(self, log: list[str], new_started: threading.Event, wait_for_new: bool):
        self.log, self.new_started, self.wait_for_new = log, new_started, wait_for_new

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.log.append("stop begins")
        if self.wait_for_new:
            self.log.append("new engine started during the stop" if self.new_started.wait(WAIT_S)
                            else "stop ended with no new engine")
        self.log.append("stop ends")


class Host(EngineLifecycle):
    def __init__(self, device: str, wait_for_new: bool):
        self.device, self.cfg = device, load_config("tiny").engine
        self.speculating, self._openai, self.step_window = True, None, StepWindow()
        self.log: list[str] = []
        self.new_started = threading.Event()
        self._llm = OldEngine(self.log, self.new_started, wait_for_new)
        self._init_lifecycle()

    def _start_llm(self, kwargs) -> None:
        self.log.append("start " + ("with drafter" if kwargs.get("speculative_config") else "plain"))
        self._llm = "new engine"
        self.new_started.set()


def test_a_cpu_engine_starts_its_replacement_while_the_old_core_stops():
    host = Host("cpu", wait_for_new=True)
    asyncio.run(host._rebuild_now(False))
    assert "new engine started during the stop" in host.log, host.log
    assert host.log[-1] == "stop ends" and host._llm == "new engine"
    assert host.speculating is False and host.num_restarts == 1


def test_a_gpu_engine_is_stopped_before_its_replacement_starts():
    host = Host("gpu", wait_for_new=False)
    asyncio.run(host._rebuild_now(True))
    assert host.log == ["stop begins", "stop ends", "start with drafter"]
    assert host._llm == "new engine" and host.num_restarts == 1
