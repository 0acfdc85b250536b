"""A head and two worker nodes on this machine (`ray.cluster_utils.Cluster`, the way Ray's
own tests build one), and what ran where on them. Run by tests/integration/test_multinode.py
in a process of its own, so the suite's single-node Ray session is left alone:

    python tests/integration/multinode_cluster.py ARGS_JSON   -> last stdout line: result JSON

The nodes look like a small GPU cluster to Ray: the head takes no work (num-cpus 0, as on
KubeRay), each worker declares 4 logical GPUs and the `accelerator_type:B200` resource.
The engines themselves run on CPU; GPUs here are only what Ray places by.

1. Placement: each GPU preset's engine pool (the job's `engine_pool`, with the plan's
   resources) runs a stage that reports its node and GPU ids instead of building an engine.
2. Online, a node lost under a request: the Serve app with two replicas (Serve's proxy on
   the head), a long request running on one; that replica's node is killed. The request
   ends (an error, not a hang), new requests succeed, the replica count comes back on the
   other worker. A fresh worker then joins (as an autoscaler would add one).
3. A node lost mid-job: the codegen job with the tiny model, two engines, HumanEval
   prompts from S3 -> S3 (then the log-prob scoring job, after one more fresh worker
   joined), the engines' batches on one worker held there (injected: `HoldOnDoomedNode`)
   until that node is removed (`Cluster.remove_node`, a raylet and everything on it killed,
   like a spot reclaim); the job has to finish on the other worker with every row once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

WORKER = {"num_cpus": 8, "num_gpus": 4, "resources": {"accelerator_type:B200": 1}}


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
    from control.plan import resolve
    from actors.batch_host import engine_pool, start_board

    plan = resolve(load_config(preset, overrides))
    board = start_board()
    engine_pool(ray.data.range(64, override_num_blocks=16), plan, WhereAmI,
                board=board, hosts=plan.resources.max_actors).materialize()
    hosts = ray.get(board.snapshot.remote())
    return {"plan": plan.resources.as_dict(), "hosts": sorted(hosts.values(), key=lambda w: (w["node"], w["gpus"]))}


def codegen(args: dict[str, Any], output: str, stage_cls: type | None = None) -> dict[str, Any]:
    from configs import load_config
    from jobs.codegen import run_codegen

    cfg = load_config("tiny", [f"input={args['input']}", f"output={output}",
                               f"s3_endpoint_url={args['endpoint']}", "sampling.max_tokens=8",
                               "pool.min_actors=2", "pool.max_actors=2", "pool.cpus_per_actor=3"])
    return run_codegen(cfg, stage_cls)


class Doom:
    """Ray actor (named, on the head): the first engine to ask dooms its node."""

    def __init__(self):
        self.node: str | None = None
        self.held = 0

    def claim(self, node: str) -> bool:
        self.node = self.node or node
        if node == self.node:
            self.held += 1
        return node == self.node

    def state(self) -> tuple[str | None, int]:
        return self.node, self.held


def hold_on_doomed_node(stage: type, doom: str) -> type:
    """`stage` (the job's engine stage), except that on the doomed node a batch never
    finishes (bounded): its rows are in flight when the node goes."""

    class HoldOnDoomedNode(stage):
        async def __call__(self, batch):
            import asyncio

            import ray

            if await ray.get_actor(doom).claim.remote(self.node_id):
                await asyncio.sleep(600)
                raise TimeoutError("the doomed node was not removed within 600 s")
            return await super().__call__(batch)

    return HoldOnDoomedNode


def node_loss(args: dict[str, Any], cluster, workers, job: str) -> dict[str, Any]:
    """Run `job` (codegen | score_logprobs); once a batch is held on a worker, remove that
    worker's node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    name = f"doom-{job}"
    doom = ray.remote(num_cpus=0, scheduling_strategy=here)(Doom).options(name=name).remote()
    outcome: dict[str, Any] = {}

    def remove_when_held() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            node, held = ray.get(doom.state.remote())
            if held:
                outcome["removed_node"] = node
                # Not graceful: the raylet and all on it killed, as when a spot node is reclaimed.
                cluster.remove_node(next(w for w in workers if w.node_id == node), allow_graceful=False)
                outcome["removed_at"] = time.monotonic()
                return
            time.sleep(0.2)

    remover = threading.Thread(target=remove_when_held, daemon=True)
    remover.start()
    try:
        outcome["summary"] = (codegen(args, args["output"] + "-node-loss", hold_on_doomed_node(_engine_stage(), name))
                              if job == "codegen" else score_logprobs(args, hold_on_doomed_node(_score_stage(), name)))
    finally:
        ray.kill(doom)
    outcome["recovery_s"] = time.monotonic() - outcome["removed_at"] if "removed_at" in outcome else None
    remover.join(timeout=5)
    return outcome


def _engine_stage() -> type:
    from actors.batch_host import EngineStage

    return EngineStage


def _score_stage() -> type:
    from pipelines.score_logprobs import ScoreStage

    return ScoreStage


def score_logprobs(args: dict[str, Any], stage_cls: type) -> dict[str, Any]:
    from configs import load_config
    from configs.load import split_scoring_overrides
    from jobs.score_logprobs import run_score_logprobs

    cfg = load_config("tiny", [f"input={args['score_input']}", f"output={args['score_output']}",
                               f"s3_endpoint_url={args['endpoint']}", "pool.min_actors=2", "pool.max_actors=2",
                               "pool.cpus_per_actor=3"])
    _, scoring = split_scoring_overrides([])
    return run_score_logprobs(cfg, scoring.logprobs, stage_cls)


def _wait(cond, what: str, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.5)


def serve_node_loss(args: dict[str, Any], cluster, workers) -> dict[str, Any]:
    import httpx
    from ray import serve

    from configs import load_config
    from serving.app import deployment_for

    url = f"http://127.0.0.1:{args['serve_port']}"
    serve.start(http_options={"host": "127.0.0.1", "port": args["serve_port"], "location": "HeadOnly"})
    cfg = load_config("tiny", ["pool.min_actors=2", "pool.max_actors=2", "pool.cpus_per_actor=3"])
    serve.run(deployment_for(cfg), name="peagle", route_prefix="/")
    handle = serve.get_app_handle("peagle")

    def running() -> int:
        app = serve.status().applications["peagle"].deployments["EngineReplica"]
        return app.replica_states.get("RUNNING", 0)

    def served() -> bool:
        try:
            return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "def g(x):", "max_tokens": 4},
                              timeout=120).status_code == 200
        except httpx.HTTPError:
            return False

    # `serve.run` returns once the replicas are up; the proxy on the head learns the route a
    # moment later (longer on a loaded machine) and answers 404/503 until then. Send the long
    # request only once the proxy serves.
    _wait(served, "a request served through the proxy before the node loss")
    out: dict[str, Any] = {"replicas_before": running()}
    # Which node each replica runs on, asked while both are idle: Serve's router sends a
    # call to the replica with fewer requests in flight, so once one is busy every call
    # would reach the other; its answers are only taken while both are idle.
    node_of: dict[int, str] = {}

    def both_replicas_known() -> bool:
        stats = handle.stats.remote().result(timeout_s=60)
        node_of[stats["replica_pid"]] = stats["node_id"]
        return len(node_of) == 2

    _wait(both_replicas_known, "both replicas answering before the node loss")
    long: dict[str, Any] = {}
    started = threading.Event()

    def long_request() -> None:  # streamed: the replica's pid comes in the response's headers
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
                long["status"] = resp.status_code
                long["replica_pid"] = int(resp.headers.get("x-peagle-replica-pid", 0))
                for line in resp.iter_lines():
                    if line.startswith("data: {"):  # a first token: the request runs there
                        long["first_token"] = True
                        started.set()
        except httpx.HTTPError as exc:  # the connection itself dropped: also an end, not a hang
            long["status"] = type(exc).__name__
        finally:
            started.set()

    caller = threading.Thread(target=long_request, daemon=True)
    caller.start()
    _wait(started.is_set, "the long request's first token")
    if not long.get("first_token") or long.get("replica_pid") not in node_of:  # it ended, or came from elsewhere: say how
        raise RuntimeError(f"the long request ended or was not served by a known replica: {long}, replicas {node_of}")
    busy = {"node_id": node_of[long["replica_pid"]]}
    out["removed_node"] = busy["node_id"]
    cluster.remove_node(next(w for w in workers if w.node_id == busy["node_id"]), allow_graceful=False)
    removed_at = time.monotonic()
    caller.join(timeout=600)
    out["in_flight_ended"] = not caller.is_alive()
    out["in_flight_status"] = long.get("status")

    _wait(served, "a request served after the node loss")
    out["first_success_s"] = time.monotonic() - removed_at
    answered: dict[int, str] = {}  # replica pid -> node, from replicas that answer after the loss

    def two_replicas_answer() -> bool:
        try:  # a call routed to the lost replica fails until Serve has noticed
            stats = handle.stats.remote().result(timeout_s=60)
            answered[stats["replica_pid"]] = stats["node_id"]
        except Exception:
            pass
        return len(answered) == 2 and running() == 2

    _wait(two_replicas_answer, "two replicas answering again")
    out["replicas_back_s"] = time.monotonic() - removed_at
    out["replicas_after"] = sorted(answered.values())
    out["after"] = [served() for _ in range(4)]
    serve.shutdown()
    return out


def _phase(name: str, started: float) -> None:
    print(f"[multinode] {time.monotonic() - started:6.1f} s  {name}", file=sys.stderr, flush=True)


def _replace_lost(cluster, workers: list, lost_node: str) -> list:
    """The workers without the lost node, plus a fresh one (as an autoscaler would add)."""
    kept = [w for w in workers if w.node_id != lost_node]
    kept.append(cluster.add_node(**WORKER))
    cluster.wait_for_nodes(timeout=300)
    return kept


def main(args: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "gcs_server_port": args["port"],
                                                            "include_dashboard": False})
    try:
        started = time.monotonic()
        workers = [cluster.add_node(**WORKER) for _ in range(2)]
        cluster.wait_for_nodes(timeout=300)
        ray.init(address=cluster.address, log_to_driver=False)
        out: dict[str, Any] = {"head": cluster.head_node.node_id, "workers": [w.node_id for w in workers]}
        _phase("placement", started)
        out["placement"] = {name: placements(preset, overrides) for name, (preset, overrides) in args["placement"].items()}
        _phase("serve node loss", started)
        out["serve_node_loss"] = serve_node_loss(args, cluster, workers)
        workers = _replace_lost(cluster, workers, out["serve_node_loss"]["removed_node"])
        out["workers_after_serve"] = [w.node_id for w in workers]
        _phase("codegen node loss", started)
        out["node_loss"] = node_loss(args, cluster, workers, "codegen")
        # The scoring job on the survivor and one more fresh worker.
        workers = _replace_lost(cluster, workers, out["node_loss"]["removed_node"])
        out["workers_after_codegen_loss"] = [w.node_id for w in workers]
        _phase("scoring node loss", started)
        out["score_node_loss"] = node_loss(args, cluster, workers, "score_logprobs")
        _phase("done", started)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
