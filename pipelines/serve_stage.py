"""Ray Data stage that sends rows to a running Serve app's batch door instead of
starting engines of its own: one pool, two doors.

Each row goes to `EngineReplica.generate_batch` through a Serve handle under an
`AdaptiveWindow`. A `busy` answer or Serve back-pressure shrinks the window and retries
the row after a back-off; a replica that dies mid-row is retried too. Only a row still
not admitted after `BUSY_GIVE_UP_S` ends in the error output (reason `busy_timeout`),
so a long-saturated pool slows the job down but never loses a row silently.
Knows nothing about vLLM or S3.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.row_stage import RowStage
from configs.schema import AppConfig
from pipelines.backpressure import AdaptiveWindow
from pipelines.cpu_priority import give_way

BUSY_GIVE_UP_S = 3600.0
MAX_REPLICA_FAILURES = 3


class ServeStage(RowStage):
    """The row protocol (`actors.row_stage.RowStage`) on a running Serve app's replicas,
    through its batch door, in an adaptive window that backs off while they are busy."""

    def __init__(self, cfg: dict[str, Any], board=None):
        from ray import serve

        app = AppConfig.model_validate(cfg)
        give_way(app.batch_client.nice)  # batch gives way to the replicas on a shared node
        self.handle = serve.get_app_handle(app.serve_app)
        client = app.batch_client
        self.window = AdaptiveWindow(client.initial_in_flight, client.max_in_flight, client.max_backoff_s)
        self.board = board

    async def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        from ray.serve.exceptions import BackPressureError

        await self.window.acquire()
        try:
            return await self.handle.generate_batch.remote(request)
        except BackPressureError:
            return {"busy": True}
        finally:
            await self.window.release()

    async def run(self, custom_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        started, attempt, failures = time.monotonic(), 0, 0
        while True:
            try:
                result = await self._call(payload["request"])
            except Exception as exc:  # replica died / was replaced: try another one
                failures += 1
                if failures > MAX_REPLICA_FAILURES:
                    result = {"ok": False, "error": {"reason": "engine_error", "message": repr(exc)}}
                else:
                    await asyncio.sleep(self.window.backoff_s(failures))
                    continue
            if not result.get("busy"):
                self.window.on_accepted()
                break
            self.window.on_busy()
            if time.monotonic() - started > BUSY_GIVE_UP_S:
                result = {"ok": False, "error": {"reason": "busy_timeout",
                          "message": f"pool stayed busy for {BUSY_GIVE_UP_S:.0f}s"}}
                break
            await asyncio.sleep(self.window.backoff_s(attempt))
            attempt += 1
        if "engine_stats" in result and self.board is not None:
            await self.board.report.remote(f"replica-{result['replica_pid']}", result.pop("engine_stats"))
        result.pop("engine_stats", None)
        return {**result, "kind": payload["kind"]} if result["ok"] else result
