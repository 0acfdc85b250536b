"""Typed configuration: schema, loading with overrides, vLLM kwargs, resource plan.

Light on purpose: importing `configs` never imports vllm, torch or ray.
"""

from configs.load import ConfigError, dump_config, load_config, preset_names
from configs.plan import ResourcePlan, resource_plan
from configs.schema import AppConfig, EngineConfig, PoolConfig, SamplingDefaults, SpecConfig
from configs.vllm_args import speculative_config, to_vllm_kwargs

__all__ = [
    "AppConfig",
    "ConfigError",
    "EngineConfig",
    "PoolConfig",
    "ResourcePlan",
    "SamplingDefaults",
    "SpecConfig",
    "dump_config",
    "load_config",
    "preset_names",
    "resource_plan",
    "speculative_config",
    "to_vllm_kwargs",
]
