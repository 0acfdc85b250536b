"""Drafting off by replacement on the real engine: `Engine.restart_engine` swaps vLLM's
engine for one without the drafter (and back) while requests are in flight, and nothing
is lost or changed: every request finishes, greedy float32 outputs equal a plain
engine's token for token, requests that arrive during the restart wait for it, and the
drafts counted show which engine ran. When the controller restarts the engine is decided
from stated numbers in tests/unit/test_live_controller.py; the last test here shows the
controller carrying a restart out on the live engine.
"""

import asyncio
import json

import pytest

from configs import load_config
from control.calibration import load_calibration, save_calibration
from control.live import LiveSpecController
from engine_loop import generate_all
from humaneval_inputs import humaneval_requests

pytestmark = pytest.mark.integration

PROMPTS = [{"id": r["id"], "prompt": r["prompt"], "max_tokens": 16 + 4 * i}
           for i, r in enumerate(humaneval_requests(limit=12))]
BASE = ["sampling.temperature=0", "engine.max_num_seqs=16"]
CONTROLLED = [*BASE, "engine.spec.controller.calibration=cpu-tiny", "engine.spec.controller.replacement.enabled=true",
              "engine.spec.controller.interval_s=3600"]  # the tests drive the controller themselves


@pytest.fixture(scope="module")
def reference(tiny_models, loop):
    engine = loop.start_engine([*BASE, "engine.spec={method: none}"])
    try:
        return loop.run(generate_all(engine, PROMPTS))
    finally:
        engine.shutdown()


async def _restart_mid_load(engine, speculating: bool):
    """All prompts in flight, the restart asked for once the engine has made some progress,
    and a second wave sent while the restart runs."""
    first = asyncio.ensure_future(generate_all(engine, PROMPTS[:8]))
    steps = engine.stats.num_steps
    for _ in range(2000):  # bounded: until the first wave is decoding
        if engine.stats.num_steps >= steps + 5:
            break
        await asyncio.sleep(0.01)
    restart = asyncio.ensure_future(engine.restart_engine(speculating))
    await asyncio.sleep(0)  # the restart has closed the door: the second wave waits behind it
    second = asyncio.ensure_future(generate_all(engine, PROMPTS[8:]))
    seconds = await restart
    return {**await first, **await second}, seconds


def core_pids(engine) -> list[int]:
    """The engine core's process ids (vLLM's process manager inside AsyncLLM)."""
    return [p.pid for p in engine._llm.engine_core.resources.engine_manager.processes]


def test_restart_without_and_back_with_the_drafter_mid_load_loses_and_changes_nothing(reference, loop):
    engine = loop.start_engine(CONTROLLED)
    try:
        assert engine.speculating
        first_core = core_pids(engine)
        out, _ = loop.run(_restart_mid_load(engine, speculating=False))
        assert out == reference  # every request, token for token
        assert not engine.speculating and engine.num_restarts == 1
        assert set(core_pids(engine)).isdisjoint(first_core)  # a new engine core serves now
        drafts = engine.stats.num_drafts
        assert loop.run(generate_all(engine, PROMPTS[:4])) == {p["id"]: reference[p["id"]] for p in PROMPTS[:4]}
        assert engine.stats.num_drafts == drafts  # no drafter any more
        with pytest.raises(ValueError, match="no K to change"):
            loop.run(engine.set_spec_schedule([[1, 16, 4]]))
        loop.run(engine.check_health())

        out, _ = loop.run(_restart_mid_load(engine, speculating=True))
        assert out == reference
        assert engine.speculating and engine.num_restarts == 2
        drafts = engine.stats.num_drafts
        loop.run(generate_all(engine, PROMPTS[:4]))
        assert engine.stats.num_drafts > drafts  # drafting again, with its start-up table
        assert loop.run(engine.spec_schedule())["schedule"] == [list(r) for r in engine.cfg.spec.schedule]
    finally:
        engine.shutdown()


def test_controller_restarts_the_live_engine_when_its_numbers_say_so(tiny_models, loop, tmp_path):
    # Drafts never accepted (synthetic), each step's time as the calibration states it,
    # and a drafter whose K=0 pass costs a lot: the controller turns drafting off, then
    # restarts the engine without the drafter (no dwell, no margin, so it happens at once).
    cal = load_calibration("cpu-tiny.json")
    import dataclasses

    cal = dataclasses.replace(cal, cost=dataclasses.replace(cal.cost, k0_draft_fixed_s=0.004, k0_draft_per_req_s=0.0))
    path = tmp_path / "drafter-cost.json"
    save_calibration(cal, path)
    overrides = [*BASE, f"engine.spec.controller.calibration={path}", "engine.spec.controller.interval_s=3600",
                 "engine.spec.synthetic_acceptance_rates=[0.02, 0.0, 0.0, 0.0]",
                 "engine.spec.controller.replacement={dwell_intervals: 1, cost_margin: 0, cooldown_intervals: 0}"]
    engine = loop.start_engine(overrides)
    cfg = load_config("tiny", overrides).engine

    def measure():
        window = engine.step_window.drain()
        for s in window["steps"]:
            ctx = s["mean_context_tokens_per_req"] * s["batch_size"]
            s["mean_step_time_s"] = cal.cost.step_time_s(s["batch_size"], s["num_speculative_tokens"], ctx)
        return window

    ctl = LiveSpecController(engine, cfg, engine.kv_capacity_tokens, measure=measure)
    engine.controller = ctl
    try:
        for r in range(60):  # bounded
            loop.run(generate_all(engine, [{**p, "id": f"{p['id']}#{r}"} for p in PROMPTS[:2]]))
            loop.run(ctl.step())
            if not engine.speculating:
                break
        state = ctl.state()
        assert not engine.speculating and state["engine"] == "plain", state["replacement"]
        assert state["recent_restarts"][-1]["speculating"] is False
        assert "restart without speculation" in state["recent_restarts"][-1]["reason"]
        json.dumps(state)  # what /speculation and the job summary carry is plain data
        drafts = engine.stats.num_drafts
        loop.run(generate_all(engine, [{**p, "id": f"{p['id']}#after"} for p in PROMPTS[:2]]))
        assert engine.stats.num_drafts == drafts
    finally:
        engine.shutdown()


def test_an_engine_told_to_start_without_its_drafter_runs_plain_and_can_get_it_back(reference, loop):
    # What a batch job's plan does where an engine kept full is faster plain.
    engine = loop.start_engine([*CONTROLLED, "engine.spec.controller.replacement.start_speculating=false"])
    try:
        assert not engine.speculating and engine.controller.state()["engine"] == "plain"
        assert engine.controller.state()["k_in_force"] == 0
        assert loop.run(generate_all(engine, PROMPTS)) == reference
        assert engine.stats.num_drafts == 0  # vLLM built no drafter
        out, _ = loop.run(_restart_mid_load(engine, speculating=True))
        assert out == reference and engine.speculating
        drafts = engine.stats.num_drafts
        loop.run(generate_all(engine, PROMPTS[:4]))
        assert engine.stats.num_drafts > drafts
    finally:
        engine.shutdown()
