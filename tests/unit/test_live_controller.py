"""The live controller loop (`control.live.LiveSpecController.step`), the code that
runs inside every engine, replayed from stated measurements with an injected clock.

The engine is a stand-in that records the tables put on it and answers with what an
engine running them would measure: each interval, `num_steps` steps at the batch size
the load sets and the K the table in force gives there, each step taking exactly what
the calibration says (`cost.step_time_s`), drafts accepted at the workload's rates. So
every decision below is a function of these numbers alone, never of this machine's
speed. That the table the controller puts in force is the one the real engine then runs
is shown on the real engine in tests/integration/test_spec_controller.py.
"""

from __future__ import annotations

import asyncio

import pytest

from actors.spec_stats import StepWindow
from configs import load_config
from control.calibration import load_calibration
from control.live import TIMELINE_POINTS, LiveSpecController
from control.model import plain_step_time_s, tokens_per_step
from control.plan import startup_engine
from control.policy import dense_from_schedule

from calibrations import DRAFTER_PASS

pytestmark = pytest.mark.unit

CAL = load_calibration(DRAFTER_PASS)
RESTART_S = 20.0
CONTEXT_PER_REQ = 200.0
OVERRIDES = [
    "engine.max_num_seqs=16",
    f"engine.spec.controller.calibration={DRAFTER_PASS}",
    "engine.spec.controller.replacement.enabled=true",  # the preset keeps the drafter on CPU
    "engine.spec.controller.acceptance_prior=[0.95, 0.9, 0.85, 0.8]",  # told: drafts pay
]


class Clock:
    def __init__(self, interval_s: float):
        self.now_s, self.interval_s = 1000.0, interval_s

    def __call__(self) -> float:
        return self.now_s

    def tick(self) -> None:
        self.now_s += self.interval_s


class CalibratedEngine:
    """Stands in for `actors.engine.Engine`: keeps the table put on it, and reports what
    an engine running that table measures at the given load and acceptance."""

    def __init__(self, cfg, acceptance: list[float], cal=CAL):
        self.cfg, self.cal = cfg, cal
        self.acceptance, self.max_num_seqs, self.max_k = acceptance, cfg.max_num_seqs, cfg.spec.num_speculative_tokens
        self.speculating = cfg.spec.controller.replacement.start_speculating  # as actors.engine.Engine starts
        self.startup_s = RESTART_S  # what the controller weighs a restart against
        self.restarts: list[bool] = []
        self.schedule: list[list[int]] | None = None
        self.tables_set: list[list[list[int]]] = []
        self.signals: dict = {}
        self.step_window = StepWindow()
        self.batch_size = 1
        # What each engine's steps cost beyond the decode steps the calibration times
        # (prefills, requests joining and leaving), as a factor on its time per token.
        self.busy_overhead = {True: 1.0, False: 1.0}
        # Seconds per output token the steps where requests join add, per drafted position
        # (on short requests more of the steps have a request joining the deeper the K).
        self.join_s_per_token_per_k = 0.0

    async def restart_engine(self, speculating: bool) -> float:
        self.speculating = speculating
        self.restarts.append(speculating)
        if speculating:
            self.schedule = [list(r) for r in self.cfg.spec.schedule]
        return RESTART_S

    async def set_spec_schedule(self, schedule):
        assert self.speculating, "a table put on an engine without speculation"
        self.schedule = [list(r) for r in schedule]
        self.tables_set.append(self.schedule)
        return {"schedule": self.schedule}

    def measure(self, num_steps: int = 40) -> dict:
        b = self.batch_size
        k = dense_from_schedule(self.schedule, self.max_num_seqs, self.max_k)[b - 1] if self.speculating else 0
        n = b * num_steps
        self.signals.update(num_running_reqs=b, num_waiting_reqs=0, kv_cache_usage=0.05)
        cost = self.cal.cost
        step_s = (cost.step_time_s(b, k, CONTEXT_PER_REQ * b) if self.speculating
                  else plain_step_time_s(cost, b, CONTEXT_PER_REQ * b))
        tokens = round(n * tokens_per_step(self.acceptance, k))
        joining_s = tokens * self.join_s_per_token_per_k * k
        return {
            "busy": [{"batch_size": b, "num_speculative_tokens": k, "num_steps": num_steps, "output_tokens": tokens,
                      "seconds": num_steps * step_s * self.busy_overhead[self.speculating] + joining_s}],
            "drafts_per_pos": [n] * k,
            "accepted_per_pos": [round(n * p) for p in self.acceptance[:k]],
            "steps": [{"batch_size": b, "num_speculative_tokens": k, "num_steps": num_steps,
                       "mean_step_time_s": step_s,
                       "mean_prefill_tokens": 0.0, "mean_context_tokens_per_req": CONTEXT_PER_REQ}],
            "num_steps_by_k": {k: num_steps},
        }


def controlled(acceptance: list[float], overrides=("engine.spec.controller.replacement.enabled=false",), cal=CAL):
    cfg = startup_engine(load_config("tiny", OVERRIDES + list(overrides)).engine)  # as resolved at the door
    engine = CalibratedEngine(cfg, acceptance, cal)
    clock = Clock(cfg.spec.controller.interval_s)
    ctl = LiveSpecController(engine, cfg, CAL.kv_capacity_tokens, measure=engine.measure, clock=clock)
    engine.schedule = ctl.in_force  # what the engine started with
    return ctl, engine, clock


def run(ctl, engine, clock, loads: list[int], on_engine: list | None = None) -> list[list[list[int]]]:
    """One interval per entry of `loads` (running requests then); the decided table after
    each (and in `on_engine` the table the engine then ran)."""
    tables = []
    for b in loads:
        engine.batch_size = b
        clock.tick()
        asyncio.run(ctl.step())
        tables.append(ctl.state()["table"])
        if on_engine is not None:
            on_engine.append(engine.schedule)
    return tables


def all_off(table) -> bool:
    return all(k == 0 for _, _, k in table)


def test_drafts_never_accepted_turn_drafting_off_everywhere_with_reasons_and_advice():
    ctl, engine, clock = controlled([0.02, 0.0, 0.0, 0.0])
    assert ctl.state()["k_in_force"] == 4  # the prior says drafts pay
    on_engine: list = []
    tables = run(ctl, engine, clock, [4] * 5 + [1] * 40, on_engine)
    state = ctl.state()
    assert all_off(tables[-1]) and state["table"] == [[1, 16, 0]]
    # Put on the engine, not only decided: from then on the engine runs it, but for
    # one-interval probes of deeper positions (each logged, within the probe budget).
    first_off = next(i for i, t in enumerate(tables) if all_off(t))
    after = on_engine[first_off:]
    assert after[0] == [[1, 16, 0]] and after.count([[1, 16, 0]]) >= 0.8 * len(after)
    assert engine.schedule == state["schedule"]
    probes = [c for c in state["recent_probes"] if c["kind"] == "probe"]
    assert len(probes) >= len(after) - after.count([[1, 16, 0]]) - 1
    assert state["acceptance_per_pos"][0] < 0.1  # learned from what the engine measured
    assert state["recent_changes"][-1]["to"] == [[1, 16, 0]]
    for change in state["recent_changes"]:
        assert change["kind"] == "table" and "measured acceptance" in change["reason"]
    # Off by table is not off: the operator is told, with how long it has been so.
    seconds_off = (len(tables) - 1 - first_off) * clock.interval_s
    assert f"for {seconds_off:.0f} s" in state["advice"] and "without speculation" in state["advice"]


def test_drafts_accepted_as_expected_keep_drafting_at_small_batches():
    ctl, engine, clock = controlled([0.95, 0.9, 0.85, 0.8])
    tables = run(ctl, engine, clock, [1, 2, 4] * 15)
    for table in tables:
        assert dense_from_schedule(table, 16, 4)[0] == 4  # K=4 at batch size 1 throughout
    assert ctl.state()["advice"] is None
    # Probes (one interval at K=0 to measure the base step) come back to the table.
    assert engine.schedule == ctl.state()["table"] or ctl.state()["probe"]


def test_steps_where_requests_join_that_cost_more_the_deeper_the_k_make_the_table_shallower():
    # Decode steps exactly as calibrated: at 8 running with these rates, they say K=4. As
    # the engine runs a load of short requests, the steps where requests join add time per
    # output token that grows with K (0.2 ms per drafted position here). Once a K=0 probe
    # has measured that time without drafts, the controller drafts shallower there; without
    # that time it keeps K=4. (K=0 probes at a tenth of goodput, so that they come within
    # the run: at the shipped 0.5% they come as rarely as drafting here is predicted to pay.)
    def k_at_8(join_s_per_token_per_k: float):
        ctl, engine, clock = controlled([0.6, 0.4, 0.3, 0.2], ("engine.spec.controller.replacement.enabled=false",
                                                              "engine.spec.controller.probe_budget=0.1"))
        engine.join_s_per_token_per_k = join_s_per_token_per_k
        run(ctl, engine, clock, [8] * 60)
        return dense_from_schedule(ctl.state()["table"], 16, 4)[8 - 1], ctl.state()

    k_decode_only, state = k_at_8(0.0)
    assert k_decode_only == 4 and ctl_probed_k0(state)
    k_as_run, state = k_at_8(0.2e-3)
    assert 0 < k_as_run < k_decode_only and ctl_probed_k0(state)
    # What it charged is on show, per batch-size bucket and K: more at K=4 than at K=0.
    cost = state["join_cost_ms_per_token"]["B5-8"]
    assert cost[4] == pytest.approx(0.8, abs=0.05) and cost[0] == pytest.approx(0.0, abs=0.05)


def ctl_probed_k0(state) -> bool:
    return any(p["kind"] == "probe" and all(k == 0 for _, _, k in p["to"]) for p in state["recent_probes"])


def test_same_measurements_same_decisions():
    loads = [1, 1, 8, 8, 16, 2, 1] * 6
    runs = []
    for _ in range(2):
        ctl, engine, clock = controlled([0.4, 0.2, 0.1, 0.05])
        run(ctl, engine, clock, loads)
        runs.append((engine.tables_set, ctl.state()["table"], ctl.state()["recent_changes"], ctl.timeline))
    assert runs[0] == runs[1]


def test_tables_use_only_k_the_engine_can_run():
    # With CUDA graphs a live table may use only the start-up table's K values (graphs are
    # captured per decode shape); an eager engine may use every K.
    graphs = ["engine.enforce_eager=false", "engine.spec.schedule=[[1, 4, 4], [5, 16, 0]]",
              "engine.spec.controller.replacement.enabled=false"]
    for overrides, allowed in [(graphs, {0, 4}), (["engine.spec.controller.replacement.enabled=false"], set(range(5)))]:
        ctl, engine, clock = controlled([0.5, 0.3, 0.2, 0.1], overrides)
        run(ctl, engine, clock, [1, 3, 6, 12, 16] * 10)
        used = {k for table in engine.tables_set for _, _, k in table}
        assert used <= allowed, (overrides, used)
    assert used - {0, 4}, used  # the eager engine did use a K between


def test_timeline_covers_the_whole_run_and_stays_bounded():
    ctl, engine, clock = controlled([0.02, 0.0, 0.0, 0.0])
    loads = [1 + (i // 40) % 16 for i in range(3 * TIMELINE_POINTS + 7)]
    run(ctl, engine, clock, loads)
    timeline = ctl.state()["timeline"]
    assert len(timeline) < TIMELINE_POINTS
    times = [t for t, _, _, _ in timeline]
    assert times == sorted(times) and times[0] == clock.interval_s
    assert times[-1] >= (len(loads) - 4) * clock.interval_s  # reaches the end of the run
    assert {b for _, b, _, _ in timeline} >= {1, 8, 16}
    assert timeline[0][2] == 4 and timeline[-1][2] == 0  # K in force: drafting, then off


def test_timeline_plot_is_a_png_per_engine_and_absent_without_a_controller():
    from jobs.job_report import timeline_png

    ctl, engine, clock = controlled([0.02, 0.0, 0.0, 0.0])
    run(ctl, engine, clock, [4] * 5 + [1] * 20)
    png = timeline_png({"engine-a": ctl.state(), "engine-b": ctl.state()})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline_png({}) is None and timeline_png({"fixed-k": {"timeline": []}}) is None


# -- drafting off by replacement ------------------------------------------------------------

MIXED = [0.35, 0.15, 0.07, 0.03]  # drafting pays at batch size 1, not at 16


@pytest.fixture()
def drafter_costs(tmp_path):
    """cpu-tiny with a drafter whose K=0 pass costs 1 ms + 0.25 ms per request (what a plain
    engine saves), as a calibration file the controller loads by path."""
    import dataclasses

    from control.calibration import save_calibration

    cal = dataclasses.replace(CAL, cost=dataclasses.replace(CAL.cost, k0_draft_fixed_s=0.001,
                                                            k0_draft_per_req_s=0.00025))
    path = tmp_path / "with-drafter-cost.json"
    save_calibration(cal, path)
    return cal, [f"engine.spec.controller.calibration={path}"]


def run_until(ctl, engine, clock, batch_size, done, max_intervals):
    """Intervals at one batch size until `done()`; how many it took (None: never)."""
    for i in range(max_intervals):
        run(ctl, engine, clock, [batch_size])
        if done():
            return i + 1
    return None


def test_heavy_load_restarts_without_the_drafter_and_light_load_brings_it_back(drafter_costs):
    cal, overrides = drafter_costs
    ctl, engine, clock = controlled(MIXED, overrides, cal)
    # Sixteen at a time: drafting turns off there, then the engine sheds its drafter once
    # the saving over the load so far beats twice the (measured) restart.
    n_off = run_until(ctl, engine, clock, 16, lambda: engine.restarts == [False], 300)
    assert n_off is not None, ctl.state()["replacement"]
    state = ctl.state()
    assert state["engine"] == "plain" and state["schedule"] is None and state["k_in_force"] == 0
    restart = state["recent_restarts"][-1]
    assert restart["speculating"] is False and "restart without speculation" in restart["reason"]
    assert restart["restart_s"] == RESTART_S and state["switch_cost_s"] == RESTART_S
    # What the rule weighed is readable: at sixteen a plain engine's predicted tokens/s won.
    view = state["restart_view"]["by_batch_size"][16]
    assert view["plain_tokens_per_s"] > view["speculating_tokens_per_s"] > 0
    # One at a time: drafting pays again, and the engine gets its drafter back.
    n_on = run_until(ctl, engine, clock, 1, lambda: engine.restarts == [False, True], 400)
    assert n_on is not None, ctl.state()["replacement"]
    assert n_on > ctl.replacement_config.dwell_intervals
    state = ctl.state()
    assert state["engine"] == "speculating" and "restart with speculation" in state["recent_restarts"][-1]["reason"]
    run_until(ctl, engine, clock, 1, lambda: False, 3)
    assert ctl.state()["k_in_force"] == 4 and engine.schedule == ctl.state()["schedule"]
    # With the drafter back, the capacity reported is the decided table's again.
    assert ctl.state()["capacity"]["num_speculative_tokens"] == ctl.last.capacity.num_speculative_tokens
    marks = [spec for _, _, _, spec in ctl.state()["timeline"]]
    assert marks[0] == 1 and 0 in marks and marks[-1] == 1


def test_a_short_burst_does_not_restart_and_a_disabled_replacement_never_does(drafter_costs):
    cal, overrides = drafter_costs
    ctl, engine, clock = controlled(MIXED, overrides, cal)
    lull = 2 * ctl.replacement_config.dwell_intervals  # long enough to fill the rule's view of the load
    for _ in range(5):  # bursts of 30 intervals at 16, each followed by a lull
        run_until(ctl, engine, clock, 16, lambda: False, 30)
        run_until(ctl, engine, clock, 1, lambda: False, lull)
    assert engine.restarts == []
    ctl, engine, clock = controlled(MIXED, overrides + ["engine.spec.controller.replacement.enabled=false"], cal)
    run_until(ctl, engine, clock, 16, lambda: False, 300)
    assert engine.restarts == [] and ctl.state()["replacement"] == "disabled"


def test_a_heavy_load_that_dips_between_requests_restarts_without_the_drafter_and_stays(drafter_costs):
    # A closed loop of clients dips for an interval now and then (a request ended, the next
    # has not started). Drafting wins at 1, a plain engine at 16: over this load, four
    # intervals in five at 16, the plain engine delivers more, dips or not.
    cal, overrides = drafter_costs
    ctl, engine, clock = controlled(MIXED, overrides, cal)
    run(ctl, engine, clock, ([16] * 4 + [1]) * 60)
    state = ctl.state()
    assert engine.restarts == [False] and state["engine"] == "plain", state["replacement"]
    view = state["restart_view"]
    assert view["by_batch_size"][1]["speculating_tokens_per_s"] > view["by_batch_size"][1]["plain_tokens_per_s"]
    assert view["load"]["plain_tokens_per_s"] > view["load"]["speculating_tokens_per_s"]
    run(ctl, engine, clock, ([16] * 4 + [1]) * 100)  # the same load: no flapping back
    assert engine.restarts == [False]


def plain_capacity_as_calibrated(cost, max_num_seqs: int, target_tpot_s: float) -> tuple[int, float]:
    """(batch size, tokens/s) of a plain engine stepping as calibrated: the largest batch
    whose step (one token per request, no drafter pass) meets the target."""
    best = 1
    for b in range(1, max_num_seqs + 1):
        if plain_step_time_s(cost, b, CONTEXT_PER_REQ * b) <= target_tpot_s:
            best = b
    return best, best / plain_step_time_s(cost, best, CONTEXT_PER_REQ * best)


def test_after_a_restart_without_the_drafter_the_replica_reports_the_plain_engines_capacity(drafter_costs):
    from serving.autoscale import autoscaling_stats, reports_from_metrics

    cal, overrides = drafter_costs
    ctl, engine, clock = controlled(MIXED, overrides, cal)
    run_until(ctl, engine, clock, 16, lambda: engine.restarts == [False], 300)
    assert engine.restarts == [False], ctl.state()["replacement"]
    drafting = ctl.last.capacity  # decided while the drafter was still on: the drafting table's
    # Right after the restart (no interval has run plain yet): the stand-in steps as
    # calibrated, so the controller's corrections are 1 and the plain engine's capacity is
    # the calibration's plain step at every batch size, K=0.
    batch_size, tokens_per_s = plain_capacity_as_calibrated(cal.cost, 16, ctl.config.target_tpot_s)
    cap = ctl.state()["capacity"]
    assert cap["num_speculative_tokens"] == 0 and cap["batch_size"] == batch_size
    assert cap["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-3)
    # ... which the drafting table's is not (what the replica reported before the fix).
    assert drafting.num_speculative_tokens > 0 or drafting.tokens_per_s != pytest.approx(tokens_per_s, rel=1e-3)
    assert ctl.state()["probe"] is None
    # What the Serve autoscaler reads from this replica (EngineReplica.record_autoscaling_stats).
    stats = autoscaling_stats(16, cap)
    [report] = reports_from_metrics({name: {"r": value} for name, value in stats.items()}, ["r"])
    assert report.capacity.num_speculative_tokens == 0
    assert report.capacity.tokens_per_s == pytest.approx(tokens_per_s, rel=1e-3)
    # Decisions made while plain keep deciding the drafting table (for the drafter's
    # return); the capacity reported stays the plain engine's, now measured as it ran.
    run_until(ctl, engine, clock, 16, lambda: False, 5)
    assert ctl.state()["engine"] == "plain"
    cap = ctl.state()["capacity"]
    assert cap["num_speculative_tokens"] == 0 and cap["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-3)


def test_an_operators_restart_to_plain_also_reports_the_plain_engines_capacity():
    ctl, engine, clock = controlled([0.95, 0.9, 0.85, 0.8])
    run(ctl, engine, clock, [4] * 3)
    assert ctl.state()["capacity"]["num_speculative_tokens"] > 0
    asyncio.run(engine.restart_engine(False))  # not the controller's doing (serving.app restart_engine)
    batch_size, tokens_per_s = plain_capacity_as_calibrated(CAL.cost, 16, ctl.config.target_tpot_s)
    cap = ctl.state()["capacity"]
    assert cap["num_speculative_tokens"] == 0 and cap["batch_size"] == batch_size
    assert cap["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-3)


def test_timeline_plot_shades_the_spell_without_the_drafter(drafter_costs, tmp_path):
    from jobs.job_report import timeline_png

    cal, overrides = drafter_costs
    ctl, engine, clock = controlled(MIXED, overrides, cal)
    run_until(ctl, engine, clock, 16, lambda: engine.restarts == [False], 300)
    run_until(ctl, engine, clock, 16, lambda: False, 10)
    png = timeline_png({"engine-a": ctl.state()})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "t.png").write_bytes(png)


def test_a_plain_engine_beating_a_drafting_table_restarts_without_the_drafter():
    # cpu-tiny as measured: the drafter's K=0 pass is half a step. At 8 running with these
    # rates drafting beats drafting off by table (the drafter runs either way), so
    # the decided table never goes K=0; a plain engine still beats both.
    acceptance = [0.6, 0.4, 0.2, 0.1]
    ctl, engine, clock = controlled(acceptance, ["engine.spec.controller.acceptance_prior=[0.6, 0.4, 0.2, 0.1]"])
    n_off = run_until(ctl, engine, clock, 8, lambda: engine.restarts == [False], 300)
    assert n_off is not None, ctl.state()["replacement"]
    decided = dense_from_schedule(ctl.state()["table"], 16, 4)
    assert decided[8 - 1] > 0  # the table the controller would run drafts at this load
    restart = ctl.state()["recent_restarts"][-1]
    assert restart["speculating"] is False and "restart without speculation" in restart["reason"]
    # The plain engine then runs as predicted: it stays plain at this load (no flapping).
    run_until(ctl, engine, clock, 8, lambda: False, 3 * ctl.replacement_config.cooldown_intervals)
    assert engine.restarts == [False] and ctl.state()["engine"] == "plain"


def test_an_engine_started_plain_stays_plain_under_a_full_load_and_gets_the_drafter_back_when_it_pays(drafter_costs):
    # As a batch job's plan starts it (tests/unit/test_capacity_plan.py), from the same
    # acceptance the plan assumed (the prior). MIXED: drafting pays at batch size 1 only;
    # the drafter's K=0 pass as in `drafter_costs`.
    cal, overrides = drafter_costs
    ctl, engine, clock = controlled(MIXED, overrides + [f"engine.spec.controller.acceptance_prior={MIXED}",
                                                        "engine.spec.controller.replacement.start_speculating=false"], cal)
    cfg = engine.cfg
    assert ctl.state()["engine"] == "plain" and ctl.state()["k_in_force"] == 0
    run_until(ctl, engine, clock, 16, lambda: False, 200)
    assert engine.restarts == [] and ctl.state()["engine"] == "plain"
    n_on = run_until(ctl, engine, clock, 1, lambda: engine.restarts == [True], 400)
    assert n_on is not None, ctl.state()["replacement"]
    assert ctl.state()["engine"] == "speculating" and engine.schedule == [list(r) for r in cfg.spec.schedule]


def test_a_drafting_engine_slower_than_its_decode_steps_say_restarts_plain_and_stays():
    # The decode steps alone say the K=4 table beats a plain engine at 8 running (these
    # rates, cpu-tiny as measured), but the drafting engine's output comes 1.6x slower
    # than those steps predict (its prefills and the steps around each request's start and
    # end): measured per output token, a plain engine is faster, and the engine sheds its
    # drafter. The plain engine then runs as the calibration says: it stays plain.
    acceptance = [0.9, 0.8, 0.7, 0.6]
    prior = "engine.spec.controller.acceptance_prior=[0.9, 0.8, 0.7, 0.6]"
    ctl, engine, clock = controlled(acceptance, [prior])
    run_until(ctl, engine, clock, 8, lambda: False, 60)
    assert engine.restarts == [], "the decode steps alone must favour drafting here"
    assert ctl.state()["busy_factor"]["speculating"] == pytest.approx(1.0, abs=0.05)

    ctl, engine, clock = controlled(acceptance, [prior])
    engine.busy_overhead[True] = 1.6
    n_off = run_until(ctl, engine, clock, 8, lambda: engine.restarts == [False], 300)
    assert n_off is not None, ctl.state()["replacement"]
    assert dense_from_schedule(ctl.state()["table"], 16, 4)[8 - 1] == 4  # the table still drafts here
    assert ctl.state()["busy_factor"]["speculating"] == pytest.approx(1.6, rel=0.05)
    run_until(ctl, engine, clock, 8, lambda: False, 3 * ctl.replacement_config.cooldown_intervals)
    assert engine.restarts == [False] and ctl.state()["engine"] == "plain"
    assert ctl.state()["busy_factor"]["plain"] == pytest.approx(1.0, abs=0.05)


def test_an_engine_tried_plain_and_found_slower_gets_its_drafter_back_and_keeps_it():
    # Both engines pay the same extra per token, but the plain one has not run yet, so it
    # is believed as calibrated: the drafting engine, measured slower than predicted, tries
    # it. Measured, the plain engine is slower than the drafting one as it ran: the drafter
    # comes back after the cooldown, and with both measured there is no third restart.
    acceptance = [0.9, 0.8, 0.7, 0.6]
    ctl, engine, clock = controlled(acceptance, ["engine.spec.controller.acceptance_prior=[0.9, 0.8, 0.7, 0.6]"])
    engine.busy_overhead = {True: 1.6, False: 1.6}
    run_until(ctl, engine, clock, 8, lambda: engine.restarts == [False, True], 400)
    assert engine.restarts == [False, True], ctl.state()["replacement"]
    run_until(ctl, engine, clock, 8, lambda: False, 10 * ctl.replacement_config.cooldown_intervals)
    assert engine.restarts == [False, True] and ctl.state()["engine"] == "speculating"
    factors = ctl.state()["busy_factor"]
    assert factors["speculating"] == pytest.approx(1.6, rel=0.05) and factors["plain"] == pytest.approx(1.6, rel=0.05)


def test_a_plain_engine_the_calibration_underrates_is_tried_once_the_load_holds_and_kept():
    # At 12 running with these rates the calibration says the K=4 table beats a plain engine
    # by ~9%, but the plain engine really runs 30% faster than calibrated. Believing the
    # calibration, the engine never finds out; believing an untried engine a little faster
    # (`untried_margin`), a load that holds gets it tried, measured faster, and kept.
    acceptance = [0.9, 0.8, 0.7, 0.6]
    prior = "engine.spec.controller.acceptance_prior=[0.9, 0.8, 0.7, 0.6]"
    ctl, engine, clock = controlled(acceptance, [prior, "engine.spec.controller.replacement.untried_margin=0"])
    engine.busy_overhead[False] = 0.7
    run_until(ctl, engine, clock, 12, lambda: False, 600)
    assert engine.restarts == [] and "beats a plain engine" in ctl.state()["replacement"]

    ctl, engine, clock = controlled(acceptance, [prior])
    engine.busy_overhead[False] = 0.7
    n_off = run_until(ctl, engine, clock, 12, lambda: engine.restarts == [False], 600)
    assert n_off is not None, ctl.state()["replacement"]
    assert n_off > 10 * ctl.replacement_config.dwell_intervals  # tried once the load has held, not at once
    run_until(ctl, engine, clock, 12, lambda: False, 10 * ctl.replacement_config.cooldown_intervals)
    state = ctl.state()
    assert engine.restarts == [False] and state["engine"] == "plain"
    assert state["busy_factor"]["plain"] == pytest.approx(0.7, rel=0.05)
    view = state["restart_view"]  # measured now: the plain engine's time counts as it ran
    assert view["untried_benefit"] == 1.0
    assert view["by_batch_size"][12]["plain_tokens_per_s"] > 1.2 * view["by_batch_size"][12]["speculating_tokens_per_s"]


def test_a_plain_engine_as_fast_as_calibrated_is_tried_at_most_once():
    # The same load with the calibration right: the untried plain engine is tried, found
    # slower than the drafting one, and the drafter comes back for good (two restarts in all).
    acceptance = [0.9, 0.8, 0.7, 0.6]
    ctl, engine, clock = controlled(acceptance, ["engine.spec.controller.acceptance_prior=[0.9, 0.8, 0.7, 0.6]"])
    run_until(ctl, engine, clock, 12, lambda: len(engine.restarts) == 2, 1000)
    assert engine.restarts == [False, True], ctl.state()["replacement"]
    run_until(ctl, engine, clock, 12, lambda: False, 20 * ctl.replacement_config.cooldown_intervals)
    assert engine.restarts == [False, True] and ctl.state()["engine"] == "speculating"


def test_steps_by_k_counts_the_steps_no_interval_has_read_yet():
    # A job shorter than one interval ends before the controller reads a window: what the
    # engine ran still shows in the state the job's summary carries.
    ctl, engine, clock = controlled([0.9, 0.8, 0.7, 0.6])
    assert ctl.state()["steps_by_k"] == {}
    run(ctl, engine, clock, [1, 1])  # two intervals read: 40 steps each at the table's K for one request
    k = ctl.state()["k_in_force"]
    assert ctl.state()["steps_by_k"] == {k: 80}
    for _ in range(3):  # three steps since, at K=2, not read by any interval
        engine.step_window.observe_step(0.0, batch_size=1, num_drafts=1, num_draft_tokens=2, accepted_per_pos=[1, 0])
    assert ctl.state()["steps_by_k"] == {**{k: 80}, 2: 3 + (80 if k == 2 else 0)}
