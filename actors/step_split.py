"""Where an engine step's time goes: the target's forward pass, drafting, everything else.

vLLM 0.32 counts steps, drafts and accepted tokens, but times no phase of a step outside
torch's profiler, whose traces are heavy (a trace file per run, overhead on every op) and
give no per-batch-size sums. The speculation controller and `tools.profile_steps` need three
sums per decode step: the target model (forward + logits), the drafter (its whole
`propose_draft_token_ids`: input preparation, forward passes, sampling of drafts) and the
rest (scheduling, input preparation, sampling, rejection sampling, output bookkeeping).
That split is what tells a better head (draft time) from cheaper bookkeeping (other).

So this module adds an engine-core utility method (`peagle_step_split`, installed by the
same vLLM general plugin as `actors.live_schedule`). `"start"` wraps, on this engine only:
the core's `_process_engine_step` (one step: schedule, execute, update), the scheduler's
`schedule` (to see the step's shape), and the model runner's `_model_forward`,
`model.compute_logits` and `propose_draft_token_ids` (instance attributes; the classes
are untouched). Each step then adds its seconds to the sums of its batch size, when it is
a pure decode step (every request scheduled 1 + its draft tokens; prefill and mixed steps
are left out, as in the step-time calibration). `"read"` returns the sums, `"stop"` removes
the wrappers. Timing costs a few `perf_counter` calls per step; on CUDA each phase also
synchronizes the device, so the split is for profiling runs, never left on in serving.

Limits: the worker must live in the engine-core process (one worker: tensor, pipeline
and data parallel size 1), and steps must not overlap (no batch queue, i.e. no async
scheduling), or a phase's time could not be given to one step. Other engines are refused
with the reason.
"""

from __future__ import annotations

import time
from typing import Any, Callable

METHOD = "peagle_step_split"
PHASES = ("target", "draft")


class _Clock:
    """Seconds per phase, for the step being run."""

    def __init__(self, sync: Callable[[], None] | None):
        self.sync = sync
        self.phase_s = dict.fromkeys(PHASES, 0.0)

    def timed(self, phase: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if self.sync:
                self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    self.sync()
                self.phase_s[phase] += time.perf_counter() - start
        return wrapper

    def take(self) -> dict[str, float]:
        out, self.phase_s = self.phase_s, dict.fromkeys(PHASES, 0.0)
        return out


def is_decode_step(num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]) -> bool:
    """Every request runs one new token plus its drafts: no prompt is being prefilled."""
    return bool(num_scheduled_tokens) and all(
        n == 1 + len(spec_tokens.get(req_id, ())) for req_id, n in num_scheduled_tokens.items())


def add_step(sums: dict[int, dict[str, float]], batch_size: int, step_s: float,
             phase_s: dict[str, float]) -> None:
    """Add one decode step of `batch_size` requests to the per-batch-size sums."""
    cell = sums.setdefault(batch_size, {"steps": 0, "step_s": 0.0, **dict.fromkeys(PHASES, 0.0)})
    cell["steps"] += 1
    cell["step_s"] += step_s
    for phase, s in phase_s.items():
        cell[phase] += s


def per_step(sums: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Mean seconds per step of each phase, and `other` = the step minus target and draft."""
    out = {}
    for b, cell in sorted(sums.items()):
        n = cell["steps"]
        if not n:
            continue
        mean = {phase: cell[phase] / n for phase in PHASES}
        step_s = cell["step_s"] / n
        out[b] = {"steps": n, "step_s": step_s, **mean, "other": max(0.0, step_s - sum(mean.values()))}
    return out


def _runner(core: Any) -> Any:
    executor = core.model_executor
    worker = getattr(executor, "driver_worker", None)
    if worker is None or len(getattr(executor, "workers", None) or [worker]) != 1:
        raise ValueError("the step split needs the engine's only worker in the engine-core process "
                         f"({type(executor).__name__} runs workers elsewhere; use tensor/pipeline/data parallel 1)")
    if core.batch_queue is not None:
        raise ValueError("the step split needs steps that do not overlap: start the engine with "
                         "async_scheduling off (no batch queue)")
    return getattr(worker, "worker", worker).model_runner


def _sync_for(runner: Any) -> Callable[[], None] | None:
    device = getattr(runner, "device", None)
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.synchronize
    return None


def _start(core: Any) -> None:
    runner = _runner(core)
    if getattr(core, "_peagle_split", None) is not None:
        core._peagle_split["sums"].clear()
        return
    clock = _Clock(_sync_for(runner))
    state: dict[str, Any] = {"sums": {}, "last": None, "wrapped": []}
    sched = core.scheduler

    def wrap(obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        setattr(obj, name, make(getattr(obj, name)))
        state["wrapped"].append((obj, name))

    def schedule(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            state["last"] = out
            return out
        return wrapper

    def step(fn):
        def wrapper(*args, **kwargs):
            state["last"] = None
            clock.take()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            step_s = time.perf_counter() - start
            phase_s, so = clock.take(), state["last"]
            if so is not None and is_decode_step(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens):
                add_step(state["sums"], len(so.num_scheduled_tokens), step_s, phase_s)
            return result
        return wrapper

    wrap(sched, "schedule", schedule)
    wrap(core, "_process_engine_step", step)
    wrap(runner, "_model_forward", lambda fn: clock.timed("target", fn))
    wrap(runner.model, "compute_logits", lambda fn: clock.timed("target", fn))
    if getattr(runner, "speculative_config", None) is not None:
        wrap(runner, "propose_draft_token_ids", lambda fn: clock.timed("draft", fn))
    core._peagle_split = state


def _stop(core: Any) -> None:
    state = getattr(core, "_peagle_split", None)
    if state is None:
        return
    for obj, name in reversed(state["wrapped"]):
        try:
            delattr(obj, name)  # the class's own method shows through again
        except AttributeError:
            pass
    core._peagle_split = None


def _step_split(core: Any, action: str = "read") -> dict[str, Any]:
    """Engine-core utility: action "start" (install or reset), "read" or "stop".
    Returns {"active": bool, "per_batch_size": {B: {steps, step_s, target, draft, other}}}
    with seconds per decode step."""
    if action == "start":
        _start(core)
    elif action == "stop":
        _stop(core)
    elif action != "read":
        raise ValueError(f"step split action must be 'start', 'read' or 'stop', got {action!r}")
    state = getattr(core, "_peagle_split", None)
    sums = state["sums"] if state is not None else {}
    return {"active": state is not None, "per_batch_size": {str(b): v for b, v in per_step(sums).items()}}


def install() -> None:
    """vLLM general-plugin entry point (with `actors.live_schedule.install`)."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, METHOD, None) is None:
        setattr(EngineCore, METHOD, _step_split)
