"""The speculation controller on a live engine: it learns acceptance from the engine's own
counters, changes K on the running engine, and the engine then runs the K it was given.

Synthetic acceptance (vLLM's `rejection_sample_method: synthetic`, on CPU through our
plugin) makes the workload's acceptance a known number. The controller is told to expect
high acceptance (its prior), so it starts drafting at every batch size; the drafts are
then almost never accepted, and the controller must find that out and turn drafting off.

What is real: the engine, its drafts, its acceptance counters, the batch sizes and K of
its steps, and the table change on the engine core. What is stated: each step's time,
which the controller reads as the calibration predicts it (not as this shared machine
happens to run it), so the decision is the same on any machine. The test drives the
controller's intervals itself, between rounds of traffic. Decisions from many stated
measurements: tests/unit/test_live_controller.py.
"""

import asyncio

import pytest

from configs import load_config
from control.calibration import load_calibration
from control.live import LiveSpecController

pytestmark = pytest.mark.integration

OFF = [[1, 16, 0]]
CONTROLLED = [
    "engine.max_num_seqs=16",
    "engine.spec.synthetic_acceptance_rates=[0.02, 0.0, 0.0, 0.0]",
    "engine.spec.controller.calibration=cpu-tiny",
    "engine.spec.controller.interval_s=3600",  # the test runs each interval itself
    "engine.spec.controller.acceptance_prior=[0.95, 0.9, 0.85, 0.8]",
    "engine.spec.controller.replacement.enabled=false",  # tables only: restarts in test_engine_restart.py
]
MAX_ROUNDS = 60


def calibrated_step_times(drain, cost):
    """The engine's own measurements, with each step's time as the calibration states it."""
    def measure():
        window = drain()
        for s in window["steps"]:
            ctx = s["mean_context_tokens_per_req"] * s["batch_size"]
            s["mean_step_time_s"] = cost.step_time_s(s["batch_size"], s["num_speculative_tokens"], ctx)
        return window
    return measure


def test_controller_learns_drafts_are_rejected_and_the_engine_stops_drafting(tiny_models, loop):
    engine = loop.start_engine(CONTROLLED)
    cfg = load_config("tiny", CONTROLLED).engine
    cost = load_calibration("cpu-tiny.json").cost
    ctl = LiveSpecController(engine, cfg, engine.kv_capacity_tokens,
                             measure=calibrated_step_times(engine.step_window.drain, cost))
    engine.controller = ctl

    async def traffic(tag: str, width: int):
        results = await asyncio.gather(*(
            engine.generate({"id": f"{tag}-{i}", "prompt": f"def f{i}(x):", "max_tokens": 32, "ignore_eos": True})
            for i in range(width)))
        assert all(x["ok"] and x["num_output_tokens"] == 32 for x in results)

    def drafts() -> int:
        return engine.stats.num_drafts

    try:
        start = ctl.state()
        assert start["k_in_force"] == 4 and start["changes"] == 0  # the prior says: draft
        assert loop.run(engine.spec_schedule())["schedule"] == start["schedule"]
        before = drafts()
        loop.run(traffic("start", 2))
        assert drafts() > before  # drafting at start-up

        for r in range(MAX_ROUNDS):  # bounded: stops once drafting is off everywhere
            loop.run(traffic(f"r{r}", 4 if r < 3 else 1))
            loop.run(ctl.step())
            if ctl.state()["table"] == OFF:
                break
        state = ctl.state()
        assert state["table"] == OFF, state["reason"]  # decided: drafting off at every batch size
        assert state["acceptance_per_pos"][0] < 0.3  # learned from the engine, not the prior
        assert state["recent_changes"][-1]["to"] == OFF
        assert "K table changed" in state["recent_changes"][-1]["reason"]
        assert "without speculation" in state["advice"]

        # Read back from the engine core: what the controller holds in force (the table, or
        # for one interval a probe) is what the scheduler has.
        for _ in range(10):  # past a probe, if one is running
            if ctl.state()["schedule"] == OFF:
                break
            loop.run(traffic("probe", 1))
            loop.run(ctl.step())
        assert loop.run(engine.spec_schedule())["schedule"] == ctl.state()["schedule"] == OFF
        # ... and the engine runs it: no drafts from here on.
        engine.step_window.drain()
        before = drafts()
        loop.run(traffic("off", 4))
        assert drafts() == before
        assert set(engine.step_window.drain()["num_steps_by_k"]) == {0}
        assert engine.stats_dict()["spec_control"]["table"] == OFF
    finally:
        engine.shutdown()
