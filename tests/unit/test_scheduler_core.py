"""The scheduler's pure core, stepped by hand: a fake clock, fake engine signals, no event
loop and no server. Each test builds a state, ticks, and reads the decision."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from llmd.policy.classes import ModelQueue
from llmd.policy.fairness import FAIRNESS
from llmd.policy.preemption import (
    BatchForInteractive,
    BatchOverCap,
    FairShare,
    OverSeatLimit,
    PreemptionRule,
    preemption_rules,
)
from llmd.policy.queue import QueuedRequest
from llmd.policy.saturation import SaturationDetector, ThroughputEstimate
from llmd.policy.scheduler import Decision, SchedulerCore
from llmd.policy.signals import EngineSignals


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Signals:
    waiting: int = 0
    kv_usage: float = 0.1
    generated_tokens: int = 0
    itl: list[tuple[float, float]] = field(default_factory=list)


def make(seats: int = 4, *, reserved: int = 0, batch_cap: int | None = None, quiet: float = 1.0,
         rules: list[PreemptionRule] | None = None, fairness: str = "fcfs", target_itl_ms: float | None = None,
         late_after_s: float | None = None, ramp_s: float = 0.0) -> tuple[SchedulerCore, Clock, Signals]:
    clock, signals = Clock(), Signals()
    queue = ModelQueue(FAIRNESS[fairness], lambda t: "fifo")
    detector = SaturationDetector(seats, kv_high=0.9, target_itl_ms=target_itl_ms, clock=clock)
    core = SchedulerCore(queue, detector, signals, ThroughputEstimate(100.0, clock=clock), clock=clock, rules=rules,
                         reserved_seats=reserved, batch_seats_with_interactive=batch_cap, interactive_quiet_s=quiet,
                         batch_ramp_s=ramp_s, late_after_s=late_after_s)
    return core, clock, signals


def req(tenant: str = "a", klass: str = "interactive", deadline: float = 1e9, max_tokens: int = 100) -> QueuedRequest:
    return QueuedRequest(f"{tenant}-{klass}", tenant, klass, 10, max_tokens, deadline)


def submit(core: SchedulerCore, *reqs: QueuedRequest) -> Decision:
    """What the driver does for each arrival: queue it, then tick."""
    d = Decision()
    for r in reqs:
        core.submit(r)
        d = core.tick()
    return d


def seat(core: SchedulerCore, *reqs: QueuedRequest) -> None:
    for r in reqs:
        d = submit(core, r)
        assert r in d.dispatch, d


# -- dispatch ------------------------------------------------------------------
def test_interactive_goes_before_batch_and_a_tick_seats_up_to_the_limit() -> None:
    core, _, _ = make(seats=2)
    hog = req("a")
    seat(core, hog)
    b1, b2, i1, i2 = req("a", "batch"), req("a", "batch"), req("b"), req("b")
    for r in (b1, b2, i1, i2):
        core.submit(r)
    assert core.tick().dispatch == (i1,)  # one free seat: interactive first, though batch came first
    assert core.tick() == Decision()  # full: nothing to do
    core.finished(hog, 100)
    core.finished(i1, 5)
    assert core.tick().dispatch == (i2, b1)
    assert core.running == {i2.seq: i2, b1.seq: b1} and i2.running and not b2.running
    assert core.class_running == {"interactive": 1, "batch": 1} and core.tenant_running == {"a": 1, "b": 1}


def test_reserved_seats_go_only_to_tenants_below_their_share() -> None:
    core, _, _ = make(seats=8, reserved=2, rules=[])
    b_hog = req("b")
    seat(core, b_hog)
    flood = [req("a") for _ in range(20)]
    d = submit(core, *flood)
    # Two tenants active: A's share is 4 of 8; it takes the 5 general seats, not the 2 reserved ones.
    assert core.tenant_running == {"b": 1, "a": 5} and len(core.running) == 6 and not d.dispatch
    b2 = req("b")
    assert submit(core, b2).dispatch == (b2,)  # B (1 of its 4) takes a reserved seat
    assert core.tick().dispatch == ()


def test_batch_keeps_its_capped_seats_while_interactive_traffic_is_about_and_all_after_quiet() -> None:
    core, clock, _ = make(seats=8, batch_cap=2, quiet=1.0, rules=[])
    bulk = [req("a", "batch") for _ in range(10)]
    submit(core, *bulk)
    assert core.class_running == {"batch": 8}  # no interactive traffic: batch takes every seat
    for r in bulk[:7]:
        core.finished(r, 100)
    chat = req("b")
    assert submit(core, chat).dispatch == (chat, bulk[8])  # batch up to its cap of 2, not the 6 free seats
    assert core.class_running == {"batch": 2, "interactive": 1}
    assert core.tick().dispatch == ()
    core.finished(chat, 10)
    clock.t += 0.5
    assert core.tick().dispatch == ()  # interactive_quiet_s has not passed since the chat was about
    clock.t += 0.6
    assert core.tick().dispatch == (bulk[9],)  # quiet: batch may fill the seats again


def test_after_the_quiet_time_batch_regains_the_seats_over_the_ramp_not_at_once() -> None:
    core, clock, _ = make(seats=8, batch_cap=0, quiet=1.0, ramp_s=4.0, rules=[BatchOverCap()])
    chat = req("b")
    seat(core, chat)
    bulk = [req("a", "batch") for _ in range(10)]
    submit(core, *bulk)
    assert core.class_running == {"interactive": 1}  # cap 0 while the chat runs
    core.finished(chat, 10)
    clock.t += 0.9
    assert core.tick().dispatch == ()  # still within interactive_quiet_s
    clock.t += 0.1
    assert core.tick().dispatch == (bulk[0],)  # quiet: one seat, not eight
    clock.t += 2.0  # half the ramp: 1 + 4 seats
    assert core.tick().dispatch == tuple(bulk[1:5]) and core.class_running["batch"] == 5
    chat2 = req("b")
    d = submit(core, chat2)  # interactive again: batch back to its cap of 0, at once
    assert d.dispatch == (chat2,) and d.preempt == tuple(reversed(bulk[:5]))
    for r in bulk[:5]:
        core.finished(r, None)
    core.finished(chat2, 10)
    submit(core, *bulk[:5])  # they queue again to resume
    clock.t += 1.0
    assert len(core.tick().dispatch) == 1  # the ramp starts over from the end of the new quiet time
    clock.t += 4.0
    assert len(core.tick().dispatch) == 7 and core.class_running["batch"] == 8  # ramp over: every seat


def test_deadline_drops_at_the_head_only() -> None:
    core, clock, signals = make(seats=1)
    seat(core, req("a"))
    ok, late_behind = req("a", deadline=clock.t + 60), req("a", deadline=clock.t + 0.01)
    late = req("b", deadline=clock.t + 0.5)
    for r in (ok, late_behind, late):
        core.submit(r)
    assert core.tick().drop == ()  # 0.5 s left, more than a step (0.02 s without samples)
    clock.t += 0.49
    signals.itl.append((clock.t, 0.05))  # one step now takes 50 ms: too late to get a token
    d = core.tick()
    assert d.drop == (late,) and core.dropped == 1
    assert len(core.queue) == 2  # B's gone; A's late request is not at its head, so it stays


# -- late last ------------------------------------------------------------------
def _full(core: SchedulerCore) -> QueuedRequest:
    hog = req("z")
    seat(core, hog)
    return hog


def test_a_late_request_yields_to_an_on_time_one_of_its_own_tenant_and_runs_when_there_is_room() -> None:
    core, clock, _ = make(seats=1, late_after_s=1.0, rules=[])
    hog = _full(core)
    old = req("a")
    core.submit(old)
    clock.t += 1.5  # `old` has waited past the first-token objective
    new = req("a")
    core.submit(new)
    core.finished(hog, 10)
    assert core.tick().dispatch == (new,)  # on time goes first, though `old` came first
    core.finished(new, 10)
    assert core.tick().dispatch == (old,)  # late, not dropped: it runs when a seat is free


def test_an_on_time_tenant_goes_before_one_whose_requests_are_all_late_whatever_fairness_says() -> None:
    core, clock, _ = make(seats=1, late_after_s=1.0, rules=[], fairness="vtc")
    hog = _full(core)
    late_a = req("a")
    core.submit(late_a)
    clock.t += 2.0
    b = req("b")
    core.queue.classes["interactive"].fairness.on_output("b", 1000)  # B is far over its share
    core.submit(b)
    core.finished(hog, 10)
    assert core.tick().dispatch == (b,)
    core.finished(b, 10)
    assert core.tick().dispatch == (late_a,)


def test_without_late_after_arrival_order_holds_and_a_resumed_request_is_never_late() -> None:
    core, clock, _ = make(seats=1, rules=[])
    hog = _full(core)
    old, new = req("a"), req("a")
    core.submit(old)
    clock.t += 5.0
    core.submit(new)
    core.finished(hog, 10)
    assert core.tick().dispatch == (old,)  # late_after_s unset: FIFO
    core2, clock2, _ = make(seats=1, late_after_s=1.0, rules=[])
    hog2 = _full(core2)
    resumed, fresh = req("a"), req("a")
    resumed.started = True  # preempted mid-stream: its first token came long ago
    core2.submit(resumed)
    clock2.t += 5.0
    core2.submit(fresh)
    core2.finished(hog2, 10)
    assert core2.tick().dispatch == (resumed,)


def test_a_preempted_seat_goes_to_the_on_time_request_not_the_late_one() -> None:
    core, clock, _ = make(seats=1, batch_cap=1, late_after_s=1.0, rules=[BatchForInteractive()])
    bulk = req("a", "batch")
    seat(core, bulk)
    old = req("b")
    core.queue.push(old)  # queued a while ago (as submit does, without the tick that would seat it)
    old.queued_at = clock.t
    clock.t += 2.0
    new = req("c")
    d = submit(core, new)
    assert d.preempt == (bulk,) and d.heirs == (new,)  # the seat passes to the one still on time


def test_batch_requests_are_never_late() -> None:
    core, clock, _ = make(seats=1, late_after_s=1.0, rules=[])
    hog = _full(core)
    old, new = req("a", "batch"), req("a", "batch")
    core.submit(old)
    clock.t += 5.0
    core.submit(new)
    core.finished(hog, 10)
    clock.t += 2.0  # past interactive_quiet_s
    assert core.tick().dispatch == (old,)


# -- preemption ------------------------------------------------------------------
def test_batch_over_its_cap_is_preempted_newest_first_and_the_seat_passes_to_interactive() -> None:
    core, _, _ = make(seats=4, batch_cap=1, rules=[BatchOverCap()])
    bulk = [req("a", "batch") for _ in range(4)]
    seat(core, *bulk)
    chat = req("b")
    d = submit(core, chat)
    assert d.dispatch == () and d.preempt == (bulk[3], bulk[2], bulk[1])
    assert d.heirs == (chat,) and chat.running  # handed over now, not after the aborts
    assert all(r.preempt_requested for r in bulk[1:]) and core.preempted == 3
    assert core.tick() == Decision()  # already asked: not chosen twice
    for r in bulk[1:]:
        assert core.finished(r, None) and not r.preempt_requested  # cleared once it yields
    submit(core, *bulk[1:])  # they queue again to resume
    assert core.class_running == {"batch": 1, "interactive": 1}


def test_over_a_lowered_seat_limit_the_biggest_tenants_newest_sequences_go() -> None:
    core, _, _ = make(seats=5, rules=[OverSeatLimit()])
    a = [req("a") for _ in range(3)]
    b = [req("b") for _ in range(2)]
    seat(core, a[0], b[0], a[1], b[1], a[2])
    core.detector.max_seats = 3  # what a cut of the ITL controller does to the seat limit
    d = core.tick()
    assert d.preempt == (a[2], a[1]) and d.heirs == ()  # A holds the most; no heirs: fewer seats is the point
    assert core.tick().preempt == ()  # pending ones count as gone
    core.finished(a[2], None)
    core.finished(a[1], None)
    assert core.tick() == Decision()


def test_batch_is_preempted_for_a_waiting_interactive_request_only_when_seats_or_kv_are_full() -> None:
    core, _, signals = make(seats=2, rules=[BatchForInteractive()])
    b1, b2 = req("a", "batch"), req("a", "batch")
    seat(core, b1, b2)
    core.finished(b2, 50)
    signals.waiting = 1  # a seat is free, but the engine is queueing itself: that drains within a step
    chat = req("b")
    assert submit(core, chat) == Decision()
    signals.waiting, signals.kv_usage = 0, 0.95  # KV is what it waits for now
    d = core.tick()
    assert d.preempt == (b1,) and d.heirs == ()  # the seat is not full: no handover, the abort frees KV
    core.finished(b1, None)
    signals.kv_usage = 0.1
    assert core.tick().dispatch == (chat,)


def test_a_sequence_that_cannot_resume_is_never_preempted() -> None:
    """A structured output's grammar would restart at a resumed prompt's end: such a sequence
    keeps its seat, and the rules take the next candidate (or none) instead."""
    core, _, _ = make(seats=2, rules=[BatchForInteractive()])
    other, fixed = req("a", "batch"), req("a", "batch")
    fixed.preemptible = False
    seat(core, other, fixed)
    assert submit(core, req("b")).preempt == (other,)  # newest first would pick `fixed`: it cannot resume
    only, _, _ = make(seats=1, rules=[BatchForInteractive(), OverSeatLimit()])
    locked = req("a", "batch")
    locked.preemptible = False
    seat(only, locked)
    assert submit(only, req("b")).preempt == ()  # nothing it may take: the chat waits for the seat


def test_fair_share_preemption_takes_the_flooding_tenants_newest_one_at_a_time() -> None:
    core, _, _ = make(seats=4, rules=[FairShare()])
    flood = [req("a") for _ in range(4)]
    seat(core, *flood)
    b1, b2 = req("b"), req("b")
    d = submit(core, b1)
    assert d.preempt == (flood[3],) and d.heirs == (b1,)
    assert submit(core, b2).preempt == ()  # one at a time: another is still under way
    core.finished(flood[3], None)
    d = core.tick()
    assert d.preempt == (flood[2],) and d.heirs == (b2,)  # B holds 1 of its share of 2
    core.finished(flood[2], None)
    assert core.tick() == Decision() and core.tenant_running == {"a": 2, "b": 2}


def test_fair_share_does_not_hand_a_seat_to_batch_work_while_batch_is_capped() -> None:
    """A holds every seat with chats; B, below its share, waits with batch work only. Batch may
    hold no seat while chats run: a seat taken from A for it would go straight back (BatchOverCap
    preempts it next tick), the two trading it each tick. B's batch request waits; a B chat
    still gets a seat from A."""
    core, _, _ = make(seats=3, batch_cap=0, fairness="vtc")
    chats = [req("a") for _ in range(3)]
    seat(core, *chats)
    bulk = req("b", "batch")
    assert submit(core, bulk) == Decision()
    assert core.tick() == Decision()
    chat = req("b")
    d = submit(core, chat)
    assert d.preempt == (chats[2],) and d.heirs == (chat,)


def test_a_sequence_can_be_preempted_in_the_tick_that_seated_it() -> None:
    """FCFS seats A's `x` (first in line) in B's freed seat; A then holds both seats while B,
    below its fair share, waits: `x` yields at once, before it ever reaches the engine."""
    core, _, _ = make(seats=2)
    hog, short = req("a"), req("b")
    seat(core, hog, short)
    x, z = req("a"), req("b")
    assert submit(core, x, z) == Decision()  # one seat each: nobody is below a fair share
    core.finished(short, 40)
    d = core.tick()
    assert d.dispatch == (x,) and d.preempt == (x,) and d.heirs == (z,)
    assert x.running and x.preempt_requested
    core.finished(x, 0)
    assert not x.running and not x.preempt_requested
    assert submit(core, x) == Decision()  # queued again, to resume when a seat frees


def test_the_config_flags_choose_the_rules() -> None:
    def names(rules: list[PreemptionRule]) -> list[str]:
        return [type(r).__name__ for r in rules]

    assert names(preemption_rules()) == ["BatchOverCap", "OverSeatLimit", "BatchForInteractive", "FairShare"]
    assert names(preemption_rules(preempt_batch=False)) == ["OverSeatLimit", "FairShare"]
    assert names(preemption_rules(preempt_for_fairness=False)) == ["BatchOverCap", "OverSeatLimit",
                                                                   "BatchForInteractive"]
    core, _, _ = make(seats=2, rules=preemption_rules(preempt_batch=False, preempt_for_fairness=False))
    seat(core, req("a", "batch"), req("a", "batch"))
    assert submit(core, req("b")) == Decision()  # nothing may be preempted for it


# -- the detector is stepped by the tick, read by everything else ------------------
class CountingDetector(SaturationDetector):
    def __init__(self, seats: int, clock: Clock) -> None:
        super().__init__(seats, kv_high=0.9, clock=clock)
        self.updates: list[int] = []

    def update(self, signals: EngineSignals, running: int) -> None:
        self.updates.append(running)


def test_one_detector_step_per_tick_and_none_from_reads() -> None:
    clock, signals = Clock(), Signals()
    det = CountingDetector(4, clock)
    core = SchedulerCore(ModelQueue(FAIRNESS["vtc"], lambda t: "fifo"), det, signals,
                         ThroughputEstimate(100.0, clock=clock), clock=clock)
    for r in [req("a") for _ in range(6)]:
        core.submit(r)
    core.tick()  # seats four, checks headroom five times
    assert det.updates == [0] and len(core.running) == 4
    for _ in range(10):
        assert core.seat_limit == 4
        core.estimate_wait("a", "interactive", True)
    assert det.updates == [0]
    core.tick()
    assert det.updates == [0, 4]


def test_the_itl_controller_steps_only_when_the_core_ticks() -> None:
    core, clock, signals = make(seats=8, target_itl_ms=10, rules=[])
    itl = core.detector.itl  # type: ignore[attr-defined]
    submit(core, *[req("a") for _ in range(8)])
    assert itl._next == clock.t + 0.5 and itl.last_p95 is None  # stepped, on no samples yet
    for _ in range(200):
        clock.t += 0.05
        signals.itl.append((clock.t, 0.05))  # 5x the target, with every seat taken
    for _ in range(50):
        assert core.seat_limit == 8 and core.estimate_wait("a", "interactive", True) == 0.0
    assert itl.last_p95 is None  # reads took no step
    core.tick()
    assert core.seat_limit < 8 and itl.last_p95 == pytest.approx(0.05)


# -- what finishing teaches --------------------------------------------------------
def test_finished_learns_output_length_but_not_from_preempted_or_unknown_counts() -> None:
    core, _, _ = make(seats=4, rules=[])
    core.avg_output = 100.0
    a, b, c = req("a"), req("a"), req("a")
    seat(core, a, b, c)
    assert core.finished(a, 200) and core.avg_output == pytest.approx(110.0)
    b.preempt_requested = True
    assert core.finished(b, 0) and core.avg_output == pytest.approx(110.0)  # it is not done: not learned
    assert core.finished(c, None) and core.avg_output == pytest.approx(110.0)
    assert not core.finished(a, 500) and core.avg_output == pytest.approx(110.0)  # it held no seat
    assert core.running == {} and core.tenant_running == {"a": 0}


def test_a_request_that_queues_again_goes_back_to_its_place_by_arrival() -> None:
    """A preempted request, or one whose engine died, keeps its seq: it is queued ahead of the
    ones that arrived after it (FIFO within a tenant), not behind them."""
    q = ModelQueue(FAIRNESS["fcfs"], lambda t: "fifo")
    first, second, third = (QueuedRequest(f"r{i}", "a", "interactive", 10, 10, 1e9) for i in range(3))
    for r in (second, third):
        q.push(r)
    q.push(first)  # seated earlier, now back
    assert [q.pop_next(), q.pop_next(), q.pop_next()] == [first, second, third]


def test_demoting_a_tenant_makes_its_queued_and_running_work_yield_to_others() -> None:
    """A tenant that hammers (llmd/policy/pacing.py) is demoted: its interactive sequences become
    batch-class, so with batch capped while interactive traffic is about they give up their seats."""
    core, _, _ = make(seats=3, batch_cap=0, rules=[BatchOverCap()])
    flood = [req("hog") for _ in range(4)]
    seat(core, *flood[:3])
    submit(core, flood[3])  # queued: no seat left
    assert core.demote("hog") == 4 and core.demote("hog") == 0  # once; a second call changes nothing
    assert core.class_running == {"interactive": 0, "batch": 3} and core.queue.depth("batch") == 1
    chat = req("calm")
    d = submit(core, chat)
    assert set(d.preempt) == set(flood[:3]) and d.heirs == (chat,)  # the calm tenant runs as if alone
