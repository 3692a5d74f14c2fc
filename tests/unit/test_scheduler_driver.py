"""llmd.scheduler: the asyncio driver applies the core's decisions to waiting requests
(futures resolved, Dropped raised, aborts called) and keeps the seat count right when a
client goes away at the worst moment. No server, no engine."""

from __future__ import annotations

import asyncio

import pytest

from llmd.scheduler import Dropped, Scheduler
from tests.unit.test_scheduler_core import make, req


def recorder(log: list[str], name: str):  # type: ignore[no-untyped-def]
    async def abort() -> None:
        log.append(name)
    return abort


async def test_seated_at_once_dropped_at_the_deadline_and_aborted_when_preempted() -> None:
    core, clock, _ = make(seats=2)
    sched = Scheduler(core)
    sched.start()
    aborted: list[str] = []
    old, new = req("a"), req("a")
    await sched.wait_turn(old, recorder(aborted, "old"))  # free seats: no waiting
    await sched.wait_turn(new, recorder(aborted, "new"))
    assert dict(sched.running) == {old.seq: old, new.seq: new} and sched.seat_limit == 2
    late = req("a", deadline=clock.t + 1)
    waiter = asyncio.create_task(sched.wait_turn(late, recorder(aborted, "late")))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    clock.t += 1
    with pytest.raises(Dropped) as e:
        await waiter  # the loop's next tick drops it
    assert e.value.reason == "deadline" and sched.dropped == 1 and not len(core.queue)
    b = req("b")
    await asyncio.wait_for(sched.wait_turn(b, recorder(aborted, "b")), 1)  # A's newest seat, handed over
    await asyncio.sleep(0)
    assert aborted == ["new"] and new.preempt_requested and sched.preempted == 1
    sched.finished(new, 3)
    assert dict(sched.running) == {old.seq: old, b.seq: b} and not new.preempt_requested
    await sched.stop()


async def test_a_request_cancelled_as_it_is_seated_gives_its_seat_back() -> None:
    """The loop seats a request whose client has just gone away (its turn was cancelled
    before the loop ran): the request's own cleanup must free that seat again."""
    core, _, _ = make(seats=1, rules=[])
    sched = Scheduler(core)
    sched.start()
    first, second = req("a"), req("b")
    await sched.wait_turn(first, recorder([], "first"))
    waiter = asyncio.create_task(sched.wait_turn(second, recorder([], "second")))
    await asyncio.sleep(0.02)
    assert len(core.queue) == 1
    sched.finished(first, 10)  # wakes the loop, which seats `second` on its next turn...
    waiter.cancel()  # ...just after its client went away
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert core.dropped == 0 and not second.running
    assert not sched.running and not len(core.queue) and core.tenant_running == {"a": 0, "b": 0}
    await sched.stop()
