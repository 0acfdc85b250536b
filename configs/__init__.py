"""Typed configuration: schema, loading with overrides, vLLM kwargs, the K rule.

Imports nothing else of the project: the resource plan built from a config is
`control.plan`.

Light on purpose: importing `configs` never imports vllm, torch or ray.
"""

from configs.load import ConfigError, dump_config, load_config, preset_names
from configs.schema import AppConfig, EngineConfig, PoolConfig, SamplingDefaults, SpecConfig
from configs.vllm_args import speculative_config, to_vllm_kwargs

__all__ = [
    "AppConfig",
    "ConfigError",
    "EngineConfig",
    "PoolConfig",
    "SamplingDefaults",
    "SpecConfig",
    "dump_config",
    "load_config",
    "preset_names",
    "speculative_config",
    "to_vllm_kwargs",
]
