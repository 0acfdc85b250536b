"""The restart lease's rule (serving.restart_lease.LeaseBook) with an injected clock: one
replica restarts at a time, never leaving fewer than the healthy minimum serving."""

import pytest

from serving.restart_lease import LeaseBook

pytestmark = pytest.mark.unit


class Clock:
    now_s = 0.0

    def __call__(self):
        return self.now_s


def test_one_restart_at_a_time_and_never_below_the_minimum():
    clock = Clock()
    book = LeaseBook(stale_s=30, clock=clock)
    granted, why = book.acquire("a", min_healthy=1)
    assert not granted and "0 other replicas alive" in why  # alone: it would leave none serving
    for r in ("a", "b", "c"):
        book.heartbeat(r)
    assert book.acquire("a", min_healthy=1)[0]
    granted, why = book.acquire("b", min_healthy=1)
    assert not granted and "replica a is restarting" in why
    book.release("a")
    assert book.acquire("b", min_healthy=2)[0]  # a and c serve meanwhile
    book.release("b")
    assert not book.acquire("c", min_healthy=3)[0]


def test_replicas_that_stopped_reporting_count_neither_as_serving_nor_as_holder():
    clock = Clock()
    book = LeaseBook(stale_s=30, clock=clock)
    book.heartbeat("a"), book.heartbeat("b")
    assert book.acquire("a", min_healthy=1)[0]
    clock.now_s = 31.0  # a went quiet while holding the lease (its replica died)
    book.heartbeat("c")
    granted, _ = book.acquire("b", min_healthy=1)
    assert granted and book.holder == "b"  # a's stale lease is gone; c serves meanwhile
    clock.now_s = 70.0  # everyone but b stale: nobody would serve during b's next restart
    book.release("b")
    assert not book.acquire("b", min_healthy=1)[0]
