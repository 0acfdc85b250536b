"""Stage 2 of a sandboxed run (the caller's side and the boundary it gives: sandbox.launch).

Started as `setpriv ... unshare --pid --fork ... python -I -S -B pid1.py SPEC`,
it runs as PID 1 of the new PID namespace, still privileged: sets up the filesystem view,
forks the program with its uid, rlimits and seccomp filter, supervises it, and reports
how it ended as JSON on a file descriptor only it holds.

Standard library only, and nothing from this project: with `-I` it cannot import the
package it lives in, and it runs once per sample, so it must start fast.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import struct
import sys
import time

MiB = 1 << 20
WORKDIR = "/tmp"
MAX_PROGRAM_BYTES = 4 * MiB
SAMPLE_ENV = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "TMPDIR": WORKDIR}

# <sys/mount.h>, <linux/prctl.h>, <linux/securebits.h>
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
PRESERVED_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                   "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 28, 22, 2
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1, 2
# seccomp (x86_64 only): syscalls a scored program never needs that open kernel surface
# (namespaces, mounts, ptrace, keyrings, bpf, perf, io_uring, modules, kexec, ...).
AUDIT_ARCH_X86_64, X32_SYSCALL_BIT = 0xC000003E, 0x40000000
SYS_CLONE, SYS_CLONE3 = 56, 435
DENIED_SYSCALLS_X86_64 = (
    101, 155, 161, 163, 165, 166, 167, 168, 169, 175, 176, 179, 246, 248, 249, 250, 272, 298,
    304, 308, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442,
)  # ptrace pivot_root chroot acct mount umount2 swapon swapoff reboot init/delete_module
#   quotactl kexec_load add_key request_key keyctl unshare perf_event_open open_by_handle_at
#   setns finit_module kexec_file_load bpf userfaultfd io_uring_* open_tree move_mount
#   fsopen fsconfig fsmount fspick mount_setattr
CLONE_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else str(s).encode())
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source} on {target}: {os.strerror(code)}")


def _mount_points() -> list[tuple[str, list[str]]]:
    with open("/proc/self/mountinfo") as f:
        fields = [line.split() for line in f]
    # Mount points are octal-escaped (space = \040).
    unescape = (lambda p: p.encode().decode("unicode_escape").encode("latin-1").decode())
    return [(unescape(x[4]), x[5].split(",")) for x in fields]


def _setup_filesystem(libc, spec) -> None:
    expose = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in spec["expose"]]
    for mount_point, options in _mount_points():
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        flags |= sum(v for k, v in PRESERVED_FLAGS.items() if k in options)
        try:
            _mount(libc, None, mount_point, None, flags)
        except OSError as exc:  # shadowed by a later mount: unreachable, checked below
            if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.EACCES):
                raise
    uid = spec["uid"] or 0
    limits = spec["limits"]
    overlays = [(path, "size=64k,nr_inodes=256,mode=0755") for path in spec["hide"]]
    overlays.append((WORKDIR, f"size={limits['workdir_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={uid}"))
    for path, data in overlays:
        base = MS_NOSUID | MS_NODEV | MS_NOEXEC
        _mount(libc, "tmpfs", path, "tmpfs", base, data)
        for target, fd in expose:  # put the interpreter back, read-only, at its own path
            if target.startswith(path.rstrip("/") + "/"):
                os.makedirs(target, mode=0o755, exist_ok=True)
                _mount(libc, f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
                _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        if path != WORKDIR:
            _mount(libc, None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | base)
    for mount_point, _ in _mount_points():  # fail closed: only the workdir may be writable
        try:
            writable = not os.statvfs(mount_point).f_flag & os.ST_RDONLY
        except OSError:
            continue  # not reachable by path
        if writable and mount_point != WORKDIR:
            raise RuntimeError(f"{mount_point} is still writable inside the sandbox")


def _exec_program(libc, spec, error_fd: int) -> None:
    """In the forked child: drop everything, then exec the interpreter on main.py."""
    limits, uid = spec["limits"], spec["uid"]
    os.setsid()
    os.chdir(WORKDIR)
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # all capabilities are gone with uid 0
    elif libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECUREBITS)")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    cpu = int(limits["cpu_s"])
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_AS, int(limits["memory_bytes"])),
                       (resource.RLIMIT_FSIZE, int(limits["file_size_bytes"])),
                       # Without root, unshare and PID 1 share the (namespaced) uid: +2.
                       (resource.RLIMIT_NPROC, int(limits["max_processes"]) + (0 if uid is not None else 2)),
                       (resource.RLIMIT_NOFILE, int(limits["max_open_files"])),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    _install_seccomp(libc)  # last: from here on only what the program itself may do
    os.closerange(3, error_fd)
    os.closerange(error_fd + 1, 1 << 16)
    exe = spec["python"]
    os.execve(exe, [exe, "-I", "-S", "-B", "main.py"], SAMPLE_ENV)


def _seccomp_program() -> bytes:
    """Classic BPF: wrong arch -> kill; x32 or a denied syscall -> EPERM; clone with a
    namespace flag -> EPERM; clone3 -> ENOSYS (its flags are out of reach; libc then
    falls back to clone); anything else allowed."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny, nosys, kill = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS, 0x80000000
    body = [(ld, 0, 0, 0), (jge, "DENY", 0, X32_SYSCALL_BIT)]
    body += [(jeq, "DENY", 0, nr) for nr in DENIED_SYSCALLS_X86_64]
    body += [(jeq, "NOSYS", 0, SYS_CLONE3), (jeq, 0, "ALLOW", SYS_CLONE), (ld, 0, 0, 16),
             (jset, "DENY", "ALLOW", CLONE_NAMESPACE_FLAGS)]
    prog = [(ld, 0, 0, 4), (jeq, 0, "KILL", AUDIT_ARCH_X86_64), *body]
    labels = {"ALLOW": len(prog), "DENY": len(prog) + 1, "NOSYS": len(prog) + 2, "KILL": len(prog) + 3}
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, nosys), (ret, 0, 0, kill)]

    def offset(target, here):
        return labels[target] - here - 1 if isinstance(target, str) else target

    return b"".join(struct.pack("<HBBI", code, offset(jt, i), offset(jf, i), k)
                    for i, (code, jt, jf, k) in enumerate(prog))


def _install_seccomp(libc) -> bool:
    if os.uname().machine != "x86_64":
        return False  # syscall numbers differ per architecture; namespaces + rlimits only
    code = _seccomp_program()
    filters = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("<HxxxxxxQ", len(code) // 8, ctypes.addressof(filters))
    fprog_buf = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_ulong(ctypes.addressof(fprog_buf)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True


def _supervise(child: int, timeout_s: float) -> dict:
    """Reap every process (PID 1 inherits orphans) until the program exits or time is up."""
    deadline = time.monotonic() + timeout_s
    delay, timed_out = 0.0005, False
    while True:
        pid, wstatus, usage = os.wait4(-1, os.WNOHANG)
        if pid == child:
            left = _num_processes() - 1  # what it left running, without PID 1
            break
        if pid == 0:
            if time.monotonic() >= deadline:
                timed_out, left = True, _num_processes() - 2
                os.kill(-1, signal.SIGKILL)  # everything in this namespace but PID 1
                _, wstatus, usage = os.wait4(child, 0)
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
    sig = os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else None
    return {"timed_out": timed_out, "exit_code": os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else None,
            "signal": signal.Signals(sig).name if sig else None, "num_processes_left": left,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "max_rss_kb": usage.ru_maxrss}


def _num_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def _stage2(spec: dict) -> int:
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        program = sys.stdin.buffer.read(MAX_PROGRAM_BYTES + 1)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # if the node runs out of memory, this goes first
        os.umask(0o022)
        _setup_filesystem(libc, spec)
        fd = os.open(os.path.join(WORKDIR, "main.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, program)
        if spec["uid"] is not None:
            os.fchown(fd, spec["uid"], spec["uid"])
        os.close(fd)
        error_r, error_w = os.pipe2(os.O_CLOEXEC)
        child = os.fork()
    except BaseException as exc:
        os.write(status_fd, json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}).encode())
        return 1
    if child == 0:
        try:
            os.close(error_r)
            _exec_program(libc, spec, error_w)
        except BaseException as exc:
            os.write(error_w, f"{type(exc).__name__}: {exc}".encode())
        os._exit(127)
    os.close(error_w)
    exec_error = os.read(error_r, 4096).decode(errors="replace")  # EOF = exec succeeded
    report = _supervise(child, float(spec["limits"]["timeout_s"]))
    if exec_error:
        report = {"setup_error": f"starting the program: {exec_error}"}
    os.write(status_fd, json.dumps(report).encode())
    return 0


if __name__ == "__main__":
    sys.exit(_stage2(json.loads(sys.argv[1])))
