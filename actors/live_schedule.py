"""Change a live engine's batch-size -> K table between two scheduler steps.

vLLM 0.32 reads `num_speculative_tokens_per_batch_size` once, at engine start, into the
scheduler's dense lookup (`Scheduler.dynamic_sd_lookup[B] = K`), and every step takes the
K for its batch size from there and sends it to the workers with that step
(`SchedulerOutput.num_spec_tokens_to_schedule`). It has no call to change the table
afterwards, and a restart would drop the replica's running requests or cost a rolling
replacement (minutes per replica with torch.compile).

So this module adds one engine-core utility method through a vLLM general plugin
(entry point `vllm.general_plugins`, loaded in every vLLM process; outside the engine core
it only adds two methods to a class): `peagle_set_spec_schedule(schedule)` validates a
table with vLLM's own parser, clamps it as vLLM's start-up path does, and swaps the lookup.
Utility calls run on the engine core's own loop between two `schedule()` calls, so a step
is planned wholly with the old table or wholly with the new one, running requests keep
their KV cache, and nothing is dropped or resubmitted. The engine must have been started with a
table (the scheduler only consults a lookup that exists, and vLLM pads differently without
one); which K values a table may then hold is `configs.spec_k.allowed_k`, read here from
the engine's actual settings (CUDA graphs captured or not, parallel drafting, whether
`actors.any_k` is loaded). A table with another K is refused with the reason, never silently changed.

`Engine.set_spec_schedule` is the caller; lossless output at every K, at start-up and
after live changes, is proven by tests/integration/test_live_schedule.py.
"""

from __future__ import annotations

from typing import Any

from actors import any_k, step_split
from configs.spec_k import allowed_k
from control.policy import schedule_from_table

METHOD = "peagle_set_spec_schedule"
GET_METHOD = "peagle_get_spec_schedule"


def _graphs_captured(vllm_config: Any) -> bool:
    if vllm_config.model_config.enforce_eager:
        return False
    if vllm_config.device_config.device_type == "cpu":
        return False
    from vllm.config.compilation import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode != CUDAGraphMode.NONE


def _set_spec_schedule(core: Any, schedule: list[list[int]]) -> dict[str, Any]:
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    sched = core.scheduler
    max_k = getattr(sched, "num_spec_tokens", 0)
    if not max_k:
        raise ValueError("this engine was started without speculative decoding; no K table to change")
    if getattr(sched, "dynamic_sd_lookup", None) is None:
        raise ValueError(
            "this engine was started without num_speculative_tokens_per_batch_size; "
            "start it with a batch-size schedule (engine.spec.schedule or engine.spec.controller) "
            "to change K live")
    if not hasattr(core, "_peagle_allowed_k"):
        core._peagle_allowed_k = allowed_k(
            max_k, sched.dynamic_sd_lookup[1:], graphs_captured=_graphs_captured(core.vllm_config),
            parallel_drafting=bool(core.vllm_config.speculative_config.parallel_drafting),
            any_k_installed=any_k.installed())
    bad = sorted({int(r[2]) for r in schedule} - set(core._peagle_allowed_k))
    if bad:
        raise ValueError(f"K={bad} cannot run on this engine; allowed K values are {core._peagle_allowed_k} "
                         "(none above the start-up K; with CUDA graphs: the start-up table's K values)")
    max_num_seqs = sched.scheduler_config.max_num_seqs
    dense = build_dynamic_sd_schedule_lookup(
        [list(r) for r in schedule], vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=max_k)
    sched.dynamic_sd_lookup = dense
    return _describe(core)


def _describe(core: Any) -> dict[str, Any]:
    sched = core.scheduler
    lookup = getattr(sched, "dynamic_sd_lookup", None)
    max_k = getattr(sched, "num_spec_tokens", 0)
    dense = list(lookup[1:]) if lookup is not None else [max_k] * sched.scheduler_config.max_num_seqs
    return {
        "schedule": [list(r) for r in schedule_from_table(dense)],
        "max_num_speculative_tokens": max_k,
        "live": lookup is not None,
        "allowed_k": list(getattr(core, "_peagle_allowed_k", range(max_k + 1))),
    }


def install() -> None:
    """vLLM general-plugin entry point: give EngineCore the two utility methods, and the
    step-split one (`actors.step_split`). Safe to call many times and in any vLLM process."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, METHOD, None) is None:
        setattr(EngineCore, METHOD, _set_spec_schedule)
        setattr(EngineCore, GET_METHOD, _describe)
    step_split.install()
