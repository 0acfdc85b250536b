"""A head and two worker nodes on this machine (`ray.cluster_utils.Cluster`, the way Ray's
own tests build one), and what ran where on them. Run by tests/integration/test_multinode.py
in a process of its own, so the suite's single-node Ray session is left alone:

    python tests/integration/multinode_cluster.py ARGS_JSON   -> last stdout line: result JSON

The nodes look like a small GPU cluster to Ray: the head takes no work (num-cpus 0, as on
KubeRay), each worker declares 4 logical GPUs and the `accelerator_type:B200` resource.
The engines themselves run on CPU; GPUs here are only what Ray places by.

1. Placement: each GPU preset's engine pool (the job's `engine_pool`, with the plan's
   resources) runs a stage that reports its node and GPU ids instead of building an engine.
2. The codegen job with the tiny model: two engines of 3 CPUs on workers of 4 CPUs (one
   fits per worker), HumanEval prompts from S3 -> results on S3.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

WORKER = {"num_cpus": 4, "num_gpus": 4, "resources": {"accelerator_type:B200": 1}}


class WhereAmI:
    """Stands in for `EngineStage` in the placement runs: reports the engine host's node and
    GPUs to the job's board, and holds its batches until every host of the pool has reported
    (bounded), so that the pool's hosts all start whichever of them gets the rows."""

    def __init__(self, cfg: dict[str, Any], board, hosts: int):
        import ray

        ctx = ray.get_runtime_context()
        self.board, self.hosts = board, hosts
        ray.get(board.report.remote(ctx.get_actor_id(), {"node": ctx.get_node_id(),
                                                           "gpus": sorted(str(g) for g in ray.get_gpu_ids())}))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import ray

        deadline = time.monotonic() + 300
        while len(ray.get(self.board.snapshot.remote())) < self.hosts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {self.hosts} engine hosts started in 300 s")
            time.sleep(0.2)
        return batch


def placements(preset: str, overrides: list[str]) -> dict[str, Any]:
    import ray.data

    from configs import load_config
    from configs.plan import resource_plan
    from pipelines.engine_stage import engine_pool, start_board

    cfg = load_config(preset, overrides)
    plan = resource_plan(cfg)
    board = start_board()
    engine_pool(ray.data.range(64, override_num_blocks=16), cfg, plan, WhereAmI,
                board=board, hosts=plan.max_actors).materialize()
    hosts = ray.get(board.snapshot.remote())
    return {"plan": plan.as_dict(), "hosts": sorted(hosts.values(), key=lambda w: (w["node"], w["gpus"]))}


def codegen(args: dict[str, Any]) -> dict[str, Any]:
    from configs import load_config
    from jobs.codegen import run_codegen

    cfg = load_config("tiny", [f"input={args['input']}", f"output={args['output']}",
                               f"s3_endpoint_url={args['endpoint']}", "sampling.max_tokens=8",
                               "pool.min_actors=2", "pool.max_actors=2", "pool.cpus_per_actor=3"])
    return run_codegen(cfg)


def main(args: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "gcs_server_port": args["port"],
                                                            "include_dashboard": False})
    try:
        workers = [cluster.add_node(**WORKER) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        out: dict[str, Any] = {"head": cluster.head_node.node_id, "workers": [w.node_id for w in workers]}
        out["placement"] = {name: placements(preset, overrides) for name, (preset, overrides) in args["placement"].items()}
        out["codegen"] = codegen(args)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
