"""Run untrusted Python (model-written code) in a throw-away sandbox, one process tree
per program. Linux only; uses what the OS ships: util-linux `unshare`/`setpriv`
(Essential in Debian), namespaces, rlimits, seccomp. No extra package.

How one run works. The caller takes a per-node slot (a lock file; at most
`max_parallel_per_node` sandboxes run on a node at once) and starts
`setpriv --pdeathsig KILL unshare --pid --fork --kill-child --mount --mount-proc --net
--ipc --uts python -I -S pid1.py SPEC`. Stage 2 (pid1.py) runs as PID 1 of the new
PID namespace, still privileged, and:
  * remounts every mount read-only; hides /tmp, /var/tmp, /dev/shm, /dev/mqueue, /run,
    /root, /home and $HOME under empty read-only tmpfs (re-exposing only the
    interpreter's prefix, read-only, at its own path); mounts a fresh size-limited tmpfs
    on /tmp as the working directory; checks with statvfs that nothing else is writable
    (fail closed);
  * forks the program: new session; uid/gid = a per-slot uid that owns nothing (as
    root; without root: root of a user namespace with SECBIT_NOROOT, so no capabilities
    after exec); no_new_privs; rlimits (CPU time, address space, file size, processes,
    open files, no core); a seccomp filter (x86_64) refusing namespace, mount, ptrace,
    keyring, bpf, perf, io_uring, module and kexec syscalls; a cleared environment; then
    `exec python -I -S main.py` with stdin /dev/null;
  * reaps everything, enforces the wall-clock timeout (SIGKILL to the whole namespace),
    and reports exit status, CPU time and leftover processes on a file descriptor only
    it holds. When PID 1 exits the kernel kills whatever the program left behind, and the
    mount namespace with its tmpfs disappears: nothing is written to the host's disk
    except the program's stdout/stderr files (bounded by RLIMIT_FSIZE).
As root, RLIMIT_NPROC does not bind (the kernel exempts uid 0), hence the per-slot uid:
the process limit counts per uid, so each concurrent sandbox needs its own.

The boundary this gives: no network (empty network namespace, loopback down; abstract
unix sockets are per namespace, socket files under the hidden paths are invisible); no
writes outside its working directory; no view of, or signal to, host processes; no new
namespaces or mounts; a bounded number of processes, memory per process, CPU seconds
per process, bytes per file, and wall-clock seconds; neither the caller's environment
(credentials) nor files under the hidden paths are visible.

What it does NOT protect against:
  * kernel bugs: it shares the host kernel (no VM); seccomp is a deny-list of the
    riskiest calls, x86_64 only (elsewhere namespaces + rlimits only);
  * reads of world-readable host files outside the hidden paths (source trees, /etc);
  * aggregate resources: memory is limited per process (RLIMIT_AS), so one sandbox can
    hold up to max_processes x memory_bytes (+ its tmpfs); cgroups would give hard totals;
  * CPU contention and timing side channels between concurrent sandboxes;
  * forged results: the program runs in one process with its test harness, so code that
    targets the scorer (e.g. reads its own source for the pass marker) can fake a pass;
  * hosts where namespaces are not permitted (e.g. unprivileged containers under a
    default seccomp profile): the sandbox refuses to run (`check_available`), it never
    falls back to running unsandboxed.
Programs cannot use POSIX shared memory or semaphores (/dev/shm is read-only), so
`multiprocessing` pools fail; fork, threads and subprocesses work within the limits.

This module is the caller's side (slots, the command line, classifying how a run ended);
stage 2 is sandbox.pid1. The limits a run gets are configs.sandbox_limits.SandboxLimits
(plain values; this module enforces them).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Iterator

from configs.sandbox_limits import SandboxLimits  # also importable from here, as callers do
from sandbox.pid1 import MAX_PROGRAM_BYTES, SAMPLE_ENV

PID1_SCRIPT = os.path.join(os.path.dirname(os.path.realpath(__file__)), "pid1.py")
HIDDEN_PATHS = ("/var/tmp", "/dev/shm", "/dev/mqueue", "/run", "/root", "/home")
TAIL_BYTES = 4096
OUTER_GRACE_S = 20.0  # stage-2 start-up on a loaded node; the inner timer is the real one
STATUSES = ("ok", "error", "timeout", "cpu_time_limit", "memory_limit", "file_size_limit",
            "process_limit", "signal", "sandbox_error")


class SandboxUnavailable(RuntimeError):
    """This host cannot sandbox (no namespaces, no util-linux); nothing was run."""


@dataclass(frozen=True)
class SandboxResult:
    status: str  # one of STATUSES; "ok" = exit code 0
    detail: str  # why, in words (the exception line, the limit hit)
    exit_code: int | None = None
    signal: str | None = None
    wall_s: float = 0.0
    cpu_s: float | None = None
    num_processes_left: int = 0
    stdout_tail: str = ""
    stderr_tail: str = ""


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `source` as `main.py` in a fresh sandbox and say how it ended. Blocks until a
    per-node slot is free. Never raises for anything the program does."""
    program = source.encode("utf-8", errors="replace")
    if len(program) > MAX_PROGRAM_BYTES:
        return SandboxResult("sandbox_error", f"program is {len(program)} bytes, limit {MAX_PROGRAM_BYTES}")
    tools = {name: shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin") for name in ("unshare", "setpriv")}
    if None in tools.values():
        return SandboxResult("sandbox_error", f"util-linux tools missing: {tools!r}")
    with _node_slot(limits) as slot, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as status:
        root = os.geteuid() == 0
        uid = node_uid_base(limits) + slot if root else None
        exe = os.path.realpath(sys.executable)
        spec = {"limits": asdict(limits), "uid": uid, "status_fd": status.fileno(), "python": exe,
                "expose": [os.path.realpath(sys.base_prefix)], "hide": _hidden_paths()}
        ns = ["--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--net", "--ipc", "--uts"]
        if not root:
            ns = ["--user", "--map-root-user", *ns]
        cmd = [tools["setpriv"], "--pdeathsig", "KILL", tools["unshare"], *ns,
               exe, "-I", "-S", "-B", PID1_SCRIPT, json.dumps(spec)]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, env=SAMPLE_ENV,
                                pass_fds=(status.fileno(),), start_new_session=True)
        try:
            proc.communicate(program, timeout=limits.timeout_s + OUTER_GRACE_S)
            outer_timeout = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # unshare and PID 1: the namespace dies
            proc.wait()
            outer_timeout = True
        if outer_timeout and uid is not None:
            # Normally PID 1's exit waits until its namespace is empty; killed from
            # outside, make sure before this slot's uid is handed out again.
            _wait_uid_gone(uid, timeout_s=10.0)
        status.seek(0)
        raw = status.read().decode(errors="replace")
        report = json.loads(raw) if raw.strip() else None
        return _classify(report, proc.returncode, outer_timeout, _tail(out), _tail(err),
                         limits, time.monotonic() - started)


@lru_cache(maxsize=None)
def check_available(limits: SandboxLimits = SandboxLimits()) -> None:
    """Raise `SandboxUnavailable` unless a trivial program runs sandboxed on this node
    (cached per process). Jobs call it before scoring: no silent unsandboxed fallback."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the sandbox needs Linux, got {sys.platform!r}")
    result = run_python("import os\nprint('sandbox-ok', os.getpid())\n", limits)
    if result.status != "ok" or "sandbox-ok 2" not in result.stdout_tail:
        raise SandboxUnavailable(f"sandbox self-test failed: {result.status}: {result.detail}")


def _hidden_paths() -> list[str]:
    home = os.environ.get("HOME", "")
    paths = [*HIDDEN_PATHS, *([home] if home not in ("", "/") else [])]
    seen = []
    for path in paths:
        real = os.path.realpath(path)
        if os.path.isdir(path) and not os.path.islink(path) and real not in seen and real != "/":
            seen.append(real)
    return seen


@contextmanager
def _node_slot(limits: SandboxLimits) -> Iterator[int]:
    """A free slot on this node (flock on one of N lock files, released on exit or if the
    holder dies): the per-node bound on concurrent sandboxes and each one's own uid."""
    # A fixed path (not $TMPDIR): every process on the node must share the same slots.
    # PEAGLE_SANDBOX_LOCK_DIR moves it (set for a whole node, e.g. a test run of its own).
    lock_dir = os.environ.get("PEAGLE_SANDBOX_LOCK_DIR") or f"/tmp/peagle-sandbox-{os.geteuid()}"
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    if os.stat(lock_dir).st_uid != os.geteuid():
        raise PermissionError(f"{lock_dir} belongs to uid {os.stat(lock_dir).st_uid}, not to this user")
    deadline = time.monotonic() + limits.slot_wait_s
    while True:
        for slot in range(limits.max_parallel_per_node):
            fd = os.open(os.path.join(lock_dir, f"slot-{slot}.lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield slot
            finally:
                os.close(fd)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no free sandbox slot of {limits.max_parallel_per_node} in {limits.slot_wait_s}s")
        time.sleep(0.02)


def node_uid_base(limits: SandboxLimits) -> int:
    """The first of this node's per-slot uids: `limits.uid_base`, or PEAGLE_SANDBOX_UID_BASE.
    Slots and uids go together: a run with slots of its own (PEAGLE_SANDBOX_LOCK_DIR, e.g. a
    test suite beside another on one machine) needs uids of its own too, or its sandboxes
    share a process limit and a leak check with the other run's."""
    raw = os.environ.get("PEAGLE_SANDBOX_UID_BASE")
    if not raw:
        return limits.uid_base
    if not raw.isdigit() or int(raw) + limits.max_parallel_per_node >= 2**31:
        raise ValueError(f"PEAGLE_SANDBOX_UID_BASE must be a uid below 2**31 - {limits.max_parallel_per_node}, got {raw!r}")
    return int(raw)


def _wait_uid_gone(uid: int, timeout_s: float) -> None:
    """Slots are reused: make sure no process of this slot's uid is still exiting."""
    deadline = time.monotonic() + timeout_s
    while processes_of_uids(range(uid, uid + 1)) and time.monotonic() < deadline:
        time.sleep(0.01)


def processes_of_uids(uids: range) -> list[int]:
    """PIDs on this host whose real uid is in `uids` (for leak checks)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    uid_line = next(line for line in f if line.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(uid_line.split()[1]) in uids:
                found.append(int(name))
    return found


def _tail(f) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - TAIL_BYTES))
    return f.read().decode("utf-8", errors="replace")


def _classify(report, returncode, outer_timeout, out, err, limits, wall_s) -> SandboxResult:
    def result(status: str, detail: str) -> SandboxResult:
        rep = report or {}
        return SandboxResult(status, detail, rep.get("exit_code"), rep.get("signal"), round(wall_s, 3),
                             rep.get("cpu_s"), rep.get("num_processes_left", 0), out, err)

    if report is None:
        if outer_timeout:
            return result("timeout", f"no result within {limits.timeout_s + OUTER_GRACE_S:g}s; sandbox killed")
        return result("sandbox_error", f"sandbox exited {returncode} without a report: {err[-500:].strip()}")
    if "setup_error" in report:
        return result("sandbox_error", report["setup_error"])
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    sig, cpu = report.get("signal"), report.get("cpu_s") or 0.0
    if report["timed_out"]:
        status, detail = "timeout", f"wall-clock limit of {limits.timeout_s:g}s exceeded"
    elif sig == "SIGXCPU" or (sig == "SIGKILL" and cpu >= limits.cpu_s):
        status, detail = "cpu_time_limit", f"CPU-time limit of {limits.cpu_s}s per process exceeded"
    elif sig == "SIGXFSZ" or "File too large" in last:
        status, detail = "file_size_limit", f"file-size limit of {limits.file_size_bytes} bytes exceeded: {last}"
    elif report["exit_code"] == 0:
        status, detail = "ok", "exit code 0"
    elif last.startswith("MemoryError") or "Cannot allocate memory" in last:
        status, detail = "memory_limit", f"memory limit of {limits.memory_bytes} bytes per process: {last}"
    elif "BlockingIOError" in last or "Resource temporarily unavailable" in last:
        status, detail = "process_limit", f"process limit of {limits.max_processes} reached: {last}"
    elif sig is not None:
        status, detail = "signal", f"killed by {sig}"
    else:
        status, detail = "error", last or f"exit code {report['exit_code']}"
    left = report.get("num_processes_left", 0)
    if status not in ("ok", "process_limit") and left >= limits.max_processes - 1:
        status, detail = "process_limit", (f"process limit of {limits.max_processes} reached "
                                           f"({left} still running at the end); then {detail}")
    return result(status, detail)
