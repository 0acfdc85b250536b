"""The single translation from `EngineConfig` to vLLM engine keyword arguments.

This is the only place that knows vLLM's argument names. "P-EAGLE" becomes
`{"method": "eagle3", "parallel_drafting": True, ...}` here and nowhere else. The result
is plain data (JSON-serializable), so `--dry-run` can print it without importing vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from configs.schema import EngineConfig, SpecConfig
from configs.spec_k import allowed_k

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_model_path(name: str) -> str:
    """A relative path that exists under the repo root becomes absolute (actors may run
    in another working directory); anything else (a hub id) is returned unchanged."""
    path = Path(name)
    if not path.is_absolute() and (REPO_ROOT / path).exists():
        return str(REPO_ROOT / path)
    return name


def speculative_config(spec: SpecConfig) -> dict[str, Any] | None:
    """vLLM `speculative_config` for a spec block, or None when speculation is off."""
    if spec.method == "none":
        return None
    out: dict[str, Any] = {"num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method in ("peagle", "eagle3"):
        out["method"] = "eagle3"
        out["model"] = resolve_model_path(spec.head)
        if spec.method == "peagle":
            out["parallel_drafting"] = True
    elif spec.method == "ngram":
        out["method"] = "ngram"
        out["prompt_lookup_min"] = spec.ngram_min
        out["prompt_lookup_max"] = spec.ngram_max
    if spec.schedule is not None:
        out["num_speculative_tokens_per_batch_size"] = [list(r) for r in spec.schedule]
    if spec.synthetic_acceptance_rates is not None:
        out["rejection_sample_method"] = "synthetic"
        out["synthetic_acceptance_rates"] = list(spec.synthetic_acceptance_rates)
    return out


def live_k_values(engine: EngineConfig) -> list[int]:
    """The K values this engine can run per step, from its config (`configs.spec_k`'s
    rule): graphs are captured unless the engine is eager, and P-EAGLE runs through the
    project's plugin `actors.any_k`, which lays the parallel draft pass out per step."""
    spec = engine.spec
    return allowed_k(spec.num_speculative_tokens or 0, (k for _, _, k in spec.schedule or []),
                     graphs_captured=not engine.enforce_eager, parallel_drafting=spec.method == "peagle")


def to_vllm_kwargs(engine: EngineConfig) -> dict[str, Any]:
    """Keyword arguments for `vllm.AsyncEngineArgs` / `vllm.LLM`."""
    kwargs: dict[str, Any] = {
        "model": resolve_model_path(engine.model),
        "dtype": engine.dtype,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "enforce_eager": engine.enforce_eager,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "scheduling_policy": engine.scheduling_policy,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "seed": engine.seed,
        # Spec-decode counters come from vLLM's stat loggers; they only run with stats on.
        "disable_log_stats": False,
    }
    optional = {
        "tokenizer": resolve_model_path(engine.tokenizer) if engine.tokenizer else None,
        "quantization": engine.quantization,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "block_size": engine.block_size,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "speculative_config": speculative_config(engine.spec),
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    clash = sorted(set(engine.extra_engine_kwargs) & (set(kwargs) | set(optional)))
    if clash:
        raise ValueError(
            f"engine.extra_engine_kwargs repeats keys the config already sets: {clash!r}; "
            "set them through their typed fields"
        )
    kwargs.update(engine.extra_engine_kwargs)
    return kwargs
