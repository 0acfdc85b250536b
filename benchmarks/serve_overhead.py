"""The online door against vLLM's own server: throughput and TTFT with vLLM's benchmark client.

One run, side by side: each server in turn on loopback, the same engine kwargs (the preset's
serving engine), driven by `vllm bench serve` (random prompts, fixed input/output lengths,
greedy, `ignore_eos`) at four loads: max-concurrency 1, a fixed request rate, max-concurrency
16 and everything at once. Servers:

- `project-direct`: our Serve app (`serving.app`) with Serve's throughput-optimized mode
  (`serving.serve_env`, as `make serve` ships it: direct ingress, gRPC between Serve processes,
  user code on the replica's main loop), the client talking to the replica's own HTTP port.
- `project-proxy`: our Serve app with Serve's defaults, through Serve's HTTP proxy.
- `vllm-serve`: `vllm serve` with its default process layout (API server, engine core and
  worker processes) and thread count.
- `vllm-serve-inproc`: `vllm serve` with VLLM_ENABLE_V1_MULTIPROCESSING=0 (API server plus one
  engine-core process holding the worker: the layout of our replica) and the engine's compute
  threads set to the preset's `pool.cpus_per_actor` (what Ray gives our engine actor: Ray
  sets OMP_NUM_THREADS from the actor's CPUs). The like-for-like anchor.
- `vllm-serve-inproc-all-cores`: the same, with vLLM's own thread count (every core).
- `ray-serve-llm`: Ray's `ray.serve.llm` OpenAI app with the same engine kwargs.

Also measured per server and load: CPU seconds the server's whole process tree spent per
output token (where the time goes: what a front end burns is taken from the engine on a
CPU-bound host). Writes out/bench/serve_overhead.{json,md,png}.

Rounds (`--rounds N`): every server runs every load once per round, servers in the same order
each round, so a drift in the machine's speed touches every server of a round alike. A server's
figures are the median over rounds, and a ratio is the median of the rounds' own ratios (each
taken between two servers of one round); the per-round values are kept in the JSON.

    python -m benchmarks.serve_overhead [--servers project-direct,vllm-serve-inproc] [--num-prompts 600] [--rounds 3]

`vllm bench serve` runs through `benchmarks.vllm_cli` (the CPU wheel's `vllm` script fails).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from serving.serve_env import serve_env

OUT_DIR = Path("out/bench")
MODEL_NAME = "tiny"
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
# name -> (bench serve arguments, prompts as a share of --num-prompts). At the default 600
# prompts each load lasts ~20-60 s here (c1: 100 prompts, 4 req/s: 100 prompts = 25 s); runs
# of ~8 s (200 prompts at c=16 on a fast day) moved a ratio by +-8% from one run to the next.
LOADS: dict[str, tuple[list[str], float]] = {
    "c1": (["--max-concurrency", "1"], 1 / 6),
    "4rps": (["--request-rate", "4"], 1 / 6),
    "c16": (["--max-concurrency", "16"], 1.0),
    "unlimited": (["--request-rate", "inf"], 1.0),
}
MEDIAN_KEYS = ("output_tok_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "server_cpu_ms_per_token",
               "duration_s")
SERVERS = ["project-direct", "project-proxy", "vllm-serve-inproc", "vllm-serve-inproc-all-cores", "vllm-serve",
           "ray-serve-llm"]


def engine_kwargs(cfg) -> dict[str, Any]:
    """The kwargs a Serve replica's engine runs with (the serving engine's step budget)."""
    from configs.vllm_args import to_vllm_kwargs
    from control.plan import serve_engine

    return to_vllm_kwargs(serve_engine(cfg))  # vLLM's own server runs no controller: no start-up table


def vllm_serve_args(kwargs: dict[str, Any]) -> list[str]:
    """Engine kwargs as `vllm serve` flags (dicts as JSON; a bool only where it differs
    from vLLM's default, as --x or --no-x, since some of vLLM's bool flags have no --no-x)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    kwargs = dict(kwargs)
    args = [kwargs.pop("model"), "--served-model-name", MODEL_NAME]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or (isinstance(value, bool) and defaults.get(key) is value):
            continue
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def server_command(name: str, port: int, direct_port: int, args) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if name.startswith("vllm-serve"):
        if name.startswith("vllm-serve-inproc"):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if name == "vllm-serve-inproc":
            env["OMP_NUM_THREADS"] = str(max(1, int(args.cfg.pool.cpus_per_actor)))
        cmd = [sys.executable, "-m", "benchmarks.vllm_cli", "serve", *vllm_serve_args(args.engine_kwargs),
               "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
        return cmd, env
    shipped = serve_env(first_http_port=direct_port)  # the replica's own port: the range's first
    for key in shipped:
        env.pop(key, None)
    if name == "project-direct":
        env.update(shipped)
    cmd = [sys.executable, "-m", "benchmarks.serve_overhead", "--host-server", name, "--port", str(port),
           "--config", args.config, *[f"--override={o}" for o in args.override]]
    return cmd, env


def host_server(name: str, port: int, config: str, overrides: list[str]) -> None:
    """Run a Ray-based server in this process until SIGTERM (a child of the benchmark)."""
    import ray
    from ray import serve

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if name in ("project-direct", "project-proxy"):
            from configs import load_config
            from serving.app import deployment_for

            serve.run(deployment_for(load_config(config, overrides)), name="peagle", route_prefix="/")
        elif name == "ray-serve-llm":
            from ray.serve.llm import LLMConfig, build_openai_app

            from benchmarks.codegen_arms import ray_data_llm_bundles
            from configs import load_config

            cfg = load_config(config, overrides)
            kwargs = engine_kwargs(cfg)
            # its engine asks for a GPU unless told otherwise; the same bundles as ray.data.llm's
            bundles = ray_data_llm_bundles(cfg)
            llm = LLMConfig(model_loading_config={"model_id": MODEL_NAME, "model_source": kwargs.pop("model")},
                            engine_kwargs=kwargs, deployment_config={"num_replicas": 1},
                            placement_group_config=bundles if cfg.pool.device == "cpu" else None)
            serve.run(build_openai_app({"llm_configs": [llm]}), name="llm", route_prefix="/")
        else:
            raise SystemExit(f"unknown server {name!r}")
        print(f"READY {name} on {port}", flush=True)
        while not stop["now"]:
            time.sleep(0.5)
        serve.shutdown()
        ray.shutdown()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200 and MODEL_NAME in r.read().decode():
                    return
        except OSError:
            pass
        time.sleep(2.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


def process_role(proc) -> str:
    """A short name for a server process: what spends the CPU."""
    name = proc.name()
    cmdline = " ".join(proc.cmdline()[:6])
    if "EngineCore" in name or "EngineCore" in cmdline:
        return "engine-core"
    if "Worker" in name and "VLLM" in name:
        return "vllm-worker"
    for marker, role in (("ServeReplica", "serve-replica"), ("ProxyActor", "serve-proxy"),
                         ("ServeController", "serve-controller")):
        if marker in name or marker in cmdline:
            return role
    if name in ("raylet", "gcs_server") or "ray::" in name or "ray/_private" in cmdline or "ray/dashboard" in cmdline:
        return "ray-system"
    if "vllm_cli" in cmdline:
        return "api-server"
    if "serve_overhead" in cmdline:
        return "driver"
    return name


def tree_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (role, CPU seconds user + system)} for a process and its descendants alive now."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            t = proc.cpu_times()
            out[proc.pid] = (process_role(proc), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        roles[role] = roles.get(role, 0.0) + cpu - before.get(pid, (role, 0.0))[1]
    return {role: round(cpu, 2) for role, cpu in sorted(roles.items(), key=lambda kv: -kv[1]) if cpu >= 0.05}


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_S)


def run_load(url: str, load: str, num_prompts: int, args, out: Path, server_pid: int) -> dict[str, Any]:
    extra, _ = LOADS[load]
    cmd = [sys.executable, "-m", "benchmarks.vllm_cli", "bench", "serve", "--backend", "openai",
           "--base-url", url, "--model", MODEL_NAME, "--tokenizer", args.engine_kwargs["model"],
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
           "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, *extra]
    cpu_before = tree_cpu_s(server_pid)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.load_timeout_s)
    roles = cpu_by_role(cpu_before, tree_cpu_s(server_pid))
    cpu_s = sum(roles.values())
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    raw = json.loads(out.read_text())
    tokens = raw.get("total_output_tokens") or 0
    return {"output_tok_s": round(raw["output_throughput"], 1), "completed": raw["completed"],
            "failed": raw.get("failed", num_prompts - raw["completed"]),
            "ttft_mean_ms": round(raw["mean_ttft_ms"], 1), "ttft_p99_ms": round(raw["p99_ttft_ms"], 1),
            "tpot_mean_ms": round(raw["mean_tpot_ms"], 2),
            "server_cpu_ms_per_token": round(1000 * cpu_s / tokens, 3) if tokens else None,
            "duration_s": round(raw["duration"], 2), "server_cpu_s_by_process": roles}


def run_server(name: str, args, out_dir: Path, label: str | None = None) -> dict[str, Any]:
    from devtools.local_s3 import free_port

    label = label or name  # file names and log lines (the round, when there are several)
    port, direct_port = free_port(), free_port()
    url = f"http://127.0.0.1:{direct_port if name == 'project-direct' else port}"
    cmd, env = server_command(name, port, direct_port, args)
    log_path = out_dir / f"{label}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        results: dict[str, Any] = {}
        try:
            started = time.monotonic()
            wait_ready(url, proc, START_TIMEOUT_S)
            print(f"[{label}] ready in {time.monotonic() - started:.0f}s", flush=True)
            for load, (_, share) in LOADS.items():
                num = max(8, round(args.num_prompts * share))
                results[load] = run_load(url, load, num, args, out_dir / f"{label}-{load}.json", proc.pid)
                r = results[load]
                print(f"[{label}] {load:10} {r['output_tok_s']:>8} tok/s  TTFT mean {r['ttft_mean_ms']} ms "
                      f"p99 {r['ttft_p99_ms']} ms  failed {r['failed']}  server CPU "
                      f"{r['server_cpu_ms_per_token']} ms/token {r['server_cpu_s_by_process']} in {r['duration_s']}s",
                      flush=True)
        finally:
            stop_server(proc)
    return results


def ratios(rounds: list[dict[str, dict[str, Any]]], num: str, den: str, key: str) -> dict[str, float | None]:
    """Per load, the median over rounds of num's figure over den's in the same round (None
    where no round has both)."""
    out: dict[str, float | None] = {}
    for load in LOADS:
        per_round = [servers[num][load][key] / servers[den][load][key] for servers in rounds
                     if load in servers.get(num, {}) and load in servers.get(den, {})
                     and servers[den][load][key]]
        out[load] = round(statistics.median(per_round), 3) if per_round else None
    return out


def median_over_rounds(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{server: {load: figures}}, each number the median over the rounds that ran it; `failed`
    is the sum (one failed request in any round counts), `rounds` the per-round figures."""
    merged: dict[str, dict[str, Any]] = {}
    for servers in rounds:
        for name, by_load in servers.items():
            for load, r in by_load.items():
                merged.setdefault(name, {}).setdefault(load, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for name, by_load in merged.items():
        out[name] = {}
        for load in (l for l in LOADS if l in by_load):
            runs = by_load[load]
            figures = {key: round(statistics.median(r[key] for r in runs), 3)
                       for key in MEDIAN_KEYS if all(r.get(key) is not None for r in runs)}
            out[name][load] = {**figures, "failed": sum(r["failed"] for r in runs), "rounds": runs}
    return out


def render(report: dict[str, Any]) -> str:
    lines = ["| server | load | tok/s | TTFT mean ms | TTFT p99 ms | failed | server CPU ms/token |",
             "|---|---|---|---|---|---|---|"]
    for name, by_load in report["servers"].items():
        for load, r in by_load.items():
            lines.append(f"| {name} | {load} | {r.get('output_tok_s')} | {r.get('ttft_mean_ms')} | "
                         f"{r.get('ttft_p99_ms')} | {r['failed']} | {r.get('server_cpu_ms_per_token')} |")
    for title, key in (("throughput", "ratios"), ("TTFT p99", "ttft_p99_ratios")):
        if key not in report:
            continue
        lines += ["", f"| ratio ({title}) | " + " | ".join(LOADS) + " |", "|---|" + "---|" * len(LOADS)]
        for label, values in report[key].items():
            lines.append(f"| {label} | " + " | ".join("-" if values[l] is None else f"{values[l]:.2f}"
                                                     for l in LOADS) + " |")
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["servers"])
    loads = list(LOADS)
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in zip(axes, ("output_tok_s", "ttft_mean_ms", "server_cpu_ms_per_token"),
                              ("output tokens/s", "TTFT mean (ms, log)", "server CPU ms per output token")):
        for i, name in enumerate(names):
            values = [report["servers"][name].get(load, {}).get(key) or 0 for load in loads]
            ax.bar([x + i * width for x in range(len(loads))], values, width=width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(loads))], loads)
        ax.set_ylabel(label)
        if key == "ttft_mean_ms":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Online door vs vLLM's server ({report['settings']['input_len']} in / "
                 f"{report['settings']['output_len']} out, greedy, vllm bench serve)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {SERVERS}")
    p.add_argument("--config", default="tiny")
    p.add_argument("--override", action="append", default=[], help="config override a.b=value; repeatable")
    p.add_argument("--num-prompts", type=int, default=600,
                   help="prompts at c16 / unlimited; c1 and 4 req/s run a sixth")
    p.add_argument("--rounds", type=int, default=1, help="run every server this many times, in turn")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--load-timeout-s", type=float, default=900.0)
    p.add_argument("--host-server", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host_server:
        host_server(args.host_server, args.port, args.config, args.override)
        return 0
    from configs import load_config

    args.cfg = load_config(args.config, args.override)  # loaded once: every server and load reads it
    args.engine_kwargs = engine_kwargs(args.cfg)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        p.error(f"unknown server(s) {unknown}; choose from {SERVERS}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    out_dir = OUT_DIR / "serve_overhead"
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("host_server", "port", "cfg", "engine_kwargs")},
                              "serve_env": serve_env(), "servers": {}, "errors": {}}
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(args.rounds):
        rounds.append({})
        for name in servers:
            label = name if args.rounds == 1 else f"{name}-r{i + 1}"
            try:
                rounds[-1][name] = run_server(name, args, out_dir, label)
            except Exception as exc:  # noqa: BLE001 -- one server failing must not hide the others
                print(f"[{label}] failed: {exc} (log: {out_dir / (label + '.log')})", flush=True)
                report["errors"][label] = str(exc)[-2000:]
    report["servers"] = median_over_rounds(rounds)
    pairs = [(ours, den) for ours in ("project-direct", "project-proxy")
             for den in ("vllm-serve-inproc", "vllm-serve-inproc-all-cores", "vllm-serve", "ray-serve-llm")]
    report["ratios"] = {f"{ours} / {den}": ratios(rounds, ours, den, "output_tok_s")
                        for ours, den in pairs + [("project-direct", "project-proxy")]}
    report["ttft_p99_ratios"] = {f"project-direct / {den}": ratios(rounds, "project-direct", den, "ttft_p99_ms")
                                 for den in ("vllm-serve-inproc", "vllm-serve")}
    report["ttft_added_ms_c1"] = {
        f"{ours} - {den}": round(report["servers"][ours]["c1"]["ttft_mean_ms"]
                                 - report["servers"][den]["c1"]["ttft_mean_ms"], 1)
        for ours in ("project-direct", "project-proxy") for den in ("vllm-serve-inproc", "vllm-serve")
        if "c1" in report["servers"].get(ours, {}) and "c1" in report["servers"].get(den, {})}
    table = render(report)
    print("\n" + table)
    print(f"added TTFT at c1 (ms): {report['ttft_added_ms_c1']}")
    (OUT_DIR / "serve_overhead.json").write_text(json.dumps(report, indent=2))
    (OUT_DIR / "serve_overhead.md").write_text(table + "\n")
    if report["servers"]:
        _plot(report, OUT_DIR / "serve_overhead.png")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
