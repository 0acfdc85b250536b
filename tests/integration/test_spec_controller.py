"""The speculation controller on a live engine: it learns acceptance from the engine's own
counters and changes K on the running engine, with a reason a person can read.

Synthetic acceptance (vLLM's `rejection_sample_method: synthetic`, on CPU through our
plugin) makes the workload's acceptance a known number. The controller is told to expect
high acceptance (its prior), so it starts drafting at every batch size; the drafts are
then almost never accepted, and the controller must find that out and turn drafting off.
"""

import asyncio

import pytest


pytestmark = pytest.mark.integration

CONTROLLED = [
    "engine.max_num_seqs=16",
    "engine.spec.synthetic_acceptance_rates=[0.02, 0.0, 0.0, 0.0]",
    "engine.spec.controller.calibration=cpu-tiny",
    "engine.spec.controller.interval_s=0.3",
    "engine.spec.controller.acceptance_prior=[0.95, 0.9, 0.85, 0.8]",
]


def test_controller_learns_drafts_are_rejected_and_turns_drafting_off_live(tiny_models, loop):
    engine = loop.start_engine(CONTROLLED)
    try:
        start = engine.spec_control_state()
        assert start["k_in_force"] == 4 and start["changes"] == 0  # the prior says: draft
        assert start["advice"] is None

        async def traffic(rounds: int):
            # Concurrency first, then one request at a time: drafting stops at a batch size
            # as soon as its K turns 0, so the small batch sizes keep measuring the longest.
            for r in range(rounds):  # bounded: stops once drafting is off everywhere
                width = 4 if r < 3 else 1
                results = await asyncio.gather(*(
                    engine.generate({"id": f"r{r}-{i}", "prompt": f"def f{i}(x):", "max_tokens": 32,
                                     "ignore_eos": True}) for i in range(width)))
                assert all(x["ok"] and x["num_output_tokens"] == 32 for x in results)
                if all(k == 0 for _, _, k in engine.spec_control_state()["table"]):
                    return r
            return rounds

        loop.run(traffic(100))
        state = engine.spec_control_state()
        assert state["changes"] >= 1, state["reason"]
        assert state["table"] == [[1, 16, 0]], state["reason"]  # drafting off at every batch size
        # Each change is logged with why: decided changes with the evidence behind them,
        # apart from one-interval probes (measuring the step without drafts) with their cost,
        # so frequent probes never push the decisions out of the log.
        assert state["recent_changes"] and {c["kind"] for c in state["recent_changes"]} == {"table"}
        for c in state["recent_changes"]:
            assert "K table changed" in c["reason"] and "measured acceptance" in c["reason"]
        assert state["recent_changes"][-1]["to"] == [[1, 16, 0]]
        assert {c["kind"] for c in state["recent_probes"]} <= {"probe", "probe ended"}
        for c in state["recent_probes"]:
            if c["kind"] == "probe":
                assert "probe self" in c["reason"]
        assert state["acceptance_per_pos"][0] < 0.3  # learned from the engine, not the prior

        # What the controller holds in force is what the engine core's scheduler runs
        # (the table, or for one interval a probe); that the scheduler then drafts
        # exactly that K is shown in test_live_schedule.py.
        assert loop.run(engine.spec_schedule())["schedule"] == engine.spec_control_state()["schedule"]
        assert engine.stats_dict()["spec_control"]["table"] == [[1, 16, 0]]
        # Off by table is not off: the operator is told a replica without speculation is faster.
        assert "without speculation" in engine.spec_control_state()["advice"]
    finally:
        engine.shutdown()
