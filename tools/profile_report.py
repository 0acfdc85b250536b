"""What the profiling job writes and shows: measurements -> a measured calibration.

`measured_calibration` fits `control.model.StepCostModel` to the step times
`tools.profile_steps` measured (NNLS, `tools.fit_calibration.fit_step_cost`) and fills the
calibration's record of where it came from: the machine, the engine config, each
point's repeats and residual. `print_residuals` and `plot` show the fit. Knows nothing
about engines or how the step times were taken.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

from configs import AppConfig
from control.calibration import Calibration
from tools.fit_calibration import fit_step_cost
from control.model import StepCostModel

AGREE = 0.10  # a point is settled when its two fastest runs agree this closely

#: Coefficients a measurement grid can tell apart: with one draft pass per step (P-EAGLE,
#: ngram) the speculation overhead and the draft pass are the same column (their sum is
#: fitted as draft_pass_s); the KV cost needs a second context length.
BASE_COEFFICIENTS = ("fixed_s", "per_token_s", "draft_pass_s", "draft_per_token_s")


def settled(step_times_s: Sequence[float]) -> bool:
    """The two fastest runs of a point agree within AGREE. Load from other processes only
    ever adds time, and rarely the same to two runs a round apart, so agreeing fastest
    runs are what this hardware costs unshared."""
    times = sorted(step_times_s)
    return len(times) >= 2 and times[1] <= times[0] * (1 + AGREE)


def fitted_coefficients(drafting: str, context_varied: bool) -> list[str]:
    names = list(BASE_COEFFICIENTS)
    if drafting == "sequential":
        names.append("spec_overhead_s")
    if context_varied:
        names.append("per_kv_token_s")
    return names


def measured_calibration(cfg: AppConfig, measurements, repeat_step_times_s: Sequence[Sequence[float]], *,
                         name: str, machine: str, kv_capacity_tokens: int, acceptance_per_pos: Sequence[float],
                         context_varied: bool, method: str, extra_fit: dict[str, Any] | None = None):
    """The NNLS fit of the step-cost model to `measurements` (one per grid point, with the
    step time of each of its runs in `repeat_step_times_s`) as a measured Calibration.
    `machine`: what it ran on (`machine_description()`)."""
    spec = cfg.engine.spec
    drafting = "sequential" if spec.method == "eagle3" else "parallel"
    names = fitted_coefficients(drafting, context_varied)
    template = StepCostModel(fixed_s=0.0, per_token_s=0.0, drafting=drafting)
    cost, residuals = fit_step_cost(template, measurements, names)
    rel = [float(r) for r in residuals]
    fit = {
        "method": "NNLS on relative error, weights sqrt(num_steps)",
        "fitted": names,
        "held_at_zero": [n for n in ("per_kv_token_s", "spec_overhead_s", "moe_weight_load_s") if n not in names],
        "rms_relative_residual": round((sum(r * r for r in rel) / len(rel)) ** 0.5, 4),
        "max_abs_relative_residual": round(max(abs(r) for r in rel), 4),
        "num_unsettled_points": sum(not settled(t) for t in repeat_step_times_s),
        "residuals": [
            {"batch_size": m.batch_size, "num_speculative_tokens": m.num_speculative_tokens,
             "num_context_tokens": m.num_context_tokens, "measured_step_time_s": round(m.step_time_s, 6),
             "fitted_step_time_s": round(m.step_time_s * (1 + r), 6), "relative_residual": round(r, 4),
             "repeat_step_times_s": [round(t, 6) for t in repeats], "settled": settled(repeats)}
            for m, r, repeats in zip(measurements, rel, repeat_step_times_s)],
        **(extra_fit or {}),
        "engine": cfg.engine.model_dump(mode="json"),
    }
    return Calibration(
        name=name, status="measured", cost=cost,
        source=f"measured by tools.profile_steps ({time.strftime('%Y-%m-%d')}) on {machine}; "
               f"config {cfg.name}: {cfg.engine.model} + {spec.method} head {spec.head}, {cfg.engine.dtype}",
        acceptance_per_pos=tuple(round(a, 4) for a in acceptance_per_pos), max_num_seqs=cfg.engine.max_num_seqs,
        kv_capacity_tokens=kv_capacity_tokens, max_num_speculative_tokens=spec.num_speculative_tokens,
        notes=method, measurements=tuple(measurements), fit=fit)


def machine_description() -> str:
    """CPU model and cores, torch and vLLM versions (what a step time depends on)."""
    import torch
    import vllm

    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}, vllm {vllm.__version__}, "
            f"python {platform.python_version()}")


def print_residuals(cal) -> None:
    print(f"{cal.name}: fit rms {cal.fit['rms_relative_residual']:.1%}, "
          f"max {cal.fit['max_abs_relative_residual']:.1%}")
    print(f"{'B':>3s} {'K':>2s} {'ctx/req':>8s} {'measured':>9s} {'fitted':>9s} {'resid':>7s}")
    for r in cal.fit["residuals"]:
        print(f"{r['batch_size']:3d} {r['num_speculative_tokens']:2d} "
              f"{r['num_context_tokens'] / r['batch_size']:8.0f} {r['measured_step_time_s'] * 1e3:7.2f}ms "
              f"{r['fitted_step_time_s'] * 1e3:7.2f}ms {r['relative_residual']:+7.1%}")
    c = cal.cost
    print("step cost: " + ", ".join(f"{n}={getattr(c, n) * 1e3:.4g}ms" for n in
                                    ("fixed_s", "per_token_s", "per_kv_token_s", "spec_overhead_s",
                                     "draft_pass_s", "draft_per_token_s")))
    if cal.acceptance_per_pos:
        print("acceptance per position:", list(cal.acceptance_per_pos))


def plot(cal, path: Path, variants: Sequence[str]) -> None:
    """Measured (markers) and fitted (lines) step time against B, one colour per K;
    `variants[i]` says which prompts measurement i used (long ones: hollow, dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ks = sorted({m.num_speculative_tokens for m in cal.measurements})
    for i, k in enumerate(ks):
        for variant, marker, line in (("workload", "o", "-"), ("long", "s", "--")):
            group = sorted((m for m, v in zip(cal.measurements, variants)
                            if m.num_speculative_tokens == k and v == variant), key=lambda m: m.batch_size)
            if not group:
                continue
            b = [m.batch_size for m in group]
            ax.plot(b, [m.step_time_s * 1e3 for m in group], marker, color=f"C{i}",
                    mfc=f"C{i}" if variant == "workload" else "none",
                    label=f"K={k}" + (", long prompts" if variant == "long" else ""))
            ax.plot(b, [cal.cost.step_time_s(m.batch_size, k, m.num_context_tokens) * 1e3 for m in group],
                    line, color=f"C{i}")
    ax.set_xscale("log", base=2)
    batch_sizes = sorted({m.batch_size for m in cal.measurements})
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size B (running requests)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{cal.name}: measured (markers) vs fitted (lines), rms {cal.fit['rms_relative_residual']:.1%}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


