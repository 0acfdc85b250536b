"""Serve autoscaling end to end on real engines: the deployment a user runs
(`serving.app.deployment_for`, pool.min_actors=1, max_actors=2, speculation controller on)
adds an engine replica when online load exceeds what one replica's controller says it
serves, both replicas answer, and the pool shrinks back once the load is gone.

The policy itself (capacity, not queue length) is shown with stand-in replicas in
test_serve_autoscale.py; this shows the real pieces are wired together."""

import threading
import time

import httpx
import pytest
from ray import serve

from configs import load_config
from devtools.local_s3 import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "scale-live"
NUM_CLIENTS = 24  # more requests in the system than one replica (16 at a time) serves at 80%
MAX_REQUESTS_PER_CLIENT = 200  # bounded load, whatever happens
LOAD_LIMIT_S = 300.0
POLL_S = 1.0
MAX_POLLS = 240


def num_replicas(state: str | None = None) -> int:
    states = serve.status().applications[APP].deployments["EngineReplica"].replica_states
    return sum(n for s, n in states.items() if state is None or str(getattr(s, "value", s)) == state)


@pytest.fixture()
def app_url(ray_local, tiny_models):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = load_config("tiny", [
        "pool.min_actors=1", "pool.max_actors=2", "engine.max_num_seqs=16",
        "engine.spec.controller.calibration=cpu-tiny",
        "engine.spec.controller.replacement.enabled=false",  # this test is about replica count only
        "serve.max_ongoing_requests=32", "serve.autoscale_interval_s=1", "serve.scale_down_delay_s=5",
    ])
    from serving.app import deployment_for

    serve.run(deployment_for(cfg), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{port}/{APP}"
    serve.delete(APP)
    serve.shutdown()


def test_online_load_adds_a_real_engine_replica_and_both_serve(app_url):
    assert num_replicas("RUNNING") == 1
    stop = threading.Event()
    pids: dict[int, int] = {}  # replica pid -> completions it served
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + LOAD_LIMIT_S

    def client() -> None:
        with httpx.Client(base_url=app_url, timeout=120) as http:
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "def f(x):",
                                                           "max_tokens": 64, "ignore_eos": True})
                    r.raise_for_status()
                    assert r.json()["usage"]["completion_tokens"] == 64
                    with lock:
                        pid = int(r.headers["x-peagle-replica-pid"])
                        pids[pid] = pids.get(pid, 0) + 1
                except Exception as exc:  # collected and asserted below
                    with lock:
                        errors.append(repr(exc))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    try:
        # Scale-up, then keep the load on until the new replica has answered too.
        for _ in range(MAX_POLLS):
            with lock:
                both_served = len(pids) == 2
            if num_replicas("RUNNING") == 2 and both_served:
                break
            time.sleep(POLL_S)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors[:5]
    assert num_replicas("RUNNING") == 2, serve.status().applications[APP]
    assert len(pids) == 2 and all(n > 0 for n in pids.values()), pids

    # Load gone: back to pool.min_actors after the scale-down delay.
    for _ in range(MAX_POLLS):
        if num_replicas() == 1:
            break
        time.sleep(POLL_S)
    assert num_replicas() == 1
