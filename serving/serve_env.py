"""The Ray Serve settings the online app ships with, as environment variables.

Serve reads them when each of its processes imports it (controller, proxy, replicas), so
they cannot live in the Serve config file: they go into the environment of whatever starts
Ray (`ray start`, `serve run`, a KubeRay pod spec) before Ray starts. `make serve` and the
tests set them; `benchmarks.serve_overhead` measures them against Serve's defaults.

Serve's throughput-optimized mode: each replica of an ingress deployment listens on its
own HTTP port (direct ingress) besides Serve's proxy, Serve's processes talk gRPC, user
code runs on the replica's main event loop, and the replica's GC is frozen after start-up.
Measured on this CPU (docs/benchmarks.md, "The online door against `vllm serve`"): the proxy path
burns about as much CPU as the replica itself, taken from the engine on a CPU-bound host.

No Ray import here: the variables must be set before Serve is imported anywhere.
"""

from __future__ import annotations

SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# Replicas take their direct HTTP ports from this range on each node (Serve's default
# range is 30000-31000); the proxy keeps `http_options.port` (8000).
DIRECT_PORT_RANGE_VARS = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
GRPC_PORT_RANGE_VARS = ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT")


def serve_env(first_http_port: int | None = None, first_grpc_port: int | None = None,
              ports: int = 16) -> dict[str, str]:
    """SERVE_ENV, plus the replicas' direct port ranges when given (`ports` each)."""
    env = dict(SERVE_ENV)
    for first, names in ((first_http_port, DIRECT_PORT_RANGE_VARS), (first_grpc_port, GRPC_PORT_RANGE_VARS)):
        if first is not None:
            if not 1024 <= first <= 65535 - ports:
                raise ValueError(f"first port {first} leaves no room for {ports} ports below 65536")
            env[names[0]], env[names[1]] = str(first), str(first + ports - 1)
    return env


def main(argv: list[str]) -> None:
    """`python -m serving.serve_env CMD ARGS...`: run CMD (e.g. `serve run ...`, `ray start`)
    with the shipped Serve settings; replicas' own ports from 8001 (the proxy keeps 8000)."""
    import os

    if not argv:
        raise SystemExit("usage: python -m serving.serve_env CMD [ARGS...]")
    env = {**os.environ, **serve_env(first_http_port=8001)}
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
