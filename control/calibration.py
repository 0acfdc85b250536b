"""Calibrations: a step-cost model plus what it came from, and its file format
(`configs/calibration/*.json`): what the controller and the plan read.

The fits that make the files live with the tools that run them (`tools.fit_calibration`:
from measured step times for `tools.profile_steps`, and the shipped on-paper files from
published tables). Knows nothing about policies, simulation or engines.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from control.model import StepCostModel

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "configs" / "calibration"
STATUSES = ("measured", "on_paper", "placeholder")


@dataclass(frozen=True)
class StepMeasurement:
    """Mean step time of `num_steps` engine steps at one (B, K)."""

    batch_size: int
    num_speculative_tokens: int
    step_time_s: float
    num_context_tokens: float = 0.0  # total over the batch
    num_prefill_tokens: float = 0.0
    num_steps: int = 1
    drafting: str | None = None  # None: the template's; "sequential" for EAGLE-3 rows
    # Seconds of the step by phase (`actors.step_split`): target, draft, other (the rest of
    # the engine core's step) and between_steps (the core's loop between two steps), or
    # None where not measured.
    split_s: dict[str, float] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class Calibration:
    name: str
    status: str  # measured | on_paper | placeholder
    source: str
    cost: StepCostModel | None  # None only for a placeholder
    acceptance_per_pos: tuple[float, ...] = ()  # workload acceptance the source implies
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 0
    max_num_speculative_tokens: int = 11
    notes: str = ""
    measurements: tuple[StepMeasurement, ...] = ()
    fit: dict[str, Any] = field(default_factory=dict)
    # K=0 steps of the speculating engine and of the same engine started without
    # speculation (drafting "none"), side by side at each batch size: what `cost.k0_draft_*`
    # (the drafter's pass on a speculating engine's K=0 steps) is fitted from (k0_pairs).
    plain_measurements: tuple[StepMeasurement, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"calibration status must be one of {STATUSES}, got {self.status!r}")
        if self.cost is None and self.status != "placeholder":
            raise ValueError(f"calibration {self.name!r} has no step_cost but status {self.status!r}")


def save_calibration(cal: Calibration, path: Path) -> None:
    data = asdict(cal)
    data["step_cost"] = data.pop("cost")
    path.write_text(json.dumps(data, indent=2) + "\n")


def calibration_file(name_or_path: str, key: str = "calibration") -> Path:
    """A calibration file: a path to a .json, or a name under configs/calibration. `key`
    names the setting it came from in the error."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return path
    shipped = SHIPPED_DIR / f"{name_or_path}.json"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in SHIPPED_DIR.glob("*.json") if not p.stem.endswith(".residuals"))
    raise ValueError(f"{key}={name_or_path!r} is neither a .json file nor one of {names}")


def load_calibration(path: Path | str, *, allow_placeholder: bool = False) -> Calibration:
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        path = SHIPPED_DIR / path
    data = json.loads(Path(path).read_text())
    cost = data.pop("step_cost", None)
    if data.get("status") == "placeholder" and not allow_placeholder:
        raise ValueError(f"{path} is a placeholder (no measurements fitted yet); "
                         "measure it with `python -m tools.profile_steps` on the hardware, "
                         "or pass allow_placeholder=True")
    for key in ("measurements", "plain_measurements"):
        data[key] = tuple(StepMeasurement(**m) for m in data.get(key, ()))
    data["acceptance_per_pos"] = tuple(data.get("acceptance_per_pos", ()))
    return Calibration(cost=StepCostModel(**cost) if cost else None, **data)
