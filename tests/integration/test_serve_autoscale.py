"""Serve scales replicas on the capacity they report, not on queue length: the real policy
(serving.autoscale.CapacityPolicy) wired through `autoscaling_config`, replicas reporting
through Serve's `record_autoscaling_stats` hook with the same helper as EngineReplica. The
replica is a stand-in without an engine, so two deployments can be given different
capacities at the same queue: its requests in system are the calls it holds, its capacity
is what it is given. Real engine replicas scaling: test_serve_autoscale_live.py."""

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest
import ray
from ray import serve

from configs.schema import ServeConfig
from devtools.local_s3 import free_port
from control.capacity import ReplicaCapacity
from serving.autoscale import ReplicaReport, autoscaling_config, autoscaling_stats, reports_from_metrics

pytestmark = pytest.mark.integration

NUM_REQUESTS = 6
HOLD_TIMEOUT_S = 300  # a held call never outlives the test
POLL_S = 0.5
MAX_POLLS = 240

# Same 6 requests in the system; what one replica serves at the latency target differs.
LOW_CAPACITY = {"batch_size": 2, "num_speculative_tokens": 1, "tokens_per_s": 40.0, "tpot_s": 0.05,
                "meets_target": True}  # drafts rarely accepted, K dropped to 1
HIGH_CAPACITY = {"batch_size": 16, "num_speculative_tokens": 7, "tokens_per_s": 640.0, "tpot_s": 0.025,
                 "meets_target": True}

# Fast settings; the queue rule alone (6 requests / 100 per replica) would never scale up.
FAST = ServeConfig(autoscale_interval_s=0.5, scale_down_delay_s=2.0, target_utilization=1.0,
                   target_ongoing_requests=100)


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self):
        self.opened = asyncio.Event()

    async def wait(self) -> None:
        await self.opened.wait()

    def open(self) -> None:
        self.opened.set()


class LoadReportingReplica:
    def __init__(self, capacity: dict | None):
        self.capacity = capacity
        self.num_held = 0

    async def hold(self, gate) -> None:
        self.num_held += 1
        try:
            await asyncio.wait_for(gate.wait.remote(), timeout=HOLD_TIMEOUT_S)
        finally:
            self.num_held -= 1

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return autoscaling_stats(self.num_held, self.capacity)


def app_for(capacity: dict | None) -> serve.Application:
    deployment = serve.deployment(
        LoadReportingReplica, name="Replica", ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * NUM_REQUESTS,
        autoscaling_config=autoscaling_config(FAST, min_replicas=1, max_replicas=2),
    )
    return deployment.bind(capacity)


def num_replicas(app: str, state: str | None = None) -> int:
    states = serve.status().applications[app].deployments["Replica"].replica_states
    return sum(n for s, n in states.items() if state is None or str(getattr(s, "value", s)) == state)


@pytest.fixture()
def serve_apps(ray_local):
    # Ship the stand-in replica by value: Serve's workers cannot import the tests folder.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    apps = {"cap-low": LOW_CAPACITY, "cap-high": HIGH_CAPACITY}
    for name, capacity in apps.items():
        serve.run(app_for(capacity), name=name, route_prefix=f"/{name}")
    yield list(apps)
    for name in apps:
        serve.delete(name)
    serve.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_replicas_follow_predicted_capacity_at_the_same_queue(serve_apps):
    gate = Gate.remote()
    held = [serve.get_app_handle(app).hold.remote(gate) for app in serve_apps for _ in range(NUM_REQUESTS)]

    # Low capacity: 6 requests need ceil(6 / 2) = 3 replicas, capped at 2. High capacity:
    # one replica serves all 6, so it stays at 1 while the other has scaled.
    for _ in range(MAX_POLLS):
        assert num_replicas("cap-high") == 1
        if num_replicas("cap-low", "RUNNING") == 2:
            break
        time.sleep(POLL_S)
    assert num_replicas("cap-low", "RUNNING") == 2
    for _ in range(8):  # several more decision intervals: high still needs only one
        time.sleep(POLL_S)
        assert num_replicas("cap-high") == 1

    ray.get(gate.open.remote())
    for response in held:
        response.result(timeout_s=60)

    # No requests left: back to min_replicas after the scale-down dwell.
    for _ in range(MAX_POLLS):
        if num_replicas("cap-low") == 1:
            break
        time.sleep(POLL_S)
    assert num_replicas("cap-low") == 1 and num_replicas("cap-high") == 1


class FakeEngine:
    """The two things EngineReplica's hook reads: scheduler signals and, when a controller
    is configured, `spec_control_state()` (sync or async: the engine side is still open)."""

    def __init__(self, control_state: str):
        if control_state == "sync":
            self.spec_control_state = lambda: {"k_in_force": 1, "capacity": LOW_CAPACITY}
        elif control_state == "async":
            async def spec_control_state():
                return {"k_in_force": 1, "capacity": LOW_CAPACITY}
            self.spec_control_state = spec_control_state

    def stats_dict(self) -> dict:
        return {"num_drafts": 0, "signals": {"num_running_reqs": 3, "num_waiting_reqs": 2}}


@pytest.mark.parametrize("control_state", ["sync", "async", "absent"])
def test_engine_replica_reports_engine_requests_and_controller_capacity(control_state):
    from serving.app import EngineReplica

    replica = SimpleNamespace(engine=FakeEngine(control_state), batch_gate=SimpleNamespace(num_rows=1))
    stats = asyncio.run(EngineReplica.record_autoscaling_stats(replica))
    metrics = {name: {"r": value} for name, value in stats.items()}
    expected = None if control_state == "absent" else ReplicaCapacity(**LOW_CAPACITY)
    assert reports_from_metrics(metrics, ["r"]) == [ReplicaReport(5.0, expected)]


def test_restart_lease_is_one_actor_per_app_granting_one_replica_at_a_time(ray_local):
    from serving.restart_lease import ReplicaLease

    a, b = ReplicaLease("lease-test", "a", min_healthy=1), ReplicaLease("lease-test", "b", min_healthy=1)

    async def scenario():
        assert not await a.acquire() and "0 other replicas alive" in a.last_answer  # b never reported
        await b.actor.heartbeat.remote("b")
        assert await a.acquire()
        assert not await b.acquire() and "replica a is restarting" in b.last_answer  # the same actor
        await a.release()
        assert await b.acquire()
        await b.release()

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(a.actor)
