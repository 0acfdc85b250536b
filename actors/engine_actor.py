"""A Ray actor holding one `Engine`, serving many requests at once.

The actor is async with high `max_concurrency`, so every request it is handed runs as
its own coroutine and vLLM batches them continuously. It only hosts: request mapping,
statistics and the engine itself live in `actors.engine`.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from configs.schema import AppConfig

# Requests one actor accepts concurrently; the pool keeps fewer in flight
# (pool.max_requests_in_flight) so this only bounds misuse.
ACTOR_MAX_CONCURRENCY = 4096


class EngineActor:
    """Hosts one engine. Create with `EngineActor.options(...).remote(cfg_dict)`;
    see `actors.pool.EnginePool` for resources."""

    def __init__(self, cfg: dict[str, Any]):
        from actors.engine import Engine

        self.cfg = AppConfig.model_validate(cfg)
        self.engine = Engine(self.cfg.engine, self.cfg.sampling, device=self.cfg.pool.device)

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        result = await self.engine.generate(request)
        result["actor_pid"] = os.getpid()
        return result

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "startup_s": self.engine.startup_s,
            "vllm_kwargs": self.engine.kwargs,
        }

    def stats(self) -> dict[str, Any]:
        return self.engine.stats_dict()

    def vllm_spec_counters(self) -> dict[str, Any]:
        return self.engine.vllm_spec_counters()


RemoteEngineActor = ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)(EngineActor)
