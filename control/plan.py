"""The config resolved once, at the door (`resolve` -> `RunPlan`): the engine config
each kind of host starts, and the resource plan: how many engine actors, what each holds,
and how they pack onto nodes. No host derives an engine config again; the engine facade
refuses one that was not resolved (`actors.engine.Engine`).

Pure arithmetic over `AppConfig`; printed by `--dry-run` and used to set each actor's
Ray resources, so the plan shown is the plan run. Given the work (rows x output tokens),
`resource_plan` also estimates, from the pool's step-cost calibration, what one engine
delivers and how long the work takes, and with `pool.deadline_hours` sizes the pool's max
to the engines the deadline needs (`control.capacity` does the arithmetic). Where the
controller may run its engines without the drafter and the estimate finds an engine kept
full faster so, the plan starts them that way (`engines_start_plain`, `engine_config`):
a batch job fills its engines from the first row, so waiting to restart would only cost.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from configs.schema import AppConfig, EngineConfig, SpecConfig
from configs.vllm_args import live_k_values
from control.calibration import calibration_file, load_calibration
from control.capacity import batch_pool_size, full_engine_throughput
from control.live import startup_schedule


@dataclass(frozen=True)
class ResourcePlan:
    device: str
    min_actors: int
    max_actors: int
    cpus_per_actor: float
    gpus_per_actor: int
    tensor_parallel_size: int
    accelerator_type: str | None
    actors_per_node: int | None
    nodes_for_max_actors: int | None
    # On paper, for the work the plan was made for (None: no work given, or no calibration).
    capacity: dict[str, Any] | None = None
    # The estimate found an engine kept full faster without its drafter, and the controller
    # may bring the drafter back: the engines start plain (`engine_config`).
    engines_start_plain: bool = False

    def engine_config(self, cfg: AppConfig) -> AppConfig:
        """`cfg` as this plan's engines start: without the drafter where the plan says so."""
        if not self.engines_start_plain:
            return cfg
        out = cfg.model_copy(deep=True)
        out.engine.spec.controller.replacement.start_speculating = False
        return out

    def ray_actor_options(self) -> dict[str, Any]:
        """Resources one engine actor requests from Ray."""
        opts: dict[str, Any] = {"num_cpus": self.cpus_per_actor, "num_gpus": self.gpus_per_actor}
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        per = (
            f"{self.gpus_per_actor} GPU (TP={self.tensor_parallel_size}) + {self.cpus_per_actor:g} CPU"
            if self.device == "gpu"
            else f"{self.cpus_per_actor:g} CPU"
        )
        line = f"{self.min_actors}..{self.max_actors} actors x [{per}]"
        if self.actors_per_node is not None:
            line += (
                f"; {self.actors_per_node} actors per {self.accelerator_type or 'GPU'} node, "
                f"{self.nodes_for_max_actors} node(s) at max"
            )
        if self.capacity is not None:
            line += f"; on paper ({self.capacity['calibration']}): {self.capacity['reason']}"
        if self.engines_start_plain:
            line += ("; engines start without the drafter (faster kept full, on paper; the controller "
                     "brings it back when drafting pays)")
        return line


@dataclass(frozen=True)
class RunPlan:
    """What a run starts, resolved once from the loaded config."""

    resources: ResourcePlan
    batch: AppConfig  # the batch job's engines: start-up table, and started plain where `resources` say
    serve_engine: EngineConfig  # a Serve replica's engine: start-up table, the replica's step budget


def resolve(cfg: AppConfig, num_rows: int | None = None) -> RunPlan:
    """The door: `cfg` as every host runs it (`num_rows`: the rows a job has to run, for
    the capacity estimate)."""
    resources = resource_plan(cfg, num_rows)
    batch = resources.engine_config(cfg)
    return RunPlan(resources, batch.model_copy(update={"engine": startup_engine(batch.engine)}),
                   startup_engine(serve_engine(cfg)))


def startup_engine(engine: EngineConfig) -> EngineConfig:
    """`engine` as it starts: with a controller and no `schedule`, the table the
    controller would choose first (`control.live.startup_schedule`) filled in, so a dry
    run shows it and the first step already runs a sensible K at every batch size."""
    if engine.spec.controller is None or engine.spec.schedule is not None:
        return engine
    out = engine.model_copy(deep=True)
    out.spec.schedule = startup_schedule(engine)
    return out


def serve_engine(cfg: AppConfig) -> EngineConfig:
    """The engine config a Serve replica runs (before `startup_engine`): the engine's,
    with the replica's step budget."""
    if cfg.serve.max_num_batched_tokens is None:
        return cfg.engine
    return cfg.engine.model_copy(update={"max_num_batched_tokens": cfg.serve.max_num_batched_tokens})


def resource_plan(cfg: AppConfig, num_rows: int | None = None) -> ResourcePlan:
    """The plan for `cfg`; with `num_rows` (the rows a job has to run) also its capacity
    estimate, and the pool sized to `pool.deadline_hours` where one is set."""
    pool, tp = cfg.pool, cfg.engine.tensor_parallel_size
    gpus = tp if pool.device == "gpu" else 0
    per_node = pool.gpus_per_node // gpus if gpus and pool.gpus_per_node else None
    low, top, capacity = pool.min_actors, pool.max_actors, None
    if num_rows is not None:
        capacity = capacity_estimate(cfg, num_rows)
        if capacity is not None:
            low, top = capacity["min_actors"], capacity["max_actors"]
    return ResourcePlan(
        device=pool.device,
        min_actors=low,
        max_actors=top,
        cpus_per_actor=pool.cpus_per_actor,
        gpus_per_actor=gpus,
        tensor_parallel_size=tp,
        accelerator_type=pool.accelerator_type,
        actors_per_node=per_node,
        nodes_for_max_actors=math.ceil(top / per_node) if per_node else None,
        capacity=capacity,
        engines_start_plain=bool(capacity and not capacity["engine_drafter"] and cfg.engine.spec.method != "none"),
    )


def _k_choices(engine: EngineConfig) -> tuple[list[int], int, bool]:
    """(K values this engine may run at full batch, its start-up K, whether a plain engine
    is one of its options)."""
    spec, max_num_seqs = engine.spec, engine.max_num_seqs
    if spec.method == "none":
        return [], 0, True
    k = spec.num_speculative_tokens or 0
    if spec.controller is not None:  # what it may put in force (P-EAGLE: 0 or k), or no drafter
        return live_k_values(engine), k, spec.controller.replacement.enabled
    if spec.schedule:
        at_full = [kk for lo, hi, kk in spec.schedule if lo <= max_num_seqs <= hi]
        return [at_full[0] if at_full else spec.schedule[-1][2]], k, False  # past the table: its last K
    return [k], k, False


def capacity_estimate(cfg: AppConfig, num_rows: int) -> dict[str, Any] | None:
    """What the pool's calibration says about `num_rows` rows: one engine's tokens/s kept
    full, the pool's bounds (sized to the deadline where one is set) and the hours at each.
    None where the config names no calibration."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows!r}")
    name = cfg.capacity_calibration()
    if name is None:
        return None
    cal = load_calibration(calibration_file(name, "pool.calibration"))
    per_row = cfg.pool.output_tokens_per_row or cfg.sampling.max_tokens
    # a running request's context, averaged over its decode: half its output (prompts unknown here)
    engine = _full_engine(cfg, cal, num_context_tokens_per_req=per_row / 2)
    deadline_h = cfg.pool.deadline_hours
    size = batch_pool_size(num_rows * per_row, engine.tokens_per_s, min_actors=cfg.pool.min_actors,
                           max_actors=cfg.pool.max_actors,
                           deadline_s=deadline_h * 3600.0 if deadline_h is not None else None)
    return {
        "calibration": cal.name,
        "calibration_status": cal.status,
        "rows": num_rows,
        "output_tokens_per_row": per_row,
        "output_tokens": num_rows * per_row,
        "engine_batch_size": engine.batch_size,
        "engine_drafter": engine.drafter,
        "engine_num_speculative_tokens": engine.num_speculative_tokens if engine.drafter else None,
        "engine_tokens_per_s": round(engine.tokens_per_s, 1),
        # what a prompt token costs in prefill (the calibration's per batched token): the
        # job's summary adds the prefill of the prompts it actually ran to the paper
        "prefill_s_per_token": cal.cost.per_token_s,
        "deadline_hours": deadline_h,
        "engines_needed": size.engines_needed,
        "min_actors": size.min_actors,
        "max_actors": size.max_actors,
        "hours_at_max_actors": round(size.hours_at_max, 4),
        "hours_at_min_actors": round(size.hours_at_min, 4),
        "reason": size.reason,
    }


def _full_engine(cfg: AppConfig, cal, num_context_tokens_per_req: float):
    k_choices, start_k, plain = _k_choices(cfg.engine)
    return full_engine_throughput(
        cal.cost, _expected_acceptance(cfg.engine.spec, cal.acceptance_per_pos), k_choices, start_k=start_k,
        max_num_seqs=cfg.engine.max_num_seqs, kv_capacity_tokens=cal.kv_capacity_tokens,
        num_context_tokens_per_req=num_context_tokens_per_req, plain_engine=plain)


def run_engine_tokens_per_s(cfg: AppConfig, prompt_tokens_per_row: float, output_tokens_per_row: float) -> float | None:
    """One engine kept full, on paper, for a finished run's own rows: each running
    request's context is its prompt plus half its output. The estimate before a run knows
    neither (half of `max_tokens`); at batch 32 on the tiny preset the prompts' KV alone
    moves a decode step by a third. None where the config names no calibration."""
    if prompt_tokens_per_row < 0 or output_tokens_per_row < 0:
        raise ValueError(f"tokens per row must be >= 0, got prompt {prompt_tokens_per_row!r}, "
                         f"output {output_tokens_per_row!r}")
    name = cfg.capacity_calibration()
    if name is None:
        return None
    cal = load_calibration(calibration_file(name, "pool.calibration"))
    return _full_engine(cfg, cal, prompt_tokens_per_row + output_tokens_per_row / 2).tokens_per_s


def _expected_acceptance(spec: SpecConfig, calibrated: list[float] | None) -> list[float]:
    """Per-position acceptance the estimate assumes: the synthetic rates where the engine
    is told to accept at those, else the controller's prior (what it starts deciding
    from), else the calibration's measurement."""
    for rates in (spec.synthetic_acceptance_rates, spec.controller and spec.controller.acceptance_prior, calibrated):
        if rates:
            return list(rates)
    return []
