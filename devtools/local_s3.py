"""A local S3 endpoint (moto's server on 127.0.0.1) for the demo and the tests.

Starts `moto.server` as a child process on a free loopback port, waits (bounded) until it
answers, sets dummy AWS credentials in this process's environment (child processes such
as Ray workers inherit them), and stops it on exit. Only ever binds 127.0.0.1.
"""

from __future__ import annotations

import os
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


def free_port() -> int:
    """A free TCP port on 127.0.0.1 at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
