"""Fault injection for pipeline tests: an engine stage whose process dies once.

Shipped to Ray workers by value (see `ray.cloudpickle.register_pickle_by_value`), so the
workers need not import the tests folder.
"""

import os
from pathlib import Path

from pipelines.stages import EngineStage


class DieOnceEngineStage(EngineStage):
    """Kills its own actor process on its second batch, the first time any actor gets
    there (a marker file records that it happened)."""

    marker_path: str = ""  # set by the test before the class is shipped to workers

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = 0

    async def __call__(self, batch):
        self.calls += 1
        marker = Path(self.marker_path)
        if self.calls == 2 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return await super().__call__(batch)
