"""The Ray Serve application: each replica is one engine actor with two doors.

Online door: HTTP, OpenAI-compatible. We reuse vLLM's own OpenAI layer (its FastAPI app
and serving classes: /v1/models, /v1/completions, /v1/chat/completions, streaming,
usage, OpenAI error bodies, /health, /metrics) bound to our `Engine`, instead of
`ray.serve.llm`, because that builds its own engine in a separate deployment: the batch
door below must reach the very engine that serves HTTP, with its own priority and
admission limit. We add only what is missing (`serving.middleware`: API key with an
OpenAI 401 body, request-size limit also for chunked bodies, a cap on n, OpenAI error
bodies for every /v1 error, replica header; `/ready`; per-replica metrics) and a request
that outlives its engine core's death (`serving.engine_retry`).

Batch door: `generate_batch(request)` through a Serve handle, at batch priority (online
requests keep vLLM's default priority 0, so the engine schedules them first). It admits
at most `serve.batch_share` of the replica's `max_ongoing_requests`; beyond that it
answers `busy` at once and the batch client backs off, so batch rows can never crowd
online requests out of the replica. While online requests are in flight, batch rows
beyond `serve.batch_rows_with_online` pause in the engine, keeping their tokens, and go
on when online traffic leaves (`serving.batch_gate`): priority orders the queue, but
every running batch row makes the step that serves an online request slower.

    serve run configs/serve/tiny.yaml        # or: make serve
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
from typing import Any

import ray
from ray import serve

from actors.engine import Engine
from actors.engine_lifecycle import ENGINE_DEATH_RETRIES
from actors.requests import PRIORITY_BATCH
from configs import AppConfig, EngineConfig, load_config
from control.plan import resolve
from serving.autoscale import autoscaling_config, autoscaling_stats
from serving.batch_gate import BatchGate
from serving.engine_retry import serve_across_deaths
from serving.metrics import ReplicaMetrics
from serving.middleware import Guards
from serving.restart_lease import ReplicaLease, min_healthy_during_restart

log = logging.getLogger(__name__)

METRICS_EVERY_S = 5.0


@serve.ingress()
class EngineReplica:
    def __init__(self, cfg: dict[str, Any], engine: dict[str, Any]):
        """`engine`: the replica's engine config as the app resolved it (`RunPlan.serve_engine`)."""
        self.cfg = AppConfig.model_validate(cfg)
        self.engine = Engine(EngineConfig.model_validate(engine), self.cfg.sampling, device=self.cfg.pool.device)
        self.lease = None
        controller = self.engine.controller
        context = serve.get_replica_context()
        if controller is not None and controller.replacement_enabled and context is not None:
            # Restarts without the drafter (and back) one replica at a time, while at least
            # pool.min_actors - 1 others serve (serving.restart_lease): a pool at its
            # minimum, a lone replica included, may still restart one.
            self.lease = ReplicaLease(context.app_name, context.replica_tag,
                                      min_healthy=min_healthy_during_restart(self.cfg.pool.min_actors))
            controller.lease = self.lease
        batch_limit = max(1, int(self.cfg.serve.max_ongoing_requests * self.cfg.serve.batch_share))
        self.batch_gate = BatchGate(batch_limit, self.cfg.serve.batch_rows_with_online)
        self.num_busy_answers = 0
        self.num_batch_rows = 0

    async def __serve_build_asgi_app__(self):
        app = await self.engine.openai_app(self.cfg.name)

        @app.get("/ready")
        async def ready() -> dict[str, Any]:
            await self.engine.check_health()
            control = self.engine.spec_control_state()
            return {"ready": True, "model": self.cfg.name, "replica_pid": os.getpid(),
                    "speculation": speculation_brief(self.cfg, control)}

        @app.get("/speculation")
        async def speculation() -> dict[str, Any]:
            """This replica's speculation controller in full: tables, reasons, recent
            changes and probes, capacity, advice, and its K / batch-size timeline."""
            return {"replica_pid": os.getpid(), **speculation_brief(self.cfg, None),
                    "controller": self.engine.spec_control_state()}

        asyncio.get_running_loop().create_task(self._export_metrics())
        api_key = os.environ.get(self.cfg.serve.api_key_env)
        return guarded(app, self.engine, self.cfg, api_key, on_generation=self.batch_gate.online_request)

    async def generate_batch(self, request: dict[str, Any]) -> dict[str, Any]:
        """One batch row. Returns the engine's result dict, or `{"busy": True}` when the
        batch share of this replica is full, or full for its online load (the caller
        retries later)."""
        slot = self.batch_gate.try_admit()
        if slot is None:
            self.num_busy_answers += 1
            return {"id": request.get("id"), "ok": False, "busy": True}
        try:
            await slot.turn()
            result = await self.engine.generate({**request, "priority": PRIORITY_BATCH}, pause=slot)
        finally:
            self.batch_gate.release(slot)
        result["replica_pid"] = os.getpid()
        # Cumulative counters ride along so the batch job's summary can total them.
        result["engine_stats"] = self.engine.stats_dict()
        self.num_batch_rows += 1
        return result

    async def restart_engine(self, speculating: bool) -> dict[str, Any]:
        """Operator action: restart this replica's engine with or without its drafter now
        (online requests in flight finish; new ones wait for the new engine). The
        speculation controller does the same on its own when it pays (control.replacement)."""
        seconds = await self.engine.restart_engine(speculating)
        return {"replica_pid": os.getpid(), "speculating": self.engine.speculating, "restart_s": round(seconds, 2)}

    def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats_dict(),
            "replica_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "batch_in_flight": self.batch_gate.num_rows,
            "batch_paused": self.batch_gate.num_paused,
            "batch_limit": self.batch_gate.max_rows,
            "online_in_flight": self.batch_gate.online_in_flight,
            "num_batch_pauses": self.batch_gate.num_pauses,
            "num_busy_answers": self.num_busy_answers,
            "num_batch_rows": self.num_batch_rows,
        }

    async def check_health(self) -> None:
        """Serve's periodic health check: a dead engine loop makes Serve replace us."""
        await self.engine.check_health()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's replica-metrics hook (when autoscaling): requests in the system and the
        capacity the speculation controller predicts, for `serving.autoscale.CapacityPolicy`.
        The engine's counts are as of its last step; batch rows admitted since are in the
        system too, hence the max (they are already among running + waiting otherwise)."""
        signals = self.engine.stats_dict().get("signals", {})
        engine_requests = signals.get("num_running_reqs", 0) + signals.get("num_waiting_reqs", 0)
        control_state = getattr(self.engine, "spec_control_state", None)
        state = control_state() if control_state is not None else None
        if inspect.isawaitable(state):
            state = await state
        capacity = state.get("capacity") if state else None
        return autoscaling_stats(max(engine_requests, self.batch_gate.num_rows), capacity)

    async def _export_metrics(self) -> None:
        context = serve.get_replica_context()
        metrics = ReplicaMetrics(context.replica_tag if context else str(os.getpid()))
        while True:
            try:
                metrics.update(self.engine.stats_dict(), self.batch_gate.num_rows)
                if self.lease is not None:
                    self.lease.heartbeat()
            except Exception:  # metrics must never take the replica down
                log.exception("metrics export failed")
            await asyncio.sleep(METRICS_EVERY_S)


def guarded(app, engine, cfg: AppConfig, api_key: str | None, on_generation=None) -> Guards:
    """vLLM's OpenAI `app` for `engine` behind the door's guards, as a replica serves it:
    key, limits and OpenAI error bodies, the admission gate, requests that outlive an
    engine-core death (`serving.engine_retry`)."""
    across_deaths = functools.partial(serve_across_deaths, engine=engine, retries=ENGINE_DEATH_RETRIES,
                                      wait_s=cfg.serve.engine_recovery_wait_s)
    return Guards(app, cfg.serve.max_request_bytes, api_key, admit=engine.admitted, max_choices=cfg.serve.max_n,
                  on_generation=on_generation, across_deaths=across_deaths)


def speculation_brief(cfg: AppConfig, control: dict[str, Any] | None) -> dict[str, Any]:
    """What a person checks first: method, K, and with a controller the K in force, the
    table on the engine and the decided one, why, and any advice."""
    out: dict[str, Any] = cfg.engine.spec.brief()
    if control:
        out.update({key: control.get(key) for key in ("engine", "k_in_force", "schedule", "table", "reason", "advice")})
    return out


def deployment_for(cfg: AppConfig) -> serve.Application:
    """The bound Serve application for a config: replicas = engine actors with the
    resource plan's resources, scaling between pool.min_actors and pool.max_actors on the
    capacity each replica predicts (serving.autoscale)."""
    run = resolve(cfg)
    plan = run.resources
    # Serve spreads replicas over the nodes by default; a replica's TP GPUs are its own.
    actor_options = plan.ray_actor_options()
    api_key = os.environ.get(cfg.serve.api_key_env)
    if api_key:  # replicas read the key from their own environment
        actor_options["runtime_env"] = {"env_vars": {cfg.serve.api_key_env: api_key}}
    if plan.min_actors == plan.max_actors:
        scaling: dict[str, Any] = {"num_replicas": plan.min_actors}
    else:  # on predicted capacity; the queue rule only while no replica reports one
        scaling = {"autoscaling_config": autoscaling_config(cfg.serve, plan.min_actors, plan.max_actors)}
    deployment = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        ray_actor_options=actor_options,
        max_ongoing_requests=cfg.serve.max_ongoing_requests,
        health_check_period_s=10,
        health_check_timeout_s=60,
        **scaling,
    )
    return deployment.bind(cfg.model_dump(mode="json"), run.serve_engine.model_dump(mode="json"))


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve config entry point (`import_path: serving.app:build_app`).
    args: {"config": NAME|FILE, "overrides": ["a.b=value", ...]}"""
    cfg = load_config(args.get("config", "tiny"), list(args.get("overrides", [])))
    return deployment_for(cfg)
