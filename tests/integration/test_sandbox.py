"""The sandbox contains hostile programs, and the host is checked after each one.

Real namespaces, real rlimits, real processes; no Ray. Every hostile program runs under
small limits (a few processes, 256 MiB, seconds), the limits are applied in the child
before `exec`, and each run is bounded by the sandbox's own wall-clock timer plus the
caller's. After each test the host is checked: no process of a sandbox uid is left, the
world-writable canary outside the sandbox is untouched, this process can still fork.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from sandbox.launch import SandboxLimits, check_available, node_uid_base, processes_of_uids, run_python

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = SandboxLimits(timeout_s=5, cpu_s=1, memory_bytes=256 << 20, file_size_bytes=1 << 20,
                      max_processes=8, max_parallel_per_node=2)
SANDBOX_UIDS = range(node_uid_base(SMALL), node_uid_base(SMALL) + 64)  # this run's (tests/conftest.py)


@pytest.fixture(scope="module", autouse=True)
def sandbox_works():
    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox is Linux-only")
    check_available(SMALL)


def _visible_dir():
    """A host directory the sandbox sees (read-only): not under /tmp, /run or $HOME, which
    it hides altogether. /var/lib when we may write there (root, as in CI), else the repo."""
    return Path("/var/lib") if os.access("/var/lib", os.W_OK) else REPO_ROOT / ".pytest_cache"


@pytest.fixture()
def canary():
    """A world-writable file outside the sandbox's view of /tmp: only the read-only
    mount can protect it (file permissions would not)."""
    directory = _visible_dir() / f"sandbox-canary-{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True)
    path = directory / "keep.txt"
    path.write_text("untouched\n")
    directory.chmod(0o777)
    path.chmod(0o666)
    yield path
    shutil.rmtree(directory)


@pytest.fixture(autouse=True)
def host_unaffected(canary):
    yield
    # The scorer (this process) is alive and can still start processes.
    assert subprocess.run(["true"], timeout=30).returncode == 0
    assert processes_of_uids(SANDBOX_UIDS) == [], "a sandboxed process outlived its sandbox"
    assert canary.read_text() == "untouched\n"
    assert sorted(os.listdir(canary.parent)) == ["keep.txt"]


def test_program_runs_unprivileged_in_a_throwaway_dir_with_nothing_else_visible():
    program = """
import os, socket
open("scratch.txt", "w").write("mine")
print("uid", os.getuid(), "cwd", os.getcwd(), "files", sorted(os.listdir(".")))
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("tmp-hidden", os.listdir("/run"), os.listdir("/dev/shm"))
print("env", sorted(os.environ))
"""
    result = run_python(program, SMALL)
    assert result.status == "ok", result
    out = result.stdout_tail
    if os.geteuid() == 0:
        assert f"uid {SANDBOX_UIDS[0]}" in out or f"uid {SANDBOX_UIDS[1]}" in out
    assert "cwd /tmp files ['main.py', 'scratch.txt']" in out
    assert "pids [1, 2]" in out  # the supervisor and the program: no host process
    assert "tmp-hidden [] []" in out
    assert "AWS" not in out  # the caller's environment (credentials) is not passed
    # The working directory is gone with the sandbox.
    assert run_python("import os; print(sorted(os.listdir('.')))", SMALL).stdout_tail.strip() == "['main.py']"


HOSTILE = {
    # name: (program, limits overrides, expected status, words the detail must contain)
    "infinite_loop": ("while True:\n    pass\n", {"timeout_s": 30}, "cpu_time_limit", "CPU-time limit"),
    "sleep_forever": ("import time\ntime.sleep(10**6)\n", {"timeout_s": 2}, "timeout", "wall-clock"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", {}, "process_limit", "process limit of 8"),
    "fork_bomb_swallowing_errors": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        {"timeout_s": 3}, "process_limit", "process limit of 8"),
    "allocate_10_gb": ("x = bytearray(10 * 2**30)\n", {}, "memory_limit", "MemoryError"),
    "grow_until_oom": ("a = []\nwhile True:\n    a.append(b'x' * 2**20)\n", {}, "memory_limit", "MemoryError"),
    "open_socket": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)\n", {},
                    "error", "Network is unreachable"),
    "connect_loopback": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=3)\n", {},
                         "error", "Network is unreachable"),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", {},
                    "error", "Operation not permitted"),
    "kill_every_process": ("import os, signal\nos.kill(-1, signal.SIGKILL)\n", {},
                           "error", "No such process"),
    "flood_stdout": ("while True:\n    print('x' * 10000)\n", {}, "file_size_limit", "File too large"),
    "fill_disk": ("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)\n", {},
                  "file_size_limit", "File too large"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained_and_the_result_says_why(name):
    program, overrides, status, words = HOSTILE[name]
    limits = SandboxLimits(**{**SMALL.__dict__, **overrides})
    peak = _watch_sandbox_processes()
    result = run_python(program, limits)
    num_peak = peak()
    assert result.status == status, result
    assert words in result.detail, result
    assert num_peak <= limits.max_processes, f"{num_peak} sandbox processes at once"


def test_killing_the_scorer_by_its_host_pid_is_impossible():
    result = run_python(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n", SMALL)
    assert result.status == "error" and "No such process" in result.detail  # PID namespace


def test_files_outside_the_workdir_cannot_be_written_or_deleted(canary):
    program = f"""
import os
for attempt in (lambda: open({str(canary)!r}, "w").write("pwned"),
                lambda: os.remove({str(canary)!r}),
                lambda: open({str(canary.parent / "new.txt")!r}, "w").write("x"),
                lambda: os.remove({str(REPO_ROOT / "pyproject.toml")!r}),
                lambda: open("/dev/shm/x", "w"),
                lambda: open("/etc/passwd", "a")):
    try:
        attempt()
        print("WROTE")
    except OSError as exc:
        print(type(exc).__name__, exc.strerror)
"""
    result = run_python(program, SMALL)
    assert result.status == "ok", result
    assert "WROTE" not in result.stdout_tail
    outcomes = result.stdout_tail.strip().splitlines()
    assert len(outcomes) == 6, result.stdout_tail
    assert all(line.endswith("Read-only file system") for line in outcomes[:3]), outcomes  # the canary
    refused = ("Read-only file system", "No such file or directory", "Permission denied")
    assert all(line.endswith(refused) for line in outcomes), outcomes  # hidden paths read as absent
    assert (REPO_ROOT / "pyproject.toml").exists()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is x86_64-only")
def test_kernel_surface_syscalls_are_refused_but_processes_and_threads_work():
    program = """
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(ret):
    return os.strerror(ctypes.get_errno()) if ret == -1 else "ALLOWED"
print("unshare", errno_of(libc.unshare(0x10000000)))
print("clone-newuser", errno_of(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)))
print("ptrace", errno_of(libc.ptrace(16, 1, 0, 0)))
print("mount", errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
t = threading.Thread(target=lambda: None); t.start(); t.join()
print("child", subprocess.run(["/bin/echo", "ran"], capture_output=True, text=True).stdout.strip())
"""
    result = run_python(program, SMALL)
    assert result.status == "ok", result
    for call in ("unshare", "clone-newuser", "ptrace", "mount"):
        assert f"{call} Operation not permitted" in result.stdout_tail
    assert "child ran" in result.stdout_tail


def test_exit_zero_is_reported_as_ok_only_with_its_real_output():
    result = run_python("import sys\nprint('partial')\nsys.exit(0)\nprint('never')\n", SMALL)
    assert result.status == "ok" and result.stdout_tail.strip() == "partial"


def test_concurrent_sandboxes_never_exceed_the_per_node_bound():
    limits = SandboxLimits(**{**SMALL.__dict__, "max_parallel_per_node": 2})
    program = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())\n"
    results = []
    threads = [threading.Thread(target=lambda: results.append(run_python(program, limits))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 5 and all(r.status == "ok" for r in results), results
    intervals = [tuple(map(float, r.stdout_tail.split())) for r in results]
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak <= 2


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="needs root to start a non-root caller, and a system python it can run")
def test_without_root_the_sandbox_uses_a_user_namespace_and_still_limits_processes(tmp_path):
    """A non-root scorer (e.g. Ray workers as a plain user): same boundary, via a user
    namespace; the program holds no capabilities and the process limit binds."""
    # Under /tmp itself (removed below): that user cannot enter this run's private temp dir.
    workdir = Path(tempfile.mkdtemp(prefix="sandbox-nonroot-", dir="/tmp"))
    try:
        slots = workdir / "slots"  # that user's slot locks, in a place this test removes
        slots.mkdir(mode=0o700)
        os.chown(slots, 4242, 4242)
        # The sandbox's own files, stdlib only: the system python has no pydantic, hence an
        # empty configs/__init__.py in place of the real one.
        for package, names in (("sandbox", ("__init__.py", "launch.py", "pid1.py")),
                               ("configs", ("sandbox_limits.py",))):
            (workdir / package).mkdir()
            for name in names:
                shutil.copy(REPO_ROOT / package / name, workdir / package / name)
        (workdir / "configs" / "__init__.py").touch()
        (workdir / "probe.py").write_text(
            "import sys; sys.path.insert(0, sys.argv[1])\n"
            "from sandbox.launch import SandboxLimits, run_python\n"
            "L = SandboxLimits(timeout_s=5, cpu_s=1, max_processes=4, max_parallel_per_node=1)\n"
            "caps = run_python(\"print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')])\", L)\n"
            "bomb = run_python('import os\\nwhile True:\\n    os.fork()\\n', L)\n"
            "write = run_python(\"open('/usr/x', 'w')\", L)\n"
            "print(caps.status, caps.stdout_tail.strip(), '|', bomb.status, '|', write.detail)\n")
        for d in (workdir, workdir / "sandbox", workdir / "configs"):
            d.chmod(0o755)
        for f in [*workdir.glob("*.py"), *(workdir / "sandbox").iterdir(), *(workdir / "configs").iterdir()]:
            f.chmod(0o644)
        proc = subprocess.run(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "/usr/bin/python3",
                               str(workdir / "probe.py"), str(workdir)],
                              capture_output=True, text=True, timeout=120, env={"HOME": str(workdir), "PATH": "/usr/bin:/bin",
                                   "PEAGLE_SANDBOX_LOCK_DIR": str(slots)})
        if "Operation not permitted" in proc.stdout + proc.stderr and "unshare" in proc.stdout + proc.stderr:
            pytest.skip("unprivileged user namespaces are disabled on this host")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().startswith("ok ['0000000000000000'] | process_limit | ")
        assert "Read-only file system" in proc.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _watch_sandbox_processes():
    """Sample the number of sandbox-uid processes on the host until called; returns the peak."""
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], len(processes_of_uids(SANDBOX_UIDS)))
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def done() -> int:
        stop.set()
        thread.join(timeout=10)
        return peak[0]

    return done
