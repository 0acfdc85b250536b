"""Batch rows yield to online requests on a shared replica.

Owns how many batch rows a replica runs at once given its online load, which rows pause
when an online request arrives, and in which order paused rows go on. A paused row keeps
what it has generated: the engine stops it and later continues it from its prompt plus
those tokens (`actors.engine`, `pause=`), so a pause costs one prefill of what prefix
caching no longer holds, not the row's work so far.

Why our own: vLLM's priority scheduling orders the waiting queue and preempts only when
the KV cache runs out; a running batch row keeps its place in every step, and once a step
is compute-bound (this CPU past ~8-14 tokens, a GPU at high load) each one makes the step
that serves an online request slower. Neither vLLM nor Ray Serve bounds what one class of
requests costs another inside the engine's steps; admission alone (the batch share) acts
only when rows finish, tens of steps after an online request arrived.

Rules: a replica admits up to `max_rows` batch rows (more get `busy`). With no online
request in flight they all run; while any is in flight, at most `max_rows_with_online`
(>= 1, so batch always progresses and no waiting row waits forever). The newest rows
pause first; waiting rows (paused, or admitted and not started) go on oldest first. An
admitted row waits inside the replica instead of being refused, so the batch client's
window stays full and batch resumes the moment online traffic leaves.

Knows nothing about vLLM, Ray or HTTP: the Serve replica counts online requests in and
out, the engine watches a row's `must_yield` event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import contextmanager
from typing import Iterator


class BatchSlot:
    """One admitted batch row. The engine stops the row when `must_yield` is set, then
    awaits `resume()` before it continues the row."""

    def __init__(self, gate: "BatchGate", seq: int):
        self._gate = gate
        self.seq = seq  # admission order: the oldest rows run first
        self.must_yield = asyncio.Event()
        self._wake: asyncio.Future | None = None
        self.num_pauses = 0
        self.released = False

    async def resume(self) -> None:
        """Wait (paused, holding no place among the running rows) until the gate lets
        this row run again."""
        self.num_pauses += 1
        await self._gate._wait_turn(self)

    async def turn(self) -> None:
        """Wait until this newly admitted row may start (at once unless online traffic
        holds batch back, or older rows wait)."""
        await self._gate._wait_turn(self)


class BatchGate:
    def __init__(self, max_rows: int, max_rows_with_online: int):
        if max_rows < 1 or not 1 <= max_rows_with_online:
            raise ValueError(f"max_rows and max_rows_with_online must be >= 1, got "
                             f"{max_rows!r} and {max_rows_with_online!r}")
        self.max_rows = max_rows
        self.max_rows_with_online = min(max_rows_with_online, max_rows)
        self.online_in_flight = 0
        self._running: list[BatchSlot] = []  # admission order; includes rows told to yield
        self._paused: deque[BatchSlot] = deque()
        self.num_pauses = 0
        self._num_admitted = 0
        self._num_released = 0

    # -- what the replica sees ---------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Batch rows admitted and not finished (running, yielding or waiting)."""
        return self._num_admitted - self._num_released

    @property
    def num_paused(self) -> int:
        """Rows waiting for their turn: paused mid-generation, or not started yet."""
        return len(self._paused)

    def allowed(self) -> int:
        return self.max_rows if self.online_in_flight == 0 else self.max_rows_with_online

    def try_admit(self) -> BatchSlot | None:
        """A place for a new batch row, or None when the replica holds its batch limit
        already (the caller answers busy). The row starts after `await slot.turn()`."""
        if self.num_rows >= self.max_rows:
            return None
        self._num_admitted += 1
        return BatchSlot(self, self._num_admitted)

    def release(self, slot: BatchSlot) -> None:
        """The row is finished (or failed): its place goes to a waiting row."""
        if slot.released:
            return
        slot.released = True
        self._num_released += 1
        if slot in self._running:
            self._running.remove(slot)
        elif slot in self._paused:
            self._paused.remove(slot)
        self._rebalance()

    @contextmanager
    def online_request(self) -> Iterator[None]:
        """Wraps one online request from arrival to its last byte."""
        self.online_in_flight += 1
        self._rebalance()
        try:
            yield
        finally:
            self.online_in_flight -= 1
            self._rebalance()

    # -- internals ---------------------------------------------------------------------

    async def _wait_turn(self, slot: BatchSlot) -> None:
        if slot in self._running:
            self._running.remove(slot)
        slot.must_yield.clear()
        slot._wake = asyncio.get_running_loop().create_future()
        self._paused.append(slot)
        self._paused = deque(sorted(self._paused, key=lambda s: s.seq))
        self._rebalance()
        try:
            await slot._wake
        except asyncio.CancelledError:  # the caller gave up; it still calls release()
            for queue in (self._paused, self._running):
                if slot in queue:
                    queue.remove(slot)
            self._rebalance()
            raise

    def _rebalance(self) -> None:
        allowed = self.allowed()
        going = [s for s in self._running if not s.must_yield.is_set()]
        for slot in going[allowed:]:  # newest first out
            slot.must_yield.set()
            self.num_pauses += 1
        room = allowed - len(self._running)
        while room > 0 and self._paused:
            slot = self._paused.popleft()
            self._running.append(slot)
            self._running.sort(key=lambda s: s.seq)
            if slot._wake is not None and not slot._wake.done():
                slot._wake.set_result(None)
            room -= 1
