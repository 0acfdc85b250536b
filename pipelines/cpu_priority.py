"""Batch work gives way to online serving on a node they share: a batch job that sends its
rows to a Serve app's replicas runs its own processes (driver, shard readers, the client
actor) at a lower CPU priority, so the replicas, their engines and the HTTP proxy get the
cores first when both want them.

Why our own: neither Ray nor Ray Data sets a priority per job or per stage (Ray's worker
niceness is one value for every worker of a node, replicas included). Linux keeps a nice
value per thread, so `os.nice` alone would leave threads already running (Ray's own, an
async actor's event loop) at normal priority: every thread of the process is lowered;
threads started later inherit their creator's value.
"""

from __future__ import annotations

import os


def give_way(nice: int) -> int:
    """Raise every thread of this process to at least `nice` (0 = leave all as they are).
    Returns how many threads were lowered. Never raises: where the platform refuses, the
    process stays as it was (lowering one's own priority needs no privilege on Linux)."""
    if nice <= 0:
        return 0
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread (the process, elsewhere) only
        threads = [0]
    lowered = 0
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                lowered += 1
        except OSError:  # the thread ended meanwhile, or the platform refuses
            continue
    return lowered
