"""A local S3 endpoint (moto's server on 127.0.0.1) for the demo and the tests.

Starts `moto.server` as a child process on a free loopback port, waits (bounded) until it
answers, sets dummy AWS credentials in this process's environment (child processes such
as Ray workers inherit them), and stops it on exit. Only ever binds 127.0.0.1.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    # Not us-east-1: bucket creation there rejects a LocationConstraint.
    "AWS_DEFAULT_REGION": "us-west-2",
}


# Ports are picked between Ray's worker ports (10002-19999 by default) and the kernel's
# ephemeral range (32768 and up here, from /proc): a port picked in the ephemeral range can
# be taken, before it is bound, as the local end of any outgoing connection or by any port-0
# bind, and a Ray cluster makes hundreds of those (a multi-node test lost its Serve port so).
_FIRST_PICKED_PORT = 20000
# Ports handed out, as "first-last,...", in the environment: child processes (jobs, nodes,
# the demo's cluster) inherit it, so no two picks in one run overlap, bound yet or not.
_GIVEN_VAR = "PEAGLE_PORTS_GIVEN"


def _given() -> set[int]:
    spans = (item.split("-") for item in os.environ.get(_GIVEN_VAR, "").split(",") if item)
    return {p for first, last in spans for p in range(int(first), int(last) + 1)}


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1, free at the time of asking together with the `span - 1`
    after it, outside the kernel's ephemeral range (see above) and never one given before
    in this process or its parents."""
    top = _ephemeral_low() - span
    if top <= _FIRST_PICKED_PORT and span == 1:  # no room below the ephemeral range: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    given = _given()
    candidates = [first for first in range(_FIRST_PICKED_PORT, top + 1) if given.isdisjoint(range(first, first + span))]
    random.SystemRandom().shuffle(candidates)
    for first in candidates:  # at most the range once
        if all(_bindable(p) for p in range(first, first + span)):
            os.environ[_GIVEN_VAR] = ",".join(filter(None, [os.environ.get(_GIVEN_VAR), f"{first}-{first + span - 1}"]))
            return first
    raise RuntimeError(f"no {span} free consecutive ports on 127.0.0.1 in {_FIRST_PICKED_PORT}-{top + span - 1}")


class LocalS3:
    def __init__(self, port: int | None = None, startup_timeout_s: float = 30.0):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        os.environ.update(CREDENTIALS)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"local S3 server did not start on {self.endpoint_url}")
                time.sleep(0.2)

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint_url, skip_instance_cache=True)

    def create_bucket(self, name: str) -> None:
        self.filesystem().mkdir(name, region_name=CREDENTIALS["AWS_DEFAULT_REGION"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> "LocalS3":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
