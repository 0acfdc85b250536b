import asyncio

import pytest

from pipelines.backpressure import AdaptiveWindow

pytestmark = pytest.mark.unit


def test_window_halves_on_busy_and_grows_back_additively():
    w = AdaptiveWindow(initial=16, maximum=32, max_backoff_s=5.0, seed=0)
    w.on_busy()
    assert w.limit == 8
    for _ in range(8):  # one window's worth of accepted rows -> +1
        w.on_accepted()
    assert w.limit == pytest.approx(9, abs=0.1)
    for _ in range(10):
        w.on_busy()
    assert w.limit == 1  # never below one row in flight: the job always progresses
    for _ in range(10_000):
        w.on_accepted()
    assert w.limit == 32


def test_backoff_grows_is_capped_and_jittered():
    w = AdaptiveWindow(initial=1, maximum=4, max_backoff_s=2.0, seed=1)
    waits = [w.backoff_s(a) for a in range(12)]
    assert all(0 < x <= 2.0 for x in waits)
    assert waits[0] <= 0.05 and max(waits[-4:]) > 1.0
    assert len({round(x, 6) for x in waits[-4:]}) == 4  # jitter: not lockstep


def test_acquire_blocks_beyond_the_window():
    async def scenario():
        w = AdaptiveWindow(initial=2, maximum=2, max_backoff_s=1.0)
        await w.acquire()
        await w.acquire()
        third = asyncio.ensure_future(w.acquire())
        await asyncio.sleep(0.05)
        assert not third.done()
        await w.release()
        await asyncio.wait_for(third, 1.0)
        return w.in_flight

    assert asyncio.run(scenario()) == 2


def test_bad_window_bounds_are_refused():
    with pytest.raises(ValueError, match="initial=0"):
        AdaptiveWindow(initial=0, maximum=4, max_backoff_s=1.0)
