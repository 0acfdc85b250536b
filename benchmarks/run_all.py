"""`make bench`: run every benchmark in `BENCHMARKS`, one after the other, with its defaults.

    python -m benchmarks.run_all

Each entry is a module with `main(argv) -> int` that prints its own table and writes its
results under out/bench/. A failing benchmark does not stop the others; the exit status
is non-zero if any failed. To add a benchmark, append its module name.
"""

from __future__ import annotations

import importlib
import sys
import time

BENCHMARKS = [
    "benchmarks.codegen_throughput",
    "benchmarks.peagle_table",
    "benchmarks.online_vs_batch",
    "benchmarks.serve_overhead",
    "benchmarks.controller_sim",
    "benchmarks.controller_live",
    "benchmarks.memory_flat",
]


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"=== {name}", flush=True)
        started = time.monotonic()
        try:
            status = importlib.import_module(name).main([])
        except Exception as exc:  # noqa: BLE001 -- one broken benchmark must not hide the others
            print(f"{name} raised {type(exc).__name__}: {exc}", flush=True)
            status = 1
        print(f"=== {name}: {'ok' if status == 0 else f'FAILED ({status})'} "
              f"in {time.monotonic() - started:.0f}s", flush=True)
        if status != 0:
            failed.append(name)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
