"""Drafting off by replacement: when an engine should restart without speculation, and back.

A K=0 table is not "no speculation": vLLM 0.32 still runs the drafter's first pass on every
K=0 step (to keep the draft KV cache in sync for when K rises again), so an engine whose
controller has turned drafting off everywhere still pays for its drafter. Only an engine
started without speculation sheds that cost (`StepCostModel.k0_draft_*`, measured against
a plain engine by `tools.profile_steps`), and getting there costs a restart: the engine's
start-up time, measured at each start, during which the host serves nothing.

The rule, on plain numbers:
- **Wanted**: the other engine is predicted to deliver more output tokens than this one,
  by more than `min_gain`, over the load as it ran lately: each recent interval at the
  batch size it ran at, weighed alike (`load_times_per_token_s`). Speculating, that other
  engine is a plain one (where the decided table says K=0 a plain engine wins whenever
  the drafter's pass costs anything; where it drafts, only if the drafts do not pay for
  the drafter); plain, it is the table the controller would run (decided on the last
  acceptance it measured), which must draft somewhere in that load. Weighing the load's
  intervals, not requiring a win at each batch size it touched: a closed loop of c
  clients runs at c and dips to c-1 between requests, and a rule that the other engine
  win at every size seen never fires where the two engines cross between c-1 and c. The
  table alone cannot say "restart": a drafting table can beat drafting off by table (the
  drafter runs either way) and still lose to an engine without the drafter.
- **Worth it**: the load has wanted the switch for `dwell_intervals` in a row, and what the
  switch saves over the expected rest of this load exceeds `cost_margin` x the switch
  cost. With no forecast of the load, the rest is taken to be as long as it has already
  lasted (the time the switch has been wanted): a short burst never pays for a restart, a
  load that has held for a while does.
- **No flapping**: no switch within `cooldown_intervals` of the previous one.

Pure: no Ray, vLLM or clock. `control.live` feeds it each interval and carries
out what it decides (`Engine.restart_engine`); the pool's permission (one host at a time,
never below the healthy minimum) is asked outside this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from control.model import plain_step_time_s, tokens_per_step
from control.step_time import corrected_step_time_s


@dataclass(frozen=True)
class ReplacementConfig:
    min_gain: float = 0.05  # per-token time the other engine must save, as a fraction
    dwell_intervals: int = 5  # intervals in a row the switch must be wanted
    cost_margin: float = 2.0  # saving over the expected rest must exceed this x the switch cost
    cooldown_intervals: int = 20  # intervals after a switch before the next one

    def __post_init__(self) -> None:
        if not 0 <= self.min_gain < 1 or self.dwell_intervals < 1 or self.cost_margin < 0 or self.cooldown_intervals < 0:
            raise ValueError(f"need 0 <= min_gain < 1, dwell_intervals >= 1, cost_margin >= 0, "
                             f"cooldown_intervals >= 0; got {self!r}")


@dataclass(frozen=True)
class ReplacementState:
    speculating: bool = True  # the engine now runs with its drafter
    wanted_intervals: int = 0  # intervals in a row the switch has been wanted
    intervals_since_switch: int = 1 << 30


@dataclass(frozen=True)
class ReplacementDecision:
    switch: bool  # restart the engine now, into `speculating`
    speculating: bool  # what the engine should run after this interval
    saving_fraction: float  # per-token time the other engine saves (< 0: it is slower)
    predicted_saving_s: float  # over the expected rest of this load
    switch_cost_s: float
    reason: str


def decide_replacement(
    state: ReplacementState,
    config: ReplacementConfig,
    *,
    interval_s: float,
    other_faster_at_load: bool,
    time_per_token_now_s: float,
    time_per_token_other_s: float,
    switch_cost_s: float,
) -> tuple[ReplacementDecision, ReplacementState]:
    """One interval. `time_per_token_*`: seconds per output token over the load as it ran
    lately on the engine as it runs now and on the other one (speculating <-> plain;
    `load_times_per_token_s`). `other_faster_at_load`: `other_engine_faster_at_load`."""
    if interval_s <= 0 or switch_cost_s < 0 or time_per_token_now_s <= 0 or time_per_token_other_s <= 0:
        raise ValueError(f"need interval_s > 0, switch_cost_s >= 0 and positive times per token; got "
                         f"{interval_s!r}, {switch_cost_s!r}, {time_per_token_now_s!r}, {time_per_token_other_s!r}")
    since = state.intervals_since_switch + 1
    saving = 1.0 - time_per_token_other_s / time_per_token_now_s
    target = "without speculation" if state.speculating else "with speculation"
    wanted = other_faster_at_load and saving > config.min_gain
    n = state.wanted_intervals + 1 if wanted else 0
    expected_rest_s = n * interval_s
    predicted_s = max(saving, 0.0) * expected_rest_s
    base = dict(saving_fraction=saving, predicted_saving_s=predicted_s, switch_cost_s=switch_cost_s)
    if not wanted:
        why = (("the decided table beats a plain engine over the load as it ran lately"
                if state.speculating else "the table would not draft, or not pay, over the load as it ran lately")
               if not other_faster_at_load else f"an engine {target} would save only {saving:.1%} per token "
               f"(needs > {config.min_gain:.0%})")
        return (ReplacementDecision(False, state.speculating, reason=f"keep the engine: {why}", **base),
                replace(state, wanted_intervals=0, intervals_since_switch=since))
    evidence = (f"an engine {target} saves {saving:.1%} per token at this load, wanted {n} intervals in a row "
                f"({expected_rest_s:.0f} s): {predicted_s:.0f} s saved if the load lasts as long again, "
                f"against a restart of {switch_cost_s:.0f} s (x{config.cost_margin:g} margin)")
    if n < config.dwell_intervals or predicted_s <= config.cost_margin * switch_cost_s:
        return (ReplacementDecision(False, state.speculating, reason=f"restart pending: {evidence}", **base),
                replace(state, wanted_intervals=n, intervals_since_switch=since))
    if since <= config.cooldown_intervals:
        return (ReplacementDecision(False, state.speculating, reason=f"restart held ({since}/"
                                    f"{config.cooldown_intervals} intervals since the last): {evidence}", **base),
                replace(state, wanted_intervals=n, intervals_since_switch=since))
    return (ReplacementDecision(True, not state.speculating, reason=f"restart {target}: {evidence}", **base),
            ReplacementState(speculating=not state.speculating, wanted_intervals=0, intervals_since_switch=0))


def load_times_per_token_s(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """(speculating engine, plain engine) seconds per output token over a load that ran one
    interval at each sample's batch size. `samples`: one per interval, (K the decided table
    gives at that batch size, seconds per output token there speculating, plain). Each
    interval lasts as long as the next, so the load's tokens/s is the mean of its intervals'."""
    if not samples:
        raise ValueError("need at least one interval of the load")
    return (len(samples) / sum(1 / spec_s for _, spec_s, _ in samples),
            len(samples) / sum(1 / plain_s for _, _, plain_s in samples))


def other_engine_faster_at_load(speculating: bool, samples: Sequence[tuple[int, float, float]]) -> bool:
    """Whether the other engine delivers more output tokens over the load as it ran lately
    (`load_times_per_token_s`). Speculating: a plain engine does (K=0 intervals included:
    the drafter's pass is still paid there). Plain: the speculating engine does, and its
    table drafts in some interval of that load (else there is nothing to come back for)."""
    if not samples:
        return False
    spec_s, plain_s = load_times_per_token_s(samples)
    if speculating:
        return plain_s < spec_s
    return any(k > 0 for k, _, _ in samples) and spec_s < plain_s


def times_per_token_s(
    cost, scale: tuple[float, float], acceptance_per_pos, batch_size: int, k: int, context_tokens_per_req: float,
    plain_factor: float = 1.0,
) -> tuple[float, float]:
    """(speculating engine at K, plain engine): seconds per output token at this batch size.
    `scale` = the controller's (base, speculation) step-time corrections, `plain_factor` =
    the plain engine's measured steps over their prediction (1 until measured)."""
    ctx = context_tokens_per_req * batch_size
    base = cost.step_time_s(batch_size, 0, ctx)
    spec_step = corrected_step_time_s(base, cost.step_time_s(batch_size, k, ctx), *scale)
    plain_step = scale[0] * plain_factor * plain_step_time_s(cost, batch_size, ctx)
    return spec_step / (batch_size * tokens_per_step(acceptance_per_pos, k)), plain_step / batch_size
