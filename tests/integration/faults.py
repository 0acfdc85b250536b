"""Fault injection for pipeline tests: engine stages whose process, or engine core, dies once.

Shipped to Ray workers by value (see `ray.cloudpickle.register_pickle_by_value`), so the
workers need not import the tests folder.
"""

import os
from pathlib import Path

from actors.batch_host import EngineStage


class _FaultOnSecondBatch(EngineStage):
    """Injects its fault on its second batch, the first time any actor gets there (a marker
    file records that it happened)."""

    marker_path: str = ""  # set by the test before the class is shipped to workers

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.calls = 0

    def _fault_due(self) -> bool:
        self.calls += 1
        return self.calls == 2 and not Path(self.marker_path).exists()


class DieOnceEngineStage(_FaultOnSecondBatch):
    """Kills its own actor process."""

    async def __call__(self, batch):
        if self._fault_due():
            Path(self.marker_path).write_text(str(os.getpid()))
            os._exit(1)
        return await super().__call__(batch)


class CoreDiesOnceEngineStage(_FaultOnSecondBatch):
    """Kills its vLLM engine core process (SIGKILL, as the OOM killer would) once the
    batch's rows are inside the engine; the actor itself lives on."""

    async def __call__(self, batch):
        import asyncio
        import signal

        if not self._fault_due():
            return await super().__call__(batch)
        work = asyncio.ensure_future(super().__call__(batch))
        for _ in range(2400):  # bounded: 120 s
            if self.engine._llm.get_num_unfinished_requests() > 0 or work.done():
                break
            await asyncio.sleep(0.05)
        pids = [p.pid for p in self.engine._llm.engine_core.resources.engine_manager.processes]
        Path(self.marker_path).write_text(f"{pids} with {self.engine._llm.get_num_unfinished_requests()} requests inside")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return await work
