"""The restart lease's rule (serving.restart_lease.LeaseBook) with an injected clock: one
replica restarts at a time, while at least `pool.min_actors - 1` others keep serving
(`min_healthy_during_restart`: the pool's minimum counts the restarting replica)."""

import pytest

from serving.restart_lease import LeaseBook, min_healthy_during_restart

pytestmark = pytest.mark.unit


class Clock:
    now_s = 0.0

    def __call__(self):
        return self.now_s


def book_with(replicas, clock=None) -> LeaseBook:
    book = LeaseBook(stale_s=30, clock=clock or Clock())
    for r in replicas:
        book.heartbeat(r)
    return book


def test_a_single_replica_pool_at_its_minimum_may_restart():
    book = book_with(["a"])
    granted, why = book.acquire("a", min_healthy=min_healthy_during_restart(1))
    assert granted and why == "granted" and book.holder == "a"


def test_a_pool_at_exactly_min_actors_may_restart_one_replica_at_a_time():
    book = book_with(["a", "b"])
    assert book.acquire("a", min_healthy=min_healthy_during_restart(2))[0]  # b serves meanwhile
    granted, why = book.acquire("b", min_healthy=min_healthy_during_restart(2))
    assert not granted and "replica a is restarting" in why
    book.release("a")
    assert book.acquire("b", min_healthy=min_healthy_during_restart(2))[0]  # now a serves


def test_a_pool_below_min_actors_may_not_restart():
    book = book_with(["a", "b"])  # min_actors=3 but only two alive: a restart would leave one
    granted, why = book.acquire("a", min_healthy=min_healthy_during_restart(3))
    assert not granted and "1 other replicas alive; 2 must keep serving" in why
    assert book.holder is None
    book.heartbeat("c")  # the third is back: a restart leaves two serving
    assert book.acquire("a", min_healthy=min_healthy_during_restart(3))[0]


def test_a_second_replica_cannot_take_the_lease_while_the_first_holds_it():
    book = book_with(["a", "b", "c", "d"])
    assert book.acquire("a", min_healthy=min_healthy_during_restart(1))[0]
    for r in ("b", "c", "d"):  # however many serve: one restart at a time
        granted, why = book.acquire(r, min_healthy=min_healthy_during_restart(1))
        assert not granted and "replica a is restarting" in why
    assert book.acquire("a", min_healthy=0)[0] and book.holder == "a"  # the holder may ask again
    book.release("b")  # not the holder: nothing changes
    assert book.holder == "a"


def test_min_healthy_is_checked_and_named():
    with pytest.raises(ValueError, match="min_actors must be >= 1, got 0"):
        min_healthy_during_restart(0)
    with pytest.raises(ValueError, match="min_healthy must be >= 0, got -1"):
        LeaseBook().acquire("a", min_healthy=-1)


def test_replicas_that_stopped_reporting_count_neither_as_serving_nor_as_holder():
    clock = Clock()
    book = book_with(["a", "b"], clock)
    assert book.acquire("a", min_healthy=1)[0]
    clock.now_s = 31.0  # a went quiet while holding the lease (its replica died)
    book.heartbeat("c")
    granted, _ = book.acquire("b", min_healthy=1)
    assert granted and book.holder == "b"  # a's stale lease is gone; c serves meanwhile
    clock.now_s = 70.0  # everyone but b stale: nobody would serve during b's next restart
    book.release("b")
    granted, why = book.acquire("b", min_healthy=1)
    assert not granted and "0 other replicas alive" in why
