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

from configs.schema import AppConfig, ScoringConfig

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


# Which `engine.spec` fields each method uses; switching method by override drops the
# file's fields the new method does not use (the override's own are kept, and checked).
SPEC_FIELDS_BY_METHOD = {
    "none": {"method"},
    "ngram": {"method", "num_speculative_tokens", "schedule", "synthetic_acceptance_rates", "controller",
              "ngram_min", "ngram_max"},
    "peagle": {"method", "head", "num_speculative_tokens", "schedule", "synthetic_acceptance_rates", "controller"},
    "eagle3": {"method", "head", "num_speculative_tokens", "schedule", "synthetic_acceptance_rates", "controller"},
}


def apply_overrides(data: dict[str, Any], overrides: list[str], notes: list[str] | None = None) -> dict[str, Any]:
    """The file's data with the overrides applied in order. An override of
    `engine.spec.method` also drops the file's spec fields the new method does not use
    (`engine.spec.method=none` alone turns speculation off); each drop is added to `notes`."""
    out = copy.deepcopy(data)
    overridden = {tuple(parse_override(t)[0]) for t in overrides}
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
        if path == ["engine", "spec", "method"] and value in SPEC_FIELDS_BY_METHOD:
            _drop_unused_spec_fields(node, value, overridden, notes)
    return out


def _drop_unused_spec_fields(spec: dict[str, Any], method: str, overridden: set, notes: list[str] | None) -> None:
    for name in sorted(set(spec) - SPEC_FIELDS_BY_METHOD[method]):
        if ("engine", "spec", name) in overridden:
            continue  # given on the command line with the method: validated, not dropped
        dropped = spec.pop(name)
        if notes is not None:
            notes.append(f"engine.spec.method={method}: dropped engine.spec.{name}={dropped!r} from the "
                         f"config file (method {method!r} does not use it)")


def build_config(data: dict[str, Any], source: str = "<dict>") -> AppConfig:
    return _validated(AppConfig, data, f"invalid config {source}")


def split_scoring_overrides(overrides: list[str]) -> tuple[list[str], ScoringConfig]:
    """`scoring.*` overrides alone -> a validated `ScoringConfig` (unknown keys rejected,
    named), and the other overrides. Jobs read `AppConfig.scoring`; this is for callers
    that build scoring options without a whole config."""
    mine = [o[len("scoring."):] for o in overrides if o.startswith("scoring.")]
    rest = [o for o in overrides if not o.startswith("scoring.")]
    return rest, _validated(ScoringConfig, apply_overrides({}, mine), "invalid scoring options", prefix="scoring.")


def _validated(model: type, data: dict[str, Any], what: str, prefix: str = ""):
    """`model` validated from `data`, or a ConfigError naming every bad key and value."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = prefix + (".".join(str(p) for p in err["loc"]) or "<root>")
            shown = f" (got {err['input']!r})" if "input" in err and err["type"] != "missing" else ""
            problems.append(f"  {where}: {err['msg']}{shown}")
        raise ConfigError(f"{what}:\n" + "\n".join(problems)) from None


MAX_EXTENDS_DEPTH = 4


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, mappings merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def read_config_data(name_or_path: str, _depth: int = 0) -> dict[str, Any]:
    """A config file's mapping, with `extends: OTHER` (a preset name or a path) resolved:
    the file's keys merged on top of OTHER's, so a preset states only what it changes."""
    path = resolve_config_path(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {str(path)!r} must be a mapping, got {type(data).__name__}")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str) or _depth >= MAX_EXTENDS_DEPTH:
        raise ConfigError(f"config {str(path)!r}: extends must name one preset or file, at most "
                          f"{MAX_EXTENDS_DEPTH} deep; got {base!r}")
    return _merged(read_config_data(base, _depth + 1), data)


def load_config(name_or_path: str, overrides: list[str] | None = None) -> AppConfig:
    path = resolve_config_path(name_or_path)
    data = read_config_data(name_or_path)
    notes: list[str] = []
    cfg = build_config(apply_overrides(data, overrides or [], notes), source=str(path))
    cfg.notes.extend(notes)
    return cfg


def dump_config(cfg: AppConfig) -> str:
    """The resolved config as YAML, written next to job outputs."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
