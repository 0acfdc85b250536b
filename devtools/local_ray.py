"""A local Ray cluster for the demo: `ray start --head` on loopback, in its own process
group, temp dir, ports and token, so that stopping it stops only it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from devtools.local_s3 import free_port

READY_TIMEOUT_S = 180

# Ray keeps unix sockets under its temp dir, at <dir>/session_<date>_<time>_<pid>/sockets/
# plasma_store (about 65 bytes past <dir>), and refuses paths over 107 bytes (AF_UNIX).
_RAY_SOCKET_TAIL = 70
_AF_UNIX_MAX = 107


def _cluster_temp_dir() -> str:
    """A temp dir of the cluster's own, under the temp dir of this process when Ray's
    socket paths fit there (a test run nests TMPDIR), else under /tmp; removed at stop."""
    prefix, parent = "peagle-ray-", tempfile.gettempdir()
    name_len = len(prefix) + 8  # mkdtemp appends 8 random characters
    if len(parent) + 1 + name_len + _RAY_SOCKET_TAIL > _AF_UNIX_MAX:
        parent = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


class LocalRayCluster:
    """`ray start --head --block` in its own process group, so stopping it stops only
    this cluster (plain `ray stop` would stop every Ray on the machine)."""

    def __init__(self, num_cpus: int = 4):
        self.temp_dir = _cluster_temp_dir()
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        # Ray's token auth stays on; this cluster gets its own token, given to the
        # cluster and to `ray job submit` through the environment only.
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        ray_bin = Path(sys.executable).with_name("ray")
        self.proc = subprocess.Popen(
            [str(ray_bin), "start", "--head", "--block", f"--num-cpus={num_cpus}",
             "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={self.dashboard_port}", f"--temp-dir={self.temp_dir}",
             "--disable-usage-stats",
             # Every port its own, so this cluster never collides with another Ray here.
             *(f"--{name}={free_port()}" for name in (
                 "port", "ray-client-server-port", "dashboard-agent-listen-port",
                 "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
                 "object-manager-port", "node-manager-port"))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            # Job drivers run `python` from the cluster's PATH: make it this environment's.
            # Temp files of every process in it (vLLM's IPC sockets among them) go in its own
            # temp dir, removed with it.
            env={**os.environ, **self.auth_env, "PATH": f"{ray_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                 "TMPDIR": self._private_tmp()},
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{self.address}/api/version", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answers (401 when Ray's token auth is on): it is up
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"local Ray cluster did not come up at {self.address}")
                time.sleep(1)

    def _private_tmp(self) -> str:
        path = os.path.join(self.temp_dir, "tmp")
        os.makedirs(path, exist_ok=True)
        return path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
