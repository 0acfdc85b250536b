"""Codegen throughput, side by side in one run: bare vLLM vs this pipeline vs ray.data.llm.

    python -m benchmarks.codegen_throughput [--config tiny] [a.b=value ...]
        [--limit N] [--max-tokens N] [--num-shards 4] [--arms bare,pipeline,ray_data_llm]

The same HumanEval prompts, the same engine (`configs.to_vllm_kwargs(cfg.engine)`) and the
same sampling values (`actors.requests.resolved_sampling` over `cfg.sampling`) go through:

  bare          `vllm.LLM(**kwargs).generate(prompts, SamplingParams(...))`, all prompts in
                one call (vLLM batches up to max_num_seqs itself).
  pipeline      `jobs.codegen.run_codegen(cfg)`: prompts written as JSONL shards to a local
                temp dir, results committed to a fresh local output dir.
  ray_data_llm  `ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))` on
                `ray.data.from_items` of the raw prompts, engine stage only (no chat
                template, tokenize or detokenize stage: vLLM tokenizes and detokenizes
                itself, as in the other two arms), library defaults for batching.

Each arm runs in its own subprocess, one after the other, so vLLM's process-wide settings
and Ray sessions never leak between arms. Two times per arm, both on the driver's clock:
  generation_s  first work at the engine -> every completion in the driver's hands (bare:
                around `generate`; pipeline: first batch at its engine stage ->
                `run_codegen` returned; ray_data_llm: first request's arrival at the
                engine -> rows collected).
  e2e_s         engine construction (job start) -> done; Ray start-up excluded (reported).
Output tokens are the sum of generated token ids in every arm. Ratios compare generation
tokens/s. Every engine gets the same OMP_NUM_THREADS (see `omp_threads`). Each row also
says how much CPU other processes took meanwhile (`CpuMeter`): on a shared 2-core box that
is the main source of noise. Writes out/bench/codegen_throughput.{json,png} + arm logs.
Owns measuring; knows nothing about how the pipeline or the engine work inside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

from benchmarks.codegen_arms import child_main, humaneval_prompts, knobs, sampling_values
from configs import AppConfig, to_vllm_kwargs
from jobs.cli import parse_config, parser

REPO_ROOT = Path(__file__).resolve().parent.parent
ARMS = ("bare", "pipeline", "ray_data_llm")
LABELS = {"bare": "bare vllm.LLM", "pipeline": "this pipeline", "ray_data_llm": "ray.data.llm"}
GOALS = {"bare": 0.90, "ray_data_llm": 1.10}  # pipeline tokens/s over each arm's
TERM_GRACE_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__.strip().splitlines()[0])
    p.add_argument("--limit", type=int, default=None, help="first N HumanEval problems (default all 164)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per prompt (default cfg.sampling.max_tokens)")
    p.add_argument("--num-shards", type=int, default=4, help="JSONL shards / Ray Data blocks of input (default 4)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--arm-timeout-s", type=float, default=900.0, help="kill an arm after this long (default 900)")
    p.add_argument("--omp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every arm's engine; default: $OMP_NUM_THREADS if set, "
                   "else on CPU floor(pool.cpus_per_actor), the count Ray gives the two Ray arms' "
                   "engine actors; 0: leave it unset (each library's own default)")
    p.add_argument("--wait-idle-s", type=float, default=0.0,
                   help="before each arm, wait up to this long for the CPUs to be < 25%% busy (default 0: don't)")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "out" / "bench"), help="where the JSON, PNG and logs go")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p


def resolve_config(args: argparse.Namespace) -> AppConfig:
    if args.max_tokens is not None:
        args.overrides = [*args.overrides, f"sampling.max_tokens={args.max_tokens}"]
    return parse_config(args)


def omp_threads(args: argparse.Namespace, cfg: AppConfig) -> int | None:
    """Intra-op threads for every engine. Ray sets OMP_NUM_THREADS to an actor's CPU
    reservation when it is unset, so the Ray arms' engines get floor(cpus_per_actor);
    the bare engine would otherwise take every core (vLLM's CPU worker then refuses its
    own reduction to 1), which compares resources, not pipelines."""
    if args.omp_threads is not None:
        return args.omp_threads or None
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, int(cfg.pool.cpus_per_actor)) if cfg.pool.device == "cpu" else None



# -- how busy the machine was: other work on a 2-core box skews an arm badly -----------------


def _busy_cpu_s() -> float:
    """Machine-wide busy CPU seconds so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Samples, while an arm runs, the machine's busy CPU time and that of the arm's own
    process tree (the child, its Ray processes and vLLM engine cores); the difference is
    CPU taken by other work. Linux /proc only; elsewhere it reports nothing."""

    def __init__(self, root_pid: int, interval_s: float = 1.0):
        self.root_pid, self.interval_s = root_pid, interval_s
        self.tree_ticks: dict[tuple[int, int], int] = {}  # (pid, start time) -> utime+stime
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = os.path.exists("/proc/stat")

    def __enter__(self) -> Self:
        if self.available:
            self._busy0, self._t0 = _busy_cpu_s(), time.monotonic()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.available:
            self._stop.set()
            self._thread.join(timeout=5)
            self._busy_s, self._wall_s = _busy_cpu_s() - self._busy0, time.monotonic() - self._t0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_tree()

    def _sample_tree(self) -> None:
        procs = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            procs[int(entry)] = (int(rest[1]), int(rest[19]), int(rest[11]) + int(rest[12]))
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.root_pid]
        while todo:
            pid = todo.pop()
            if pid in procs:
                _, started, ticks = procs[pid]
                key = (pid, started)
                self.tree_ticks[key] = max(self.tree_ticks.get(key, 0), ticks)
            todo += children.get(pid, [])

    def report(self) -> dict[str, float]:
        if not self.available:
            return {}
        arm_s = sum(self.tree_ticks.values()) / os.sysconf("SC_CLK_TCK")
        other_s = max(0.0, self._busy_s - arm_s)
        return {"arm_cpu_s": round(arm_s, 1), "other_cpu_s": round(other_s, 1),
                "other_cpu_frac": round(other_s / (self._wall_s * (os.cpu_count() or 1)), 3)}


def wait_for_idle(limit_s: float, max_busy_frac: float = 0.25, sample_s: float = 5.0) -> bool:
    """Wait (at most limit_s) until the machine's CPUs are less than max_busy_frac busy over
    a sample_s window. True if it got there."""
    deadline = time.monotonic() + limit_s
    while True:
        busy0 = _busy_cpu_s()
        time.sleep(sample_s)
        frac = (_busy_cpu_s() - busy0) / (sample_s * (os.cpu_count() or 1))
        if frac < max_busy_frac:
            return True
        if time.monotonic() + sample_s > deadline:
            return False


# -- the driver: run the arms one after the other, compare ---------------------------------


def _child_command(args: argparse.Namespace, arm: str, result: Path, workdir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.codegen_throughput", "--arm", arm,
           "--result", str(result), "--workdir", str(workdir), "--config", args.config,
           "--num-shards", str(args.num_shards)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    return cmd + list(args.overrides)  # already holds sampling.max_tokens if given


def run_arm(args: argparse.Namespace, arm: str, tmp: Path, log_dir: Path) -> dict[str, Any]:
    """One arm in a fresh process (its own session, so a timeout ends all it started)."""
    result, workdir, log_path = tmp / f"{arm}.json", tmp / arm, log_dir / f"{arm}.log"
    env = {**os.environ, "RAY_DATA_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # each Ray arm starts its own local cluster
    env.pop("OMP_NUM_THREADS", None)
    if args.omp_threads:  # resolved in main; Ray's workers inherit it from the child
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    idle = None
    if args.wait_idle_s > 0:
        print(f"[bench] {arm}: waiting up to {args.wait_idle_s:.0f}s for an idle machine", flush=True)
        idle = wait_for_idle(args.wait_idle_s)
    print(f"[bench] {arm}: start (log {log_path})", flush=True)
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_child_command(args, arm, result, workdir), cwd=REPO_ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with CpuMeter(proc.pid) as meter:
                rc = proc.wait(timeout=args.arm_timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
        except BaseException:  # Ctrl-C or SIGTERM (see main): leave nothing running behind
            _stop_group(proc)
            raise
    wall_s = time.monotonic() - started
    # Other work on the machine skews an arm; the 1-minute load average says how busy it was.
    load = {"load_1m_start": round(load_start, 2), "load_1m_end": round(os.getloadavg()[0], 2),
            "started_idle": idle, **meter.report()}
    if rc != 0 or not result.exists():
        why = f"timed out after {args.arm_timeout_s:.0f}s" if rc is None else f"exit status {rc}"
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        print(f"[bench] {arm}: FAILED ({why}); last log lines:\n{tail}", flush=True)
        return {"arm": arm, "failed": why, "wall_s": wall_s, **load}
    out = {"arm": arm, **json.loads(result.read_text()), "wall_s": wall_s, **load}
    out["output_tokens_per_s"] = out["num_output_tokens"] / out["generation_s"]
    print(f"[bench] {arm}: done in {wall_s:.0f}s: {len(out['texts'])} completions, "
          f"{out['num_output_tokens']} output tokens, {out['output_tokens_per_s']:.0f} tok/s "
          f"(other work took {100 * load.get('other_cpu_frac', float('nan')):.0f}% of the CPUs)", flush=True)
    return out


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, TERM_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def compare(results: dict[str, dict[str, Any]], num_prompts: int) -> list[dict[str, Any]]:
    """One table row per arm; ratios of generation tokens/s (and of end-to-end tokens/s)."""
    ok = {a: r for a, r in results.items() if "failed" not in r}
    bare_texts = ok.get("bare", {}).get("texts")
    rows = []
    for arm, r in results.items():
        if "failed" in r:
            rows.append({"arm": arm, "failed": r["failed"]})
            continue
        row = {
            "arm": arm,
            "completions": len(r["texts"]),
            "errors": r["num_errors"],
            "prompt_tokens": r["num_prompt_tokens"],
            "output_tokens": r["num_output_tokens"],
            "generation_s": round(r["generation_s"], 2),
            "tokens_per_s": round(r["output_tokens_per_s"], 1),
            "e2e_s": round(r["e2e_s"], 2),
            "e2e_tokens_per_s": round(r["num_output_tokens"] / r["e2e_s"], 1),
            "startup_s": round(r["e2e_s"] - r["generation_s"], 2),
            "ray_init_s": round(r["ray_init_s"], 2) if "ray_init_s" in r else None,
            "dispatch_gap_s": round(r["dispatch_gap_s"], 2) if "dispatch_gap_s" in r else None,
            "mean_acceptance_length": r.get("mean_acceptance_length"),
            "same_text_as_bare": (sum(bare_texts.get(t) == x for t, x in r["texts"].items())
                                  if bare_texts is not None else None),
            "complete": len(r["texts"]) == num_prompts and r["num_errors"] == 0,
            **{k: r.get(k) for k in ("load_1m_start", "load_1m_end", "started_idle",
                                      "arm_cpu_s", "other_cpu_s", "other_cpu_frac")},
        }
        for ref in ("bare", "ray_data_llm"):
            if ref in ok:
                row[f"ratio_vs_{ref}"] = round(r["output_tokens_per_s"] / ok[ref]["output_tokens_per_s"], 3)
                row[f"e2e_ratio_vs_{ref}"] = round(
                    (r["num_output_tokens"] / r["e2e_s"]) / (ok[ref]["num_output_tokens"] / ok[ref]["e2e_s"]), 3)
        rows.append(row)
    return rows


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("arm", "completions", "output tok", "gen s", "tok/s", "e2e s", "e2e tok/s",
            "vs bare", "vs ray.data.llm", "others' CPU")
    lines = [head]
    for r in rows:
        if "failed" in r:
            lines.append((LABELS[r["arm"]], f"FAILED: {r['failed']}", *[""] * (len(head) - 2)))
            continue
        lines.append((LABELS[r["arm"]], str(r["completions"]), str(r["output_tokens"]),
                      f"{r['generation_s']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['e2e_s']:.1f}",
                      f"{r['e2e_tokens_per_s']:.0f}", _ratio(r, "ratio_vs_bare"),
                      _ratio(r, "ratio_vs_ray_data_llm"),
                      f"{100 * r['other_cpu_frac']:.0f}%" if r.get("other_cpu_frac") is not None else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    by_arm = {r["arm"]: r for r in rows}
    pipe = by_arm.get("pipeline", {})
    out = []
    for ref, goal in GOALS.items():
        key = f"ratio_vs_{ref}"
        if key in pipe and ref in by_arm:
            verdict = "met" if pipe[key] >= goal else "NOT met"
            out.append(f"goal pipeline >= {goal:.2f}x {LABELS[ref]}: {pipe[key]:.3f}x ({verdict})")
    return out


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "failed" not in r]
    x = range(len(done))
    fig, ax = plt.subplots(figsize=(7, 4))
    gen = ax.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in done], 0.4, label="generation tok/s")
    ax.bar([i + 0.2 for i in x], [r["e2e_tokens_per_s"] for r in done], 0.4, label="end-to-end tok/s")
    for bar, r in zip(gen, done):
        notes = [f"{r[k]:.2f}x {name}" for k, name in (("ratio_vs_bare", "bare"), ("ratio_vs_ray_data_llm", "rdl"))
                 if k in r and r["arm"] not in k]
        ax.annotate("\n".join(notes), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [LABELS[r["arm"]] for r in done])
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(0, 1.2 * max(r["tokens_per_s"] for r in done))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = resolve_config(args)
    if args.arm:
        return child_main(args, cfg)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        print(f"error: --arms must name some of {list(ARMS)}, got {args.arms!r}", file=sys.stderr)
        return 2
    args.omp_threads = omp_threads(args, cfg)
    num_prompts = len(humaneval_prompts(args.limit))
    setup = {"config": args.config, "overrides": args.overrides, "num_prompts": num_prompts,
             "omp_num_threads": args.omp_threads,
             "sampling": sampling_values(cfg), "vllm_kwargs": to_vllm_kwargs(cfg.engine),
             "knobs": {a: k for a, k in knobs(cfg, args.num_shards).items() if a in arms},
             "cpu_count": os.cpu_count()}
    if args.dry_run:
        print(json.dumps(setup, indent=2))
        return 0
    # SIGTERM as SystemExit, so a running arm is stopped too; restored for run_all's next one.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_all_arms(args, arms, setup)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all_arms(args: argparse.Namespace, arms: list[str], setup: dict[str, Any]) -> int:
    num_prompts = setup["num_prompts"]
    out_dir = Path(args.out_dir)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[bench] codegen throughput: {num_prompts} prompts, max_tokens={setup['sampling']['max_tokens']}, "
          f"OMP_NUM_THREADS={args.omp_threads or 'unset'}, config {args.config} {' '.join(args.overrides)}".rstrip(),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-codegen-") as tmp:
        results = {arm: run_arm(args, arm, Path(tmp), log_dir) for arm in arms}
    rows = compare(results, num_prompts)
    print()
    print(format_table(rows))
    for line in goal_lines(rows):
        print(line)
    incomplete = [r["arm"] for r in rows if not r.get("complete")]
    if incomplete:
        print(f"WARNING: arms without {num_prompts} clean completions: {incomplete}")
    (out_dir / "codegen_throughput.json").write_text(json.dumps(
        {"setup": setup, "rows": rows, "goals": goal_lines(rows), "created_at": time.time()}, indent=2))
    plot(rows, out_dir / "codegen_throughput.png",
         f"{num_prompts} HumanEval prompts x {setup['sampling']['max_tokens']} tokens, config {args.config}, "
         f"OMP_NUM_THREADS={args.omp_threads or 'unset'}")
    print(f"[bench] wrote {out_dir / 'codegen_throughput.json'} and .png", flush=True)
    return 0 if not incomplete else 1


if __name__ == "__main__":
    sys.exit(main())
