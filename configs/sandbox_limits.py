"""The limits one sandboxed run gets: a plain frozen dataclass, and the one place their
defaults are stated (`CodeScoringConfig` derives its field defaults from it).

Knows nothing about how the limits are enforced: the sandbox (sandbox.launch and its
stage 2, sandbox.pid1) reads them. Standard library only, like sandbox.launch
which imports it (a test runs the two from a bare copy under a python without pydantic).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits. Every value must be positive."""

    timeout_s: float = 10.0  # wall clock, from the program's start
    cpu_s: int = 5  # RLIMIT_CPU per process: SIGXCPU at cpu_s, SIGKILL a second later
    memory_bytes: int = 512 * MiB  # RLIMIT_AS per process
    file_size_bytes: int = 8 * MiB  # RLIMIT_FSIZE: any file, stdout/stderr included
    max_processes: int = 16  # RLIMIT_NPROC for the sandbox's uid; threads count
    max_open_files: int = 64
    workdir_bytes: int = 32 * MiB  # tmpfs size of the working directory (RAM)
    max_parallel_per_node: int = 4  # sandboxes running at once on one node
    uid_base: int = 1_600_000_000  # per-slot uids uid_base .. + max_parallel_per_node - 1
    slot_wait_s: float = 3600.0  # how long to wait for a free slot

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        if self.uid_base + self.max_parallel_per_node >= 2**31:
            raise ValueError(f"SandboxLimits.uid_base + max_parallel_per_node must stay below 2**31, "
                             f"got {self.uid_base!r} + {self.max_parallel_per_node!r}")
