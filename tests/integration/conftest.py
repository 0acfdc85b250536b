"""Fixtures for integration tests: the tiny models (built if missing), a local Ray with
more logical CPUs than cores (Ray Data's extra stages would otherwise wait for a free
CPU behind the engine actors), and a moto S3 server on 127.0.0.1."""

import os

import pytest

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def tiny_models():
    from models.build_tiny import default_artifacts_dir, ensure_built

    out = default_artifacts_dir()
    ensure_built(out)
    return out


@pytest.fixture(scope="session")
def s3():
    from devtools.local_s3 import LocalS3

    with LocalS3() as server:
        yield server


@pytest.fixture(scope="session")
def metrics_port() -> int:
    from devtools.local_s3 import free_port

    return free_port()


@pytest.fixture(scope="session")
def ray_local(s3, metrics_port):
    # S3 first: its credentials are in os.environ before Ray's workers inherit it. Serve in
    # the mode the app ships with (serving.serve_env), replicas' own ports on free ports.
    import ray

    from devtools.local_s3 import free_port
    from serving.serve_env import serve_env

    os.environ.update(serve_env(first_http_port=free_port(span=16), first_grpc_port=free_port(span=16)))
    # A stopping replica of the shipped mode stays reachable on its own port for 30 s (Serve's
    # default) so that a load balancer in front of those ports can deregister it; here nothing
    # is in front of them (every test calls through Serve's proxy or a handle), and the drain
    # made each deleted app or removed replica wait 30 s. Requests in flight are still awaited.
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             _metrics_export_port=metrics_port)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def loop():
    """An event loop in a thread for in-process engines (tests/integration/engine_loop.py)."""
    from engine_loop import LoopThread

    lt = LoopThread()
    yield lt
    lt.close()
