"""Speculation controller vs fixed K, a vLLM-style static table and SGLang-style
candidate sets, in the discrete-event simulator (control.simulator).

    python -m benchmarks.controller_sim [--calibration b200-qwen3-coder-30b-a3b.json]
        [--duration-s 20] [--phase-s 15] [--out-dir out/bench]

Prints: the calibration's fit residuals; throughput per policy at concurrency 1..128
(one replica, closed loop, the calibration's code workload) with each policy's ratio to
the best fixed K at that concurrency; the same on two time-varying traces (load only;
load + workload shift) with the model ceiling of each trace and the worst-case ceiling
over any mix of phases (what no policy can exceed). Writes controller_sim.json,
controller_throughput.png and controller_k_over_time.png to --out-dir. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from control.calibration import SHIPPED_DIR, load_calibration
from control.scenarios import (
    SWEEP_CONCURRENCY, best_fixed, chat_workload, code_workload, day_night_trace, load_trace,
    model_ceiling, policy_lineup, run_sweep, run_trace, worst_case_ceiling,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="b200-qwen3-coder-30b-a3b.json")
    ap.add_argument("--duration-s", type=float, default=20.0, help="simulated seconds per sweep point")
    ap.add_argument("--phase-s", type=float, default=15.0, help="simulated seconds per trace phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path("out/bench"))
    args = ap.parse_args(argv)
    t0 = time.time()
    cal = load_calibration(args.calibration)
    code, chat = code_workload(cal), chat_workload(cal.max_num_speculative_tokens)
    policies = policy_lineup(cal)
    print(f"calibration {cal.name} ({cal.status}): {cal.source}")
    residuals = SHIPPED_DIR / f"{cal.name}.residuals.json"
    if residuals.exists():
        rep = json.loads(residuals.read_text())
        print(f"  fit residuals: rms {rep['rms_relative_residual']:.1%}, max |.| {rep['max_abs_relative_residual']:.1%} "
              f"over {len(rep['residuals'])} published points; out of sample: {rep['out_of_sample_check']}")

    sweep = run_sweep(cal, code, policies, SWEEP_CONCURRENCY, args.duration_s, seed=args.seed)
    print(f"\nthroughput, output tokens/s (ratio to the best fixed K at that concurrency), workload {code.name}")
    print(f"{'policy':30s}" + "".join(f"{'c=' + str(c):>16s}" for c in SWEEP_CONCURRENCY))
    best = {c: best_fixed({p: v[c] for p, v in sweep.items()}) for c in SWEEP_CONCURRENCY}
    for name, row in sweep.items():
        print(f"{name:30s}" + "".join(f"{row[c]:>9.0f} ({row[c] / best[c][1]:.2f})" for c in SWEEP_CONCURRENCY))
    print(f"{'best fixed K':30s}" + "".join(f"{best[c][0][6:]:>16s}" for c in SWEEP_CONCURRENCY))

    traces = {"load only (code)": load_trace(code, args.phase_s),
              "load + workload shift (day code, night chat)": day_night_trace(code, chat, args.phase_s)}
    trace_out = {}
    for tname, phases in traces.items():
        res = run_trace(cal, phases, policies, seed=args.seed)
        tps = {p: r.tokens_per_s for p, r in res.items()}
        bname, bval = best_fixed(tps)
        ceiling = model_ceiling(cal, phases)
        print(f"\ntrace '{tname}': {len(phases)} phases x {args.phase_s:.0f} s, concurrency "
              f"{[p.concurrency for p in phases]}; model ceiling {ceiling:.3f}x over the best fixed K")
        for p, v in tps.items():
            print(f"  {p:30s} {v:9.0f} tok/s  {v / bval:.3f}x {bname}")
        trace_out[tname] = {"tokens_per_s": tps, "best_fixed": bname, "model_ceiling": ceiling,
                            "timeline": {p: r.timeline for p, r in res.items()},
                            "controller_changes": [(t, why) for t, why in res["controller"].reasons][:200]}
    worst = {"code": worst_case_ceiling(cal, [code]), "chat": worst_case_ceiling(cal, [chat]),
             "code+chat": worst_case_ceiling(cal, [code, chat])}
    print("\nworst-case model ceiling over any time-mix of phases at c=1..128 (no policy can beat fixed K by more):")
    print("  " + ", ".join(f"{k}: {v:.3f}x" for k, v in worst.items()))

    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"calibration": cal.name, "sweep": sweep, "traces": trace_out, "worst_case_ceiling": worst}
    (args.out_dir / "controller_sim.json").write_text(json.dumps(result, indent=1, default=str))
    _plot(sweep, trace_out, args.out_dir)
    print(f"\nwrote {args.out_dir}/controller_sim.json, controller_throughput.png, controller_k_over_time.png "
          f"({time.time() - t0:.0f} s)")
    return 0


def _plot(sweep, traces, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = sorted(next(iter(sweep.values())))
    best = {c: max(v[c] for p, v in sweep.items() if p.startswith("fixed K=")) for c in cs}
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(13, 5))
    for name, row in sweep.items():
        lw = 2.5 if name == "controller" else 1.2
        ax.plot(cs, [row[c] for c in cs], marker="o", lw=lw, label=name)
        rx.plot(cs, [row[c] / best[c] for c in cs], marker="o", lw=lw, label=name)
    ax.set(yscale="log", ylabel="output tokens/s", title="Throughput vs concurrency per policy (simulated)")
    rx.set(ylabel="ratio to the best fixed K at that concurrency", ylim=(0.4, 1.1), title="Relative to best fixed K")
    rx.axhline(0.97, color="grey", ls=":", lw=1)
    for a in (ax, rx):
        a.set(xscale="log", xlabel="concurrency (one replica)")
        a.set_xticks(cs, labels=[str(c) for c in cs])
        a.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "controller_throughput.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 3.6 * len(traces)), squeeze=False)
    for ax, (tname, tr) in zip(axes[:, 0], traces.items()):
        for pname in ("controller", "SGLang-style candidate sets", "vLLM static table"):
            tl = tr["timeline"][pname]
            ax.step([x[0] for x in tl], [x[2] for x in tl], where="post", label=f"K: {pname}",
                    lw=2 if pname == "controller" else 1)
        ax.set(ylabel="mean K per step", title=f"K over time: {tname}", ylim=(-0.5, 12))
        twin = ax.twinx()
        tl = tr["timeline"]["controller"]
        twin.plot([x[0] for x in tl], [x[3] for x in tl], color="grey", ls=":", label="concurrency")
        twin.set(ylabel="concurrency", yscale="log")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(out_dir / "controller_k_over_time.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
