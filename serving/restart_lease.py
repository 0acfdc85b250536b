"""One engine restart at a time per Serve app, never below its healthy minimum.

A replica's speculation controller restarts its engine without the drafter (or back with
it) only with the lease (`control.live.LiveSpecController.lease`): while a replica
restarts it serves nothing, so the lease goes to one replica at a time, and only when at
least `min_healthy` OTHER replicas (the asker not counted) are alive to carry the load
meanwhile. Alive = reported within `stale_s`. A holder that stops reporting loses the
lease after `stale_s`.

The pool's `min_actors` counts the restarting replica: `min_healthy_during_restart` turns
it into `min_healthy = min_actors - 1`, so a pool at exactly `min_actors` may restart one
replica, and a single replica may restart at all (its requests wait at its gate for the
rebuilt engine, `actors.engine_lifecycle`). Asking for `min_actors` others instead would
leave the controller's restart lever dead on every pool at its minimum, the default
single replica included.

- `LeaseBook`: the rule, on plain numbers with an injected clock (unit-tested).
- `RestartLease`: the Ray actor that keeps one book per Serve app (named, no CPU).
- `ReplicaLease`: what a replica's controller holds: async `acquire()` / `release()`,
  plus `heartbeat()` from the replica's metrics loop.

Why our own: Serve replaces replicas for code or config changes (rolling, one at a time),
but has no call to restart one replica's engine in place with other engine arguments.
"""

from __future__ import annotations

import time
from typing import Callable

STALE_S = 30.0


def min_healthy_during_restart(min_actors: int) -> int:
    """Replicas other than the restarting one that must stay alive while it restarts, for
    a pool of at least `min_actors`: one restarts, the other `min_actors - 1` serve."""
    if min_actors < 1:
        raise ValueError(f"min_actors must be >= 1, got {min_actors!r}")
    return min_actors - 1


class LeaseBook:
    def __init__(self, stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic):
        self.stale_s, self.clock = stale_s, clock
        self.seen: dict[str, float] = {}
        self.holder: str | None = None

    def heartbeat(self, replica_id: str) -> None:
        self.seen[replica_id] = self.clock()

    def alive(self) -> set[str]:
        now = self.clock()
        return {r for r, t in self.seen.items() if now - t <= self.stale_s}

    def acquire(self, replica_id: str, min_healthy: int) -> tuple[bool, str]:
        """(granted, why): granted when nobody else alive holds the lease and at least
        `min_healthy` replicas besides `replica_id` are alive. The asker counts as alive
        (it is asking) but not toward `min_healthy`: 0 lets a lone replica restart."""
        if min_healthy < 0:
            raise ValueError(f"min_healthy must be >= 0, got {min_healthy!r}")
        self.heartbeat(replica_id)
        alive = self.alive()
        if self.holder is not None and self.holder != replica_id and self.holder in alive:
            return False, f"replica {self.holder} is restarting its engine"
        others = len(alive - {replica_id})
        if others < min_healthy:
            return False, f"{others} other replicas alive; {min_healthy} must keep serving during a restart"
        self.holder = replica_id
        return True, "granted"

    def release(self, replica_id: str) -> None:
        if self.holder == replica_id:
            self.holder = None


class RestartLease:
    """Ray actor around a `LeaseBook` (one per Serve app: `ReplicaLease` names it)."""

    def __init__(self, stale_s: float = STALE_S):
        self.book = LeaseBook(stale_s)

    def heartbeat(self, replica_id: str) -> None:
        self.book.heartbeat(replica_id)

    def acquire(self, replica_id: str, min_healthy: int) -> tuple[bool, str]:
        return self.book.acquire(replica_id, min_healthy)

    def release(self, replica_id: str) -> None:
        self.book.release(replica_id)


class ReplicaLease:
    """A replica's handle on its app's lease. Creates the app's lease actor if missing, and
    again if it died with the replica that created it (it is owned by that replica)."""

    def __init__(self, app_name: str, replica_id: str, min_healthy: int):
        """`min_healthy`: OTHER replicas that must be alive for this one to restart (from a
        pool's `min_actors`: `min_healthy_during_restart`)."""
        self.name, self.replica_id, self.min_healthy = f"peagle-restart-lease:{app_name}", replica_id, min_healthy
        self.last_answer = ""
        self._last = None  # the previous heartbeat's result
        self.actor = self._get_or_create()

    def _get_or_create(self):
        import ray

        return ray.remote(num_cpus=0)(RestartLease).options(name=self.name, get_if_exists=True).remote()

    def heartbeat(self) -> None:
        """Report alive (fire and forget); a failed previous report means the lease actor
        died with its owner, so a new one is made."""
        import ray
        from ray.exceptions import RayActorError

        if self._last is not None and ray.wait([self._last], timeout=0)[0]:
            try:
                ray.get(self._last)
            except RayActorError:
                self.actor = self._get_or_create()
        self._last = self.actor.heartbeat.remote(self.replica_id)

    async def acquire(self) -> bool:
        from ray.exceptions import RayActorError

        try:
            granted, self.last_answer = await self.actor.acquire.remote(self.replica_id, self.min_healthy)
        except RayActorError:  # its owner replica is gone: a new book (others report within stale_s)
            self.actor = self._get_or_create()
            granted, self.last_answer = False, "lease actor restarted; waiting for replicas to report"
            self.heartbeat()
        return granted

    async def release(self) -> None:
        from ray.exceptions import RayActorError

        try:
            await self.actor.release.remote(self.replica_id)
        except RayActorError:
            self.actor = self._get_or_create()
