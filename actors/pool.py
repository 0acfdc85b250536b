"""A pool of engine actors and a dispatcher that keeps every engine busy.

The pool starts `pool.min_actors` actors with the resources of the resource plan and
feeds them requests: each actor holds up to `pool.max_requests_in_flight`; a new request
goes to the least-loaded actor the moment any request finishes (no per-batch barrier).
Results come back keyed by request id, in completion order. An actor that dies has its
in-flight requests resubmitted to the survivors (bounded retries), so nothing is lost.

Knows nothing about vLLM (actors do) or about S3 and row formats (pipelines do).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray

from actors.engine_actor import RemoteEngineActor
from actors.requests import error_result
from actors.spec_stats import SpecDecodeStats
from configs.plan import resource_plan
from configs.schema import AppConfig

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, cfg: AppConfig, num_actors: int | None = None, max_retries: int = 2):
        """Start the actors and wait until every engine is up. A crashed actor is
        restarted by Ray (`max_restarts`) and its in-flight calls re-run there
        (`max_task_retries`); past that the dispatcher moves them to other actors."""
        self.cfg = cfg
        self.plan = resource_plan(cfg)
        self.max_retries = max_retries
        n = num_actors or cfg.pool.min_actors
        if n < 1:
            raise ValueError(f"num_actors must be >= 1, got {n!r}")
        options = {
            **self.plan.ray_actor_options(),
            "max_restarts": max_retries,
            "max_task_retries": max_retries,
        }
        cfg_dict = cfg.model_dump(mode="json")
        self.actors = [RemoteEngineActor.options(**options).remote(cfg_dict) for _ in range(n)]
        # Fails fast (with the engine's own error) if an engine cannot start.
        self.infos = ray.get([a.info.remote() for a in self.actors])

    def generate(
        self,
        requests: Iterable[dict[str, Any]],
        on_result: Callable[[dict[str, Any]], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Yield one result per request, in completion order. Requests are consumed
        lazily, so an unbounded iterable streams in bounded memory."""
        window = self.cfg.pool.max_requests_in_flight
        pending = iter(requests)
        retry: deque[tuple[dict[str, Any], int]] = deque()
        in_flight: dict[ray.ObjectRef, tuple[int, dict[str, Any], int]] = {}
        load = [0] * len(self.actors)
        alive = [True] * len(self.actors)
        exhausted = False

        def next_request() -> tuple[dict[str, Any], int] | None:
            nonlocal exhausted
            if retry:
                return retry.popleft()
            if exhausted:
                return None
            try:
                return next(pending), 0
            except StopIteration:
                exhausted = True
                return None

        while True:
            while any(alive[i] and load[i] < window for i in range(len(self.actors))):
                item = next_request()
                if item is None:
                    break
                idx = min((i for i in range(len(self.actors)) if alive[i]), key=load.__getitem__)
                request, attempt = item
                ref = self.actors[idx].generate.remote(request)
                in_flight[ref] = (idx, request, attempt)
                load[idx] += 1
            if not in_flight:
                if not any(alive) and (retry or not exhausted):
                    raise RuntimeError("every engine actor in the pool has died")
                return
            done, _ = ray.wait(list(in_flight), num_returns=1)
            ref = done[0]
            idx, request, attempt = in_flight.pop(ref)
            load[idx] -= 1
            try:
                result = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                alive[idx] = False
                log.warning("engine actor %d died (%s); resubmitting its requests", idx, exc)
                if attempt + 1 > self.max_retries:
                    result = error_result(str(request.get("id")), "engine_error", repr(exc))
                else:
                    retry.append((request, attempt + 1))
                    continue
            if on_result is not None:
                on_result(result)
            yield result

    def stats(self) -> SpecDecodeStats:
        """Counters summed over the live actors."""
        total = SpecDecodeStats()
        for actor in self.actors:
            try:
                data = ray.get(actor.stats.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
            total = total.merge(SpecDecodeStats.from_dict(data))
        return total

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def run_requests(pool: EnginePool, requests: list[dict[str, Any]], progress_every_s: float = 10.0):
    """All results for a finite list, keyed by id, with a periodic progress line."""
    results: dict[str, dict[str, Any]] = {}
    started = last = time.monotonic()
    for result in pool.generate(requests):
        results[result["id"]] = result
        now = time.monotonic()
        if now - last >= progress_every_s:
            last = now
            log.info("%d/%d done in %.0fs", len(results), len(requests), now - started)
    return results
