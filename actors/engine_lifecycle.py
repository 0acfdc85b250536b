"""An engine's life after start-up: the admission gate, restarts on request (with or
without the drafter), and recovery when vLLM's engine core dies.

vLLM's `AsyncLLM` runs its `EngineCore` in a child process. When that process dies (on
GPUs a CUDA error or the OOM killer; here, a kill, or an input that trips a defect in the
engine), every request in flight fails with `EngineDeadError` and the engine never serves
again, while the process that holds it (a Ray actor, a Serve replica) lives on: Ray would
restart neither, and every later row would fail. So the host rebuilds its engine in
place: a watchdog notices the death within `WATCHDOG_INTERVAL_S` (or a failing request
does, first), new requests wait at the admission gate, the dead engine is shut down and a
new one started with the same configuration (same drafter state).

No request may take the engine down for the others (poison-request isolation): each
request that was in flight at a death runs again on the new engine, but one at a time
(`quarantined()`), so that if one of them kills the engine again it is the only
suspect there. A request present at `ENGINE_DEATH_RETRIES + 1` deaths in a row is failed
alone (batch: an `engine_died` error row; online: a 500 whose error id is in the log, see
`serving.engine_retry`), and the others go on. A request that arrives while the engine is
dead waits for the rebuild instead of failing. A rebuild that fails leaves the engine
dead: health checks then fail, so Serve replaces the replica, and batch rows end as
errors with the reason.

The two kinds of restart share one path (`_rebuild`): stop the old engine off the event
loop, start the new one off it (on a CPU while the old core tears down; on a GPU after,
so the new one finds the memory free), re-bind the OpenAI layer, count the restart (the
speculation controller re-syncs its table on that count). Knows nothing about Ray.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import time
import weakref
from typing import Any, Awaitable, Callable

from configs.vllm_args import to_vllm_kwargs

log = logging.getLogger(__name__)

ENGINE_DEATH_RETRIES = 1  # a request runs at most 1 + this many times when engines die under it
WATCHDOG_INTERVAL_S = 1.0


def is_engine_death(exc: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


class EngineLifecycle:
    """Mixed into `actors.engine.Engine`, which provides `_llm`, `cfg`, `device`,
    `speculating`, `_start_llm(kwargs)`, `_openai` and `step_window`."""

    def _init_lifecycle(self) -> None:
        self._admitted = asyncio.Event()  # cleared while the engine restarts
        self._admitted.set()
        self.num_active = 0  # requests inside the engine now (generate, score, online)
        self.num_restarts = 0  # every rebuild: asked for, or after a death
        self.num_engine_deaths = 0
        self.num_requests_rerun = 0  # tries repeated because the engine died under them
        self.num_requests_failed_alone = 0  # present at every death of their tries: failed, the others went on
        self.engine_generation = 0  # +1 per rebuild: tells a request which engine it ran on
        self._recovery: asyncio.Task | None = None
        self._rebuilding = asyncio.Lock()  # one rebuild at a time (a death during a restart)
        self._quarantine = asyncio.Lock()  # requests that were in flight at a death run again one at a time
        self._watchdog: asyncio.Task | None = None
        self.dead_reason: str | None = None  # set when a rebuild after a death failed
        self.closed = False  # set by shutdown(): never rebuild an engine stopped on purpose
        self._stops_at_exit = False

    def _stop_at_exit(self) -> None:
        """Call once the first vLLM engine is built. At the end of a process that never
        called `shutdown()` (a script, a test) vLLM's own exit hooks stop the engine core;
        its output handler then logs that as a failure. Stopped here first, on purpose, it
        does not (exit hooks run last-registered first). A retired Ray actor is different:
        Ray kills its child processes, the engine core included, before any exit hook."""
        if not self._stops_at_exit:
            self._stops_at_exit = True
            atexit.register(_shutdown_if_alive, weakref.ref(self))

    # -- admission ---------------------------------------------------------------------

    @property
    def restarting(self) -> bool:
        return not self._admitted.is_set()

    @contextlib.asynccontextmanager
    async def admitted(self):
        """Every request runs inside this: it waits while the engine restarts, and a
        restart asked for waits until the requests inside have finished."""
        await self._admitted.wait()
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1

    @contextlib.asynccontextmanager
    async def stepped_out(self):
        """A request inside `admitted()` that holds nothing in the engine for a while (a
        batch row paused for online traffic keeps its tokens on our side) is not counted
        by a restart's drain meanwhile: online requests waiting at the closed gate keep
        such a row paused, so a drain that counted it would wait for its timeout. The row
        counts again once the engine admits (after the restart, on the new engine)."""
        self.num_active -= 1
        try:
            yield
        finally:
            try:
                await self._admitted.wait()
            finally:
                self.num_active += 1

    # -- restarts ----------------------------------------------------------------------

    async def restart_engine(self, speculating: bool, drain_timeout_s: float = 600.0) -> float:
        """Replace vLLM's engine by one with (`speculating`) or without its drafter: new
        requests wait, the requests inside finish, the old engine stops, the new one
        starts, waiting requests go on. Returns the restart's seconds (its measured cost).
        No request is dropped or sees the change; the statistics carry on."""
        if speculating and self.cfg.spec.method == "none":
            raise ValueError("engine was configured with spec.method='none': nothing to restart with")
        self._admitted.clear()
        try:
            started = time.monotonic()
            while self.num_active:  # bounded: every request has max_tokens
                if time.monotonic() - started > drain_timeout_s:
                    raise TimeoutError(f"{self.num_active} requests still running after {drain_timeout_s:.0f} s; "
                                       "engine not restarted")
                await asyncio.sleep(0.02)
            await self._rebuild(speculating)
            seconds = time.monotonic() - started
            log.warning("engine restarted %s speculation in %.1fs", "with" if speculating else "without", seconds)
            return seconds
        finally:
            self._admitted.set()

    async def _rebuild(self, speculating: bool, if_generation: int | None = None) -> None:
        """Stop the engine, start a new one. With `if_generation`, only if no rebuild has
        happened since that engine (a recovery that a restart already made moot)."""
        async with self._rebuilding:
            if if_generation is None or if_generation == self.engine_generation:
                await self._rebuild_now(speculating)

    async def _rebuild_now(self, speculating: bool) -> None:
        # Both off the event loop: stopping and starting an engine take seconds, and the
        # loop keeps answering health checks and holding the waiting requests meanwhile.
        # The old engine has no request left (drained, or dead). On a GPU its memory must be
        # free before the new engine sizes its KV cache, so it stops first; on a CPU the
        # new engine starts while the old core tears down (~3 s of a ~10 s restart here).
        stopping = asyncio.create_task(asyncio.to_thread(_stop_quietly, self._llm))
        if self.device != "cpu":
            await stopping
        try:
            await asyncio.to_thread(self._start_llm, engine_kwargs(self.cfg, speculating))
        finally:
            await stopping
        self.speculating = speculating
        self.num_restarts += 1
        self.engine_generation += 1
        self.step_window.skip_next_gap()
        if self._openai is not None:  # the OpenAI layer serves the new engine from now on
            from vllm.entrypoints.launchers.api_server.app_state import init_app_state

            app, args, tasks = self._openai
            await init_app_state(self._llm, app.state, args, tasks)
            keep_serving(app)

    # -- death and recovery ------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Notices a dead engine core even when no request of ours is running (online
        traffic goes through vLLM's OpenAI layer, which cannot revive it)."""
        while not self.closed:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if not self.closed and self.dead_reason is None and not self.restarting and self._llm.errored:
                await self.recover(self.engine_generation)

    async def recover(self, generation: int) -> bool:
        """Rebuild the engine after its core died under a request that ran on engine
        `generation`. One rebuild however many requests saw the death; a request from an
        engine already replaced just runs again. True when an engine serves again."""
        if self.closed:
            return False
        if generation != self.engine_generation and self._recovery is None:
            return self.dead_reason is None
        if self._recovery is None:
            self._recovery = asyncio.get_running_loop().create_task(self._recover(generation))
        try:
            await asyncio.shield(self._recovery)
        except Exception:
            pass  # logged by _recover; dead_reason says why
        return self.dead_reason is None

    async def _recover(self, generation: int) -> None:
        self._admitted.clear()
        self.num_engine_deaths += 1
        started = time.monotonic()
        log.error("the engine core died (death %d); rebuilding the engine", self.num_engine_deaths)
        try:
            await self._rebuild(self.speculating, if_generation=generation)
            log.warning("engine rebuilt after its core died, in %.1fs", time.monotonic() - started)
        except Exception as exc:
            self.dead_reason = f"engine core died and the rebuild failed: {type(exc).__name__}: {exc}"
            log.exception("rebuilding the engine failed; this host stays unhealthy")
            raise
        finally:
            self._recovery = None
            self._admitted.set()

    def died_since(self, generation: int) -> bool:
        """Has the engine that served `generation` died (or been replaced) since?"""
        return generation != self.engine_generation or self.dead_reason is not None or self._llm.errored

    @contextlib.asynccontextmanager
    async def quarantined(self):
        """A request that was in flight at a death runs again inside this: alone among such
        requests, so a second death points at it and at nothing else of theirs."""
        async with self._quarantine:
            yield

    async def wait_until_serving(self) -> bool:
        """A request about to start on an engine that has died but is not yet being rebuilt
        waits for the rebuild (it was not in flight at the death: no strike against it).
        True when an engine serves."""
        if self.dead_reason is None and not self.closed and not self.restarting and self._llm.errored:
            return await self.recover(self.engine_generation)
        return self.dead_reason is None

    async def run_with_recovery(self, request_id: str, attempt: Callable[[], Awaitable[dict[str, Any]]],
                                error_result: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """Run `attempt` (one request on the current engine) inside the admission gate;
        when the engine core dies under it, rebuild and run it again, at most
        ENGINE_DEATH_RETRIES more times. `attempt` raises what the engine raised."""
        self._ensure_watchdog()
        for tries in range(1, ENGINE_DEATH_RETRIES + 2):
            async with self.quarantined() if tries > 1 else contextlib.nullcontext():
                await self.wait_until_serving()
                if self.dead_reason is not None:
                    return error_result(request_id, "engine_dead", self.dead_reason)
                if self.closed:
                    return error_result(request_id, "engine_closed", "the engine was shut down")
                async with self.admitted():
                    generation = self.engine_generation
                    try:
                        return await attempt()
                    except Exception as exc:
                        if not (is_engine_death(exc) or self._llm.errored):
                            log.warning("request %s failed in the engine: %r", request_id, exc)
                            return error_result(request_id, "engine_error", f"{type(exc).__name__}: {exc}")
            log.warning("request %s: the engine core died under it (try %d of %d)", request_id, tries,
                        ENGINE_DEATH_RETRIES + 1)
            await self.recover(generation)
            self.num_requests_rerun += 1
        self.num_requests_failed_alone += 1
        log.error("request %s was in flight at %d engine-core deaths in a row (the last with no other "
                  "suspect beside it); failed alone, not retried again", request_id, ENGINE_DEATH_RETRIES + 1)
        return error_result(request_id, "engine_died", f"the engine core died under this request "
                            f"{ENGINE_DEATH_RETRIES + 1} times in a row (it was rebuilt each time, and the "
                            "last time this request ran alone among the suspects); not retried again")

    async def check_health(self) -> None:
        """Raises if the engine is dead and could not be rebuilt. A restart or rebuild in
        progress is healthy (bounded, and requests wait for it)."""
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        if self.restarting or self.closed:
            return
        if self._llm.errored:  # rebuild now (if the watchdog has not yet): healthy meanwhile
            if self._recovery is None:
                self._recovery = asyncio.get_running_loop().create_task(self._recover(self.engine_generation))
            return
        await self._llm.check_health()


def engine_kwargs(cfg, speculating: bool) -> dict:
    """vLLM's engine arguments for `cfg` with its drafter, or without (speculation off)."""
    return to_vllm_kwargs(cfg if speculating else cfg.without_speculation())


def _shutdown_if_alive(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None and not engine.closed:
        try:
            engine.shutdown()
        except Exception:  # the process is going away; vLLM's own hooks still stop the core
            log.warning("stopping the engine at exit failed", exc_info=True)


def _stop_quietly(llm) -> None:
    try:
        stop_engine(llm)
    except Exception:  # a dead engine may fail to stop cleanly; its process is gone anyway
        log.warning("stopping the old engine failed", exc_info=True)


def stop_engine(llm, wait_s: float = 5.0) -> None:
    """Stop a vLLM engine; when it has no request left, without the error log vLLM's own
    shutdown causes: it stops the engine core first, its output handler then reads the
    core's exit as a failure ("AsyncLLM output_handler failed ... EngineDeadError") before
    vLLM cancels it. Cancelled first (and waited for, when the caller is on another thread
    than the engine's loop), the handler ends quietly. With requests still inside, vLLM's
    order stays: the handler's failure is what wakes them with an error."""
    handler = getattr(llm, "output_handler", None)
    if handler is not None and not handler.done() and llm.get_num_unfinished_requests() == 0:
        _cancel_and_wait(handler, wait_s)
    llm.shutdown()


def _cancel_and_wait(task: asyncio.Task, wait_s: float) -> None:
    loop = task.get_loop()
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop or not loop.is_running():
        task.cancel()  # delivered before the task runs again, so before it sees the core stop
        return

    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    try:
        asyncio.run_coroutine_threadsafe(cancel(), loop).result(wait_s)
    except Exception:  # loop stuck or closing: shut down anyway (at worst vLLM logs its error)
        log.warning("engine output handler did not stop within %.0fs; shutting the engine down anyway", wait_s)


def keep_serving(app) -> None:
    """vLLM's OpenAI error handler stops its own HTTP server when the engine dies
    (`app.state.server.should_exit = True`); ours is Ray Serve's, and the engine is
    rebuilt in place, so it gets a server object whose flag nobody reads."""
    class _NoServer:
        should_exit = False

    app.state.server = _NoServer()
