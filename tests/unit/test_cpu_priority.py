"""A batch job's own processes give way to online serving: every thread of the process is
lowered, not only the one that asks (Linux keeps a nice value per thread). Runs in a child
process so the test session keeps its own priority."""

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, threading
from pipelines.cpu_priority import give_way

def nices():
    return sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))

stop = threading.Event()
earlier = threading.Thread(target=stop.wait)
earlier.start()
before = nices()
target = min(19, max(before) + 3)  # above whatever the test session runs at
unchanged = give_way(0)
lowered = give_way(target)
again = give_way(target)
later = threading.Thread(target=stop.wait)
later.start()
after = nices()
stop.set()
print(json.dumps({"target": target, "before": before, "unchanged": unchanged, "lowered": lowered, "again": again, "after": after}))
"""


def test_give_way_lowers_every_thread_and_threads_started_later_inherit_it():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout)
    assert len(got["before"]) == 2 and max(got["before"]) < got["target"]
    assert got["unchanged"] == 0
    assert got["lowered"] == 2 and got["again"] == 0
    assert got["after"] == [got["target"]] * 3, "both earlier threads and the one started after are lowered"
