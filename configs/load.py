"""Loading a config: a YAML file or preset name, plus typed `a.b=value` overrides.

Owns how text becomes an `AppConfig` (YAML parsing, preset lookup, override merging,
turning pydantic errors into one readable message). Knows nothing about what the
fields mean; that lives in `configs.schema`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from configs.schema import AppConfig

PRESETS_DIR = Path(__file__).resolve().parent / "presets"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key and value."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A path to a YAML file, or the name of a preset in configs/presets."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if preset.is_file():
        return preset
    raise ConfigError(
        f"config {name_or_path!r} is neither a file nor a preset; presets: {preset_names()}"
    )


def parse_override(text: str) -> tuple[list[str], Any]:
    """`engine.spec.num_speculative_tokens=7` -> (["engine", "spec", ...], 7).
    The value is read as YAML, so numbers, booleans, null and lists keep their types."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override must look like a.b=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return out


def build_config(data: dict[str, Any], source: str = "<dict>") -> AppConfig:
    try:
        return AppConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<root>"
            shown = f" (got {err['input']!r})" if "input" in err and err["type"] != "missing" else ""
            problems.append(f"  {where}: {err['msg']}{shown}")
        raise ConfigError(f"invalid config {source}:\n" + "\n".join(problems)) from None


def load_config(name_or_path: str, overrides: list[str] | None = None) -> AppConfig:
    path = resolve_config_path(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {str(path)!r} must be a mapping, got {type(data).__name__}")
    return build_config(apply_overrides(data, overrides or []), source=str(path))


def dump_config(cfg: AppConfig) -> str:
    """The resolved config as YAML, written next to job outputs."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
