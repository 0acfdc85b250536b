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
import json
import time
from typing import Any

from pipelines.backpressure import AdaptiveWindow
from pipelines.stages import ROW_COLUMNS, _plain

BUSY_GIVE_UP_S = 3600.0
MAX_REPLICA_FAILURES = 3


class ServeStage:
    def __init__(self, cfg: dict[str, Any]):
        from ray import serve

        from configs.schema import AppConfig

        app = AppConfig.model_validate(cfg)
        self.handle = serve.get_app_handle(app.serve_app)
        client = app.batch_client
        self.window = AdaptiveWindow(client.initial_in_flight, client.max_in_flight, client.max_backoff_s)

    async def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        from ray.serve.exceptions import BackPressureError

        await self.window.acquire()
        try:
            return await self.handle.generate_batch.remote(request)
        except BackPressureError:
            return {"busy": True}
        finally:
            await self.window.release()

    async def _run_row(self, row: dict[str, Any]) -> dict[str, Any]:
        out = {k: row[k] for k in ROW_COLUMNS}
        out.update(result=None, engine_key=None, engine_stats=None)
        if row["error"] is not None:
            return out
        request = json.loads(row["request"])
        started, attempt, failures = time.monotonic(), 0, 0
        while True:
            try:
                result = await self._call(request)
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
        if "engine_stats" in result:
            out["engine_key"] = f"replica-{result['replica_pid']}"
            out["engine_stats"] = json.dumps(result.pop("engine_stats"))
        if result["ok"]:
            out["result"] = json.dumps(result)
        else:
            out["error"] = json.dumps(result["error"])
        return out

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = [_plain(dict(zip(batch, values))) for values in zip(*batch.values())]
        done = await asyncio.gather(*(self._run_row(r) for r in rows))
        return {k: [r[k] for r in done] for k in (*ROW_COLUMNS, "result", "engine_key", "engine_stats")}
