"""Adaptive in-flight window for a batch client sharing engines with online traffic.

Additive increase while the server accepts rows, multiplicative decrease when it says
busy (or Serve refuses with back-pressure), plus capped exponential back-off with jitter
before a busy row is retried. The window only throttles; it never drops a row.
asyncio only: no Ray, no vLLM, so it is unit-tested with plain numbers.
"""

from __future__ import annotations

import asyncio
import random


class AdaptiveWindow:
    def __init__(self, initial: int, maximum: int, max_backoff_s: float, seed: int | None = None):
        if not 1 <= initial <= maximum:
            raise ValueError(f"need 1 <= initial <= maximum, got initial={initial!r} maximum={maximum!r}")
        self.limit = float(initial)
        self.maximum = maximum
        self.max_backoff_s = max_backoff_s
        self.in_flight = 0
        self.num_busy = 0
        self._rng = random.Random(seed)
        self._changed = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < int(self.limit))
            self.in_flight += 1

    async def release(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

    def on_accepted(self) -> None:
        """+1 per window's worth of accepted rows (AIMD's additive step)."""
        self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)

    def on_busy(self) -> None:
        self.num_busy += 1
        self.limit = max(1.0, self.limit / 2)

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry number `attempt` (0-based): 50 ms doubling, capped, with
        jitter in [50%, 100%] so clients do not retry in lockstep."""
        base = min(self.max_backoff_s, 0.05 * (2 ** attempt))
        return base * (0.5 + 0.5 * self._rng.random())
