"""The speculation controller running inside one engine: measure, decide, apply, report.

`control.policy` decides (pure: signals in, a batch-size -> K table and a replica target
out); this module is the loop around it for one live engine. Every `interval_s` it turns
what the engine measured since the last interval (`actors.spec_stats.StepWindow`:
per-position drafts and accepted tokens, step times by batch size and K, scheduler load)
into `ReplicaSignals`, calls `decide`, and when the table for this engine changes (or a
probe starts or ends) puts the new one in force on the live engine with
`Engine.set_spec_schedule` (`actors.live_schedule`: between two steps, nothing dropped).

What it reports (`state()`): the K at the current batch size, the table, the reason of
the latest decision, the recent changes with their reasons, the capacity the replica
predicts at the latency target for the engine it runs (what the Serve autoscaler reads:
the decided table's, or after a restart without the drafter a plain engine's, K=0 at
every batch size), and, once drafting is off at every batch size, advice to run a replica
without speculation (a K=0 table does not remove the drafter's pass). Each change is logged.

Each engine runs its own controller: acceptance is learned per engine from its own
traffic, and no cross-actor round trip sits in the control path. Knows nothing about
Ray or Serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Protocol

import numpy as np

from configs.schema import EngineConfig, SpecControllerConfig
from configs.vllm_args import live_k_values
from control.calibration import calibration_file, load_calibration
from control.capacity import ReplicaCapacity, replica_capacity
from control.model import max_batch_size, plain_step_time_s
from control.policy import (BusySample, ControllerConfig, Decision, ReplicaSignals, StepTimeSample, decide, dense_from_schedule,
                            initial_state, schedule_from_table)
from control.replacement import (ReplacementConfig, ReplacementState, decide_replacement, load_times_per_token_s,
                                 other_engine_faster_at_load, times_per_token_s)


class LiveEngine(Protocol):
    """What the controller needs of the engine it runs in (`actors.engine.Engine`): its
    config, whether it drafts now, its step window and scheduler signals, and the two
    levers, a new batch-size -> K table between two steps and a restart with or without
    the drafter."""

    cfg: EngineConfig
    speculating: bool
    step_window: Any  # `actors.spec_stats.StepWindow`: drain() -> the interval's measurements
    signals: dict[str, Any]

    async def set_spec_schedule(self, schedule: list[list[int]]) -> dict[str, Any]: ...

    async def restart_engine(self, speculating: bool, drain_timeout_s: float = ...) -> float: ...


log = logging.getLogger(__name__)

RECENT_CHANGES = 20
# Predicted seconds a batch-size bucket needs before its own busy factor is used.
BUSY_EVIDENCE_S = 2.0
# The K / batch-size timeline (`state()["timeline"]`, plotted next to a job's summary) keeps
# at most this many points over the engine's whole life: when full, every other point goes
# and the spacing doubles, so a long job keeps its whole shape at a coarser step.
TIMELINE_POINTS = 240
# What an operator should know once drafting is off everywhere: off by table is not off.
OFF_ADVICE = ("this engine still runs the drafter's first forward pass on every K=0 step (vLLM keeps the "
              "draft KV cache in sync for when K rises again), so while the workload stays like this a "
              "replica started without speculation (engine.spec.method: none) serves it faster")


def controller_config(engine: EngineConfig, kv_capacity_tokens: int | None = None) -> ControllerConfig:
    """The policy's config for this engine: its K_max, batch limit and KV size, the
    calibrated step cost, and the settings from `engine.spec.controller`."""
    settings: SpecControllerConfig = engine.spec.controller
    cal = load_calibration(calibration_file(settings.calibration, "spec.controller.calibration"))
    k_max = engine.spec.num_speculative_tokens
    prior = list(settings.acceptance_prior or cal.acceptance_per_pos or [0.5])
    prior = (prior + [prior[-1]] * k_max)[:k_max]
    return ControllerConfig(
        cost=cal.cost,
        max_num_speculative_tokens=k_max,
        max_num_seqs=engine.max_num_seqs,
        kv_capacity_tokens=kv_capacity_tokens or cal.kv_capacity_tokens or 1 << 20,
        acceptance_prior=tuple(prior),
        target_tpot_s=settings.target_tpot_ms / 1000.0,
        switch_min_gain=settings.switch_min_gain,
        switch_dwell_intervals=settings.switch_dwell_intervals,
        probe_budget=settings.probe_budget,
        allowed_k=tuple(live_k_values(engine)),
    )


def startup_schedule(engine: EngineConfig) -> list[list[int]]:
    """The table an engine with a controller starts with: the configured `schedule`,
    else what the calibration and acceptance prior predict (the controller's own first
    table), so the first interval already runs a sensible K at every batch size."""
    if engine.spec.schedule is not None:
        return [list(r) for r in engine.spec.schedule]
    return _table_rows(initial_state(controller_config(engine)).k_by_batch)


def plain_engine_capacity(config: ControllerConfig, base_factor: float, plain_factor: float,
                          context_tokens_per_req: float) -> ReplicaCapacity:
    """What an engine started without the drafter serves at the latency target: K=0 at
    every batch size, each step the calibration's plain step (`plain_step_time_s`: no
    drafter pass) with the controller's base correction and the plain engine's own measured
    factor, as the restart rule predicts it; no draft slots reserved in the KV cache.
    The decided table's capacity (`Decision.capacity`) is the drafting engine's: a plain
    engine reporting it would size the pool on an engine that is not running."""
    n = config.max_num_seqs
    ctx = context_tokens_per_req
    step_s = np.array([[base_factor * plain_factor * plain_step_time_s(config.cost, b, b * ctx)]
                       for b in range(1, n + 1)])
    admitted = max_batch_size(config.kv_capacity_tokens, ctx, 0, n)
    return replica_capacity(step_s, [1.0], [0] * n, admitted, config.target_tpot_s)


def _table_rows(k_by_batch) -> list[list[int]]:
    """A dense batch-size -> K table as vLLM's [[lo, hi, K], ...] rows."""
    return [[int(v) for v in r] for r in schedule_from_table(k_by_batch)]


Window = dict[str, Any]  # what `actors.spec_stats.StepWindow.drain` returns


class LiveSpecController:
    """One engine's controller loop. Start with `ensure_running()` from the engine's
    event loop; `state()` is safe to call any time.

    `measure` gives the interval's measurements (default: drain the engine's step
    window) and `clock` the time in seconds (default: monotonic). Both are injectable so
    that a decision can be replayed from recorded or stated measurements: the same
    `step()` then decides the same way on any machine, however fast it runs."""

    def __init__(self, engine: LiveEngine, cfg: EngineConfig, kv_capacity_tokens: int | None, *,
                 measure: Callable[[], Window] | None = None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.measure = measure or engine.step_window.drain
        self.clock = clock
        self.interval_s = cfg.spec.controller.interval_s
        self.config = controller_config(cfg, kv_capacity_tokens)
        self.state_ = initial_state(self.config)
        self.replica_id = "self"
        self.in_force: list[list[int]] = startup_schedule(cfg)
        self.last: "Decision | None" = None
        self.reason = "start-up table from the calibration and the acceptance prior"
        self.num_changes = 0  # tables put on the engine: decided changes, probes and their ends
        # Decided changes and probes kept apart: where the choice is close, probes come
        # often and would push the decisions out of one short log.
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_CHANGES)
        self.recent_probes: deque[dict[str, Any]] = deque(maxlen=RECENT_CHANGES)
        self.num_probes = 0
        self.errors = 0
        self.started_at_s = clock()
        self.timeline: list[list[float]] = []  # [seconds since start, running requests, K in force]
        self.steps_by_k: dict[int, int] = {}  # every engine step with requests, by the K it ran
        self._timeline_stride = 1
        self._intervals_seen = 0
        self.all_off_since: float | None = None  # clock time the decided table went all K=0
        self._task: asyncio.Task | None = None
        # Drafting off by replacement (control.replacement): restart without the drafter, and back.
        r = cfg.spec.controller.replacement
        self.replacement_enabled = r.enabled
        self.replacement_config = ReplacementConfig(r.min_gain, r.dwell_intervals, r.cost_margin, r.cooldown_intervals)
        self.untried_margin = r.untried_margin
        self.replacement_state = ReplacementState(speculating=engine.speculating)
        self.replacement_reason: str | None = None
        self.restarts: deque[dict[str, Any]] = deque(maxlen=RECENT_CHANGES)
        self.switch_cost_s = float(getattr(engine, "startup_s", 0.0))  # measured at every (re)start
        self.plain_factor = 1.0  # plain engine's measured steps / predicted; 1 until measured
        self.recent_batch_sizes: deque[int] = deque(maxlen=r.dwell_intervals)  # the load lately
        self.restart_view: dict[str, Any] | None = None  # what the restart rule weighed last
        self._restarts_seen = getattr(engine, "num_restarts", 0)
        # Context per request as the engine last ran (for a plain engine's capacity).
        self.context_tokens_per_req = self.config.default_context_tokens_per_req
        self._plain_sums = [0.0, 0.0]  # measured, predicted seconds (decayed)
        # Time per output token as each engine ran (prefills and all) over the model's, by
        # batch-size bucket: {speculating: {bucket: [measured, predicted seconds]}} (decayed).
        self._busy_sums: dict[bool, dict[int, list[float]]] = {True: {}, False: {}}
        # Permission from the pool to restart (one host at a time, never below the healthy
        # minimum): an object with async acquire() -> bool and release(); None allows.
        self.lease = None

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed interval keeps the table in force; never kills serving
                self.errors += 1
                log.exception("speculation controller interval failed; keeping K table %s", self.in_force)

    async def step(self) -> None:
        """One interval: signals -> decision -> (maybe) a new table on the engine, and
        (maybe) a restart of the engine without its drafter or back with it."""
        if getattr(self.engine, "restarting", False):
            return  # an operator's restart is under way: no table to put in force meanwhile
        self._resync_after_restart()
        window = self.measure()
        for k, n in window.get("num_steps_by_k", {}).items():
            self.steps_by_k[int(k)] = self.steps_by_k.get(int(k), 0) + int(n)
        speculating = self.engine.speculating
        self._observe_busy(window, speculating)
        # Context per request as the engine ran (a plain engine's steps are dropped below).
        context_tokens_per_req = self.context_tokens_per_req = self._context_tokens_per_req(window)
        if not speculating:  # a plain engine: its steps say nothing of drafts or the drafter's cost
            self._observe_plain_steps(window)
            window = {**window, "drafts_per_pos": [], "accepted_per_pos": [], "steps": [], "busy": []}
        signals = self._signals(window)
        decided_before = self.state_.k_by_batch
        decision, self.state_ = decide([signals], self.state_, self.config)
        self.last = decision
        self.reason = decision.reason
        if any(decision.k_by_batch):
            self.all_off_since = None
        elif self.all_off_since is None:
            self.all_off_since = self.clock()
            log.warning("speculation controller: drafting off at every batch size; %s", OFF_ADVICE)
        now = {"at_s": round(self.clock(), 3), "interval": self.state_.interval, "reason": decision.reason}
        probing = decision.probe_replica == self.replica_id
        if decision.changed:  # logged as decided, even when a probe runs on top of it this interval
            self.recent.append({**now, "kind": "table", "from": _table_rows(decided_before),
                                "to": _table_rows(decision.k_by_batch)})
        if not speculating:  # nothing to put in force: the table waits for the drafter's return
            await self._consider_restart(signals, decision, context_tokens_per_req)
            self._record_timeline(signals.num_running_reqs)
            return
        self.num_probes += probing
        wanted = [[int(v) for v in r] for r in decision.schedules.get(self.replica_id, decision.schedule)]
        if wanted != self.in_force:
            applied = await self.engine.set_spec_schedule(wanted)
            old, self.in_force = self.in_force, [list(r) for r in applied["schedule"]]
            self.num_changes += 1
            if probing or not decision.changed:  # not decided: a probe, or the table back after one
                self.recent_probes.append({**now, "kind": "probe" if probing else "probe ended",
                                           "from": old, "to": self.in_force})
            log.info("K table %s -> %s: %s", old, self.in_force, decision.reason)
        await self._consider_restart(signals, decision, context_tokens_per_req)
        self._record_timeline(signals.num_running_reqs)

    def _resync_after_restart(self) -> None:
        """After a restart this controller did not make (an operator's), the engine runs
        its start-up table again (or none): take that as the table in force."""
        restarts = getattr(self.engine, "num_restarts", 0)
        if restarts != self._restarts_seen:
            self._restarts_seen = restarts
            self.replacement_state = replace(self.replacement_state, speculating=self.engine.speculating,
                                             wanted_intervals=0, intervals_since_switch=0)
            if self.engine.speculating:
                self.in_force = [list(r) for r in self.engine.cfg.spec.schedule]

    def _observe_plain_steps(self, window: Window) -> None:
        """The plain engine's step times against the model's prediction for them."""
        decay = 0.5 ** (sum(s["num_steps"] for s in window["steps"]) / self.config.step_time_halflife_steps)
        self._plain_sums = [v * decay for v in self._plain_sums]
        for s in window["steps"]:
            if s["num_speculative_tokens"] == 0 and 1 <= s["batch_size"] <= self.config.max_num_seqs:
                ctx = s["mean_context_tokens_per_req"] * s["batch_size"]
                predicted = self.state_.step_time_scale[0] * plain_step_time_s(self.config.cost, s["batch_size"], ctx)
                self._plain_sums[0] += s["num_steps"] * s["mean_step_time_s"]
                self._plain_sums[1] += s["num_steps"] * predicted
        if self._plain_sums[1] > 0:
            self.plain_factor = self._plain_sums[0] / self._plain_sums[1]

    def _observe_busy(self, window: Window, speculating: bool) -> None:
        """The engine's time per output token as it ran, every step back to back (prefills,
        steps where requests join and leave), against what the model predicts for the same
        tokens. The decode-step corrections (`step_time_scale`, `plain_factor`) leave out
        exactly what grows with speculation on a short-output load: the drafter's prefill
        and the steps around each request's start and end. This factor puts that back, for
        the engine that ran; the other engine's stays as last measured (1 until then: the
        calibration is believed until the engine has run)."""
        cells = [c for c in window.get("busy", ()) if c["output_tokens"] > 0 and 1 <= c["batch_size"] <= self.config.max_num_seqs
                 and c["num_speculative_tokens"] <= self.config.max_num_speculative_tokens]
        if not cells:
            return
        sums = self._busy_sums[speculating]
        decay = 0.5 ** (sum(c["num_steps"] for c in cells) / self.config.step_time_halflife_steps)
        for v in sums.values():
            v[0] *= decay
            v[1] *= decay
        ctx = self._context_tokens_per_req(window)
        for c in cells:
            b, k = c["batch_size"], c["num_speculative_tokens"]
            spec_s, plain_s = times_per_token_s(self.config.cost, self.state_.step_time_scale,
                                                self.state_.acceptance.acceptance_per_pos, b, k, ctx, self.plain_factor)
            cell = sums.setdefault(b.bit_length(), [0.0, 0.0])
            cell[0] += c["seconds"]
            cell[1] += c["output_tokens"] * (spec_s if speculating else plain_s)

    def busy_factor(self, speculating: bool, batch_size: int | None = None) -> float:
        """Measured over predicted time per output token of that engine: at this batch
        size's bucket (1, 2-3, 4-7, ...) once it has `BUSY_EVIDENCE_S` of predicted time
        there, else over every batch size it ran at; 1 where it has not run."""
        cell = self._busy_sums[speculating].get(batch_size.bit_length()) if batch_size else None
        if cell is None or cell[1] < BUSY_EVIDENCE_S:
            cell = self._busy_total(speculating)
        return cell[0] / cell[1] if cell[1] > 0 else 1.0

    def has_run(self, speculating: bool) -> bool:
        """Whether that engine (with or without the drafter) has run long enough here for
        its measured time per token to count (`BUSY_EVIDENCE_S` of predicted time)."""
        return self._busy_total(speculating)[1] >= BUSY_EVIDENCE_S

    def _busy_total(self, speculating: bool) -> list[float]:
        """[measured, predicted] seconds of that engine over every batch-size bucket."""
        sums = self._busy_sums[speculating].values()
        return [sum(v[0] for v in sums), sum(v[1] for v in sums)]

    def _context_tokens_per_req(self, window: Window) -> float:
        ctx = [s["mean_context_tokens_per_req"] for s in window["steps"] if s["mean_context_tokens_per_req"]]
        return sum(ctx) / len(ctx) if ctx else self.config.default_context_tokens_per_req

    async def _consider_restart(self, signals, decision, ctx: float) -> None:
        """Restart the engine without its drafter (or back) when control.replacement says so."""
        if not self.replacement_enabled or self.engine.cfg.spec.method == "none":
            return
        b = min(max(signals.num_running_reqs, 1), self.config.max_num_seqs)
        self.recent_batch_sizes.append(b)
        speculating = self.engine.speculating
        # The other engine, if it has never run here, is believed `untried_margin` faster than
        # its calibration says: it gets tried once the load holds, then its measured time counts.
        untried = 1.0 - self.untried_margin if not self.has_run(not speculating) else 1.0
        spec_benefit, plain_benefit = (1.0, untried) if speculating else (untried, 1.0)

        def times(batch_size: int) -> tuple[int, float, float]:  # (K decided there, speculating, plain) s/token
            k = int(decision.k_by_batch[batch_size - 1])
            spec_s, plain_s = times_per_token_s(self.config.cost, self.state_.step_time_scale,
                                                self.state_.acceptance.acceptance_per_pos, batch_size, k, ctx,
                                                self.plain_factor)
            return (k, spec_s * self.busy_factor(True, batch_size) * spec_benefit,
                    plain_s * self.busy_factor(False, batch_size) * plain_benefit)

        at_load = {size: times(size) for size in sorted(set(self.recent_batch_sizes))}
        samples = [at_load[size] for size in self.recent_batch_sizes]  # the load lately, one per interval
        spec_s, plain_s = load_times_per_token_s(samples)
        self.restart_view = {"step_time_scale": [round(float(v), 3) for v in self.state_.step_time_scale],
                             "by_batch_size": {size: {"k": k, "speculating_tokens_per_s": round(1 / spec, 1),
                                                      "plain_tokens_per_s": round(1 / plain, 1)}
                                               for size, (k, spec, plain) in at_load.items()},
                             "load": {"speculating_tokens_per_s": round(1 / spec_s, 1),
                                      "plain_tokens_per_s": round(1 / plain_s, 1)},
                             "untried_benefit": round(untried, 3)}
        before = self.replacement_state
        verdict, after = decide_replacement(
            before, self.replacement_config, interval_s=self.interval_s,
            other_faster_at_load=other_engine_faster_at_load(speculating, samples),
            time_per_token_now_s=spec_s if speculating else plain_s,
            time_per_token_other_s=plain_s if speculating else spec_s,
            switch_cost_s=self.switch_cost_s)
        self.replacement_reason = verdict.reason
        if not verdict.switch:
            self.replacement_state = after
            return
        if self.lease is not None and not await self.lease.acquire():
            self.replacement_reason = (f"restart waits for the pool ({getattr(self.lease, 'last_answer', '')}): "
                                       f"{verdict.reason}")
            self.replacement_state = replace(after, speculating=before.speculating,
                                             wanted_intervals=before.wanted_intervals + 1,
                                             intervals_since_switch=before.intervals_since_switch + 1)
            return
        try:
            log.warning("speculation controller: %s", verdict.reason)
            seconds = await self.engine.restart_engine(verdict.speculating)
        finally:
            if self.lease is not None:
                await self.lease.release()
        self.switch_cost_s = seconds
        self.replacement_state = after
        self._restarts_seen = getattr(self.engine, "num_restarts", self._restarts_seen + 1)
        if verdict.speculating:  # the drafter is back, with the table it starts with
            self.in_force = [list(r) for r in self.engine.cfg.spec.schedule]
        self.restarts.append({"at_s": round(self.clock(), 3), "interval": self.state_.interval,
                              "kind": "restart", "speculating": verdict.speculating,
                              "restart_s": round(seconds, 2), "reason": verdict.reason})

    def _record_timeline(self, num_running: int) -> None:
        self._intervals_seen += 1
        if (self._intervals_seen - 1) % self._timeline_stride:
            return
        b = min(max(num_running, 1), self.config.max_num_seqs)
        self.timeline.append([round(self.clock() - self.started_at_s, 3), num_running, self._k_at(b),
                              int(self.engine.speculating)])
        if len(self.timeline) >= TIMELINE_POINTS:
            self.timeline = self.timeline[::2]
            self._timeline_stride *= 2

    def _k_at(self, batch_size: int) -> int:
        """The K the table in force runs at this batch size (0 on a plain engine)."""
        if not self.engine.speculating:
            return 0
        dense = dense_from_schedule(self.in_force, self.config.max_num_seqs, self.config.max_num_speculative_tokens)
        return int(dense[batch_size - 1])

    def _signals(self, window: dict[str, Any]):
        sig = self.engine.signals
        samples = tuple(
            StepTimeSample(s["batch_size"], s["num_speculative_tokens"], s["num_steps"], s["mean_step_time_s"],
                           s["mean_prefill_tokens"], s["mean_context_tokens_per_req"])
            for s in window["steps"] if s["batch_size"] <= self.config.max_num_seqs
            and s["num_speculative_tokens"] <= self.config.max_num_speculative_tokens)
        running = int(sig.get("num_running_reqs", 0))
        ctx = [s.mean_context_tokens_per_req for s in samples if s.mean_context_tokens_per_req]
        return ReplicaSignals(
            replica_id=self.replica_id,
            num_running_reqs=running,
            num_waiting_reqs=int(sig.get("num_waiting_reqs", 0)),
            kv_cache_usage=float(sig.get("kv_cache_usage", 0.0)),
            num_drafts_per_pos=tuple(window["drafts_per_pos"]),
            num_accepted_per_pos=tuple(window["accepted_per_pos"]),
            step_samples=samples,
            mean_context_tokens_per_req=sum(ctx) / len(ctx) if ctx else 0.0,
            busy_samples=tuple(BusySample(c["batch_size"], c["num_speculative_tokens"], c["num_steps"], c["seconds"],
                                          c["output_tokens"]) for c in window.get("busy", ())),
        )

    def _steps_by_k_so_far(self) -> dict[int, int]:
        """The steps of the intervals read and of the window not read yet: a job shorter
        than one interval has run steps no interval has seen."""
        unread = getattr(getattr(self.engine, "step_window", None), "num_steps_by_k", {})
        keys = sorted({*self.steps_by_k, *unread})
        return {k: self.steps_by_k.get(k, 0) + unread.get(k, 0) for k in keys}

    def state(self) -> dict[str, Any]:
        sig = self.engine.signals
        running = int(sig.get("num_running_reqs", 0))
        b = min(max(running, 1), self.config.max_num_seqs)
        speculating = self.engine.speculating
        out: dict[str, Any] = {
            "engine": "speculating" if speculating else "plain",  # plain: restarted without its drafter
            "k_in_force": self._k_at(b),
            # On the engine now: the table, or a probe for one interval; None on a plain engine.
            "schedule": self.in_force if speculating else None,
            "table": _table_rows(self.state_.k_by_batch),
            "reason": self.reason,
            "changes": self.num_changes,
            "interval": self.state_.interval,
            "recent_changes": list(self.recent),  # decided changes, newest last
            "probes": self.num_probes,  # intervals that ran a probe
            "recent_probes": list(self.recent_probes),
            "interval_errors": self.errors,
            "num_running_reqs": running,
            "num_waiting_reqs": int(sig.get("num_waiting_reqs", 0)),
            "acceptance_per_pos": [round(float(p), 4) for p in self.state_.acceptance.acceptance_per_pos],
            "capacity": None,
            "advice": None,
            "timeline": [list(p) for p in self.timeline],  # [s, running requests, K in force, speculating]
            "steps_by_k": self._steps_by_k_so_far(),  # engine steps run at each K, so far
            "replacement": self.replacement_reason if self.replacement_enabled else "disabled",
            "restarts": getattr(self.engine, "num_restarts", len(self.restarts)),
            "recent_restarts": list(self.restarts),
            "switch_cost_s": round(self.switch_cost_s, 2),
            "plain_step_factor": round(self.plain_factor, 3),
            # Measured over predicted time per output token, each engine as it last ran.
            "busy_factor": {"speculating": round(self.busy_factor(True), 3), "plain": round(self.busy_factor(False), 3)},
            # Time per output token outside the decode steps, by batch-size bucket and K, where
            # measured: what the choice of K charges on top of the decode steps.
            "join_cost_ms_per_token": {
                f"B{1 if j == 0 else (1 << (j - 1)) + 1}-{min(1 << j, self.config.max_num_seqs)}":
                    {k: round(float(1e3 * extra / tokens), 3) for k, (_, extra, tokens) in enumerate(row)
                     if tokens >= self.config.join_cost_min_tokens}
                for j, row in enumerate(self.state_.join_cost_sums)
                if any(tokens >= self.config.join_cost_min_tokens for _, _, tokens in row)},
            # What the restart rule last weighed: predicted tokens/s of each engine at the
            # batch sizes the load ran at lately, and the step-time corrections behind them.
            "restart_view": self.restart_view,
        }
        if self.all_off_since is not None and speculating:
            out["advice"] = (f"drafting has been off at every batch size for "
                             f"{self.clock() - self.all_off_since:.0f} s: {OFF_ADVICE}")
        if self.last is not None:  # None until the first interval has measured something
            # The engine running now: the decided table is the drafting engine's, and stays
            # so while the engine is plain (it waits for the drafter's return).
            cap = self.last.capacity if speculating else self.plain_capacity()
            out["capacity"] = {"batch_size": int(cap.batch_size), "num_speculative_tokens": int(cap.num_speculative_tokens),
                               "tokens_per_s": round(float(cap.tokens_per_s), 2), "tpot_s": float(cap.tpot_s),
                               "meets_target": bool(cap.meets_target)}
            # A plain engine runs no probe table (nothing is put in force on it).
            out["probe"] = (int(self.last.probe_num_speculative_tokens) or None) if speculating else None
        return out

    def plain_capacity(self) -> ReplicaCapacity:
        """This engine's capacity at the latency target if it runs without the drafter."""
        return plain_engine_capacity(self.config, self.state_.step_time_scale[0], self.plain_factor,
                                     self.context_tokens_per_req)

