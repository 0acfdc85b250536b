"""The batch gate: how many batch rows run beside online requests, who pauses, who goes on."""

import asyncio

import pytest

from serving.batch_gate import BatchGate

pytestmark = pytest.mark.unit


async def started(gate: BatchGate, count: int):
    slots = [gate.try_admit() for _ in range(count)]
    for slot in slots:
        await asyncio.wait_for(slot.turn(), timeout=5)
    return slots


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_rows_beyond_the_limit_are_refused_and_a_finished_row_frees_a_place():
    gate = BatchGate(max_rows=3, max_rows_with_online=1)
    slots = [gate.try_admit() for _ in range(3)]
    assert all(slots) and gate.try_admit() is None
    gate.release(slots[0])
    gate.release(slots[0])  # twice is once
    assert gate.try_admit() is not None and gate.num_rows == 3


def test_an_online_request_pauses_the_newest_rows_and_holds_new_rows_back():
    async def scenario():
        gate = BatchGate(max_rows=5, max_rows_with_online=1)
        oldest, *newer = await started(gate, 4)
        with gate.online_request():
            assert not oldest.must_yield.is_set()
            assert all(s.must_yield.is_set() for s in newer)
            late = gate.try_admit()  # admitted (the replica has room), but waits its turn
            turn = asyncio.ensure_future(late.turn())
            await settle()
            assert not turn.done()
        await asyncio.wait_for(asyncio.gather(*(s.resume() for s in newer)), timeout=5)  # the told rows stop
        await asyncio.wait_for(turn, timeout=5)  # then, online traffic gone, everyone runs
        assert gate.num_pauses == 3 and gate.num_paused == 0 and gate.num_rows == 5

    asyncio.run(scenario())


def test_waiting_rows_go_on_oldest_first_as_running_rows_finish():
    async def scenario():
        gate = BatchGate(max_rows=4, max_rows_with_online=1)
        slots = await started(gate, 3)
        order: list[int] = []

        async def pause_then_go_on(i):
            await slots[i].resume()
            order.append(i)

        with gate.online_request():
            waiting = [asyncio.ensure_future(pause_then_go_on(i)) for i in (2, 1)]  # the told rows stop
            late = gate.try_admit()
            late_turn = asyncio.ensure_future(late.turn())
            await settle()
            assert gate.num_paused == 3 and order == []
            gate.release(slots[0])  # the one running row finishes: the oldest waiting row goes on
            await settle()
            assert order == [1] and gate.num_paused == 2
            gate.release(slots[1])
            await settle()
            assert order == [1, 2] and not late_turn.done()  # older rows before the new one
        await asyncio.wait_for(asyncio.gather(*waiting, late_turn), timeout=5)
        assert gate.num_paused == 0 and gate.num_rows == 2

    asyncio.run(scenario())


def test_a_waiting_row_whose_caller_gives_up_leaves_the_gate():
    async def scenario():
        gate = BatchGate(max_rows=2, max_rows_with_online=1)
        first, second = await started(gate, 2)
        with gate.online_request():
            task = asyncio.ensure_future(second.resume())
            await settle()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            gate.release(second)  # what the replica's batch door does on the way out
            assert gate.num_rows == 1 and gate.num_paused == 0
        gate.release(first)
        assert gate.num_rows == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("rows,with_online", [(0, 1), (4, 0)])
def test_limits_below_one_are_refused_naming_the_values(rows, with_online):
    with pytest.raises(ValueError, match=f"got {rows} and {with_online}"):
        BatchGate(rows, with_online)
