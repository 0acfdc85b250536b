"""Shared test plumbing: the repo root on sys.path, the venv's python for subprocesses,
and a state directory of this run's own.

Everything the suite's processes would otherwise keep in shared places (Ray's session
directory under /tmp/ray, vLLM's IPC sockets and rendezvous files and every other temp
file under /tmp, pytest's tmp_path base, the sandbox's slot locks and uids, vLLM's and torch's
caches and usage stats under ~, matplotlib's config) goes under one fresh temporary directory, set in the environment before Ray or
vLLM is imported (child processes inherit it) and removed when the run ends. Two suites
on one machine then never see each other's Ray sessions or caches. Ray's auth token is
given through the environment, so Ray writes none to ~/.ray.
"""

import atexit
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

STATE_DIR = Path(tempfile.mkdtemp(prefix="peagle-tests-"))
atexit.register(shutil.rmtree, STATE_DIR, ignore_errors=True)
for var, sub in {
    "RAY_TMPDIR": "ray",  # Ray's session directories (default /tmp/ray)
    "TMPDIR": "tmp",  # vLLM's ZMQ sockets and vllm_dist_* files, and any other temp file
    "VLLM_RPC_BASE_PATH": "tmp",
    "PEAGLE_SANDBOX_LOCK_DIR": "sandbox-slots",
    "XDG_CACHE_HOME": "cache",  # default ~/.cache
    "VLLM_CACHE_ROOT": "cache/vllm",
    "VLLM_CONFIG_ROOT": "config/vllm",
    "HF_HOME": "cache/huggingface",
    "TORCHINDUCTOR_CACHE_DIR": "cache/inductor",
    "TRITON_CACHE_DIR": "cache/triton",
    "MPLCONFIGDIR": "config/matplotlib",
}.items():
    os.environ[var] = str(STATE_DIR / sub)
    (STATE_DIR / sub).mkdir(parents=True, exist_ok=True)
# The sandbox's per-slot uids go with its slots: this run's own, so that a fork bomb or a
# leak check here never meets another suite's sandboxes on the same machine.
os.environ["PEAGLE_SANDBOX_UID_BASE"] = str(1_600_000_000 + 64 * secrets.randbelow(100_000))
tempfile.tempdir = os.environ["TMPDIR"]  # this process too (pytest's tmp_path base included)
os.environ["VLLM_NO_USAGE_STATS"] = "1"
os.environ["VLLM_DO_NOT_TRACK"] = "1"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# Ray 2.60 turns token auth on for a new local cluster and, with no token given, writes one
# to ~/.ray/auth_token. Auth stays on; this run's token comes through the environment, so
# nothing is written under ~ (every Ray process of the run inherits it).
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
# Serve kills a proxy that is not ready within 5 s (health check 10 s); starting a Python
# worker on a loaded 2-core machine takes longer, and `serve.start` then fails on a killed
# proxy. These are bounds on a start-up, not speeds; a deployment on real nodes keeps
# Serve's defaults.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT
