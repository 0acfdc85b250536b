"""HumanEval inputs for the tests: prompts as engine requests, and `jobs.codegen` input
with n samples per task for the code-scoring tests."""

from __future__ import annotations

import json
from typing import Any

from pipelines.storage import FsSpec


def humaneval_requests(limit: int | None = None) -> list[dict]:
    """The first `limit` HumanEval problems as `Engine.generate` requests, id = task_id."""
    from pipelines.score_code import read_problems

    problems = list(read_problems(None, None).values())[:limit]
    return [{"id": p["task_id"], "prompt": p["prompt"]} for p in problems]


def write_codegen_input(fs_spec: FsSpec, prefix: str, n: int, num_shards: int = 4, limit: int | None = None,
                        **sampling: Any) -> int:
    """Write a `jobs.codegen` input for n samples per HumanEval task (a row per task; the
    job gives samples ids `TASK#i`, seeds seed+i: `pipelines.score_code.codegen_input_rows`);
    returns the number of samples, the rows the job's summary counts."""
    from pipelines.score_code import codegen_input_rows, read_problems

    problems = dict(list(read_problems(fs_spec, None).items())[:limit])
    tasks = list(problems)
    fs = fs_spec.open_fs(prefix)
    root = prefix[len("s3://"):] if prefix.startswith("s3://") else prefix
    size = -(-len(tasks) // num_shards)
    total = 0
    for i in range(num_shards):
        chunk = {t: problems[t] for t in tasks[i * size:(i + 1) * size]}
        if chunk:
            rows = codegen_input_rows(chunk, n, **sampling)
            fs.pipe_file(f"{root.rstrip('/')}/samples-{i:02d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
            total += len(rows) * n
    return total
