"""Saturation detection and the ITL-target controller, on synthetic engine stats."""

from __future__ import annotations

from llmd.backends.base import EngineStats, StepRecord
from llmd.policy.saturation import ITLController, SaturationDetector, p95


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def step(stats: EngineStats, clock: Clock, running: int, waiting: int = 0, kv: float = 0.1) -> None:
    """One engine step whose inter-token latency grows with the batch: 10 ms + 2 ms per sequence."""
    itl = 0.010 + 0.002 * running
    clock.t += itl
    stats.record(StepRecord(clock.t, running, waiting, kv, running), itl=[itl] * running)


def test_headroom_rules() -> None:
    stats = EngineStats()
    d = SaturationDetector(max_seats=4, kv_high=0.9, clock=Clock())
    assert d.has_headroom(stats, 0)
    assert d.has_headroom(stats, 3) and not d.has_headroom(stats, 4)
    stats.record(StepRecord(0, 2, 1, 0.1, 0))
    assert not d.has_headroom(stats, 2)  # the engine is queueing itself: our queue should hold the order
    stats.record(StepRecord(0, 2, 0, 0.95, 0))
    assert not d.has_headroom(stats, 2)  # KV nearly full
    assert d.has_headroom(stats, 0)  # but an idle engine always takes one


def test_aimd_converges_under_target_and_stays_high() -> None:
    clock, stats = Clock(), EngineStats()
    ctl = ITLController(target_ms=40, max_seats=64, margin=0.85, clock=clock)
    limits = []
    for _ in range(4000):
        ctl.update(stats, running=ctl.limit)
        limit = ctl.seat_limit
        step(stats, clock, running=limit)  # saturated: as many run as allowed
        limits.append(limit)
    tail = limits[-1000:]
    # It aims at 0.85 x 40 = 34 ms: 10 + 2n ms <= 34 ms  <=>  n <= 12; the limit hovers just
    # under the best feasible value.
    assert max(tail) <= 12
    assert sum(tail) / len(tail) >= 0.8 * 12
    recent = [x for _, x in list(stats.itl)[-2000:]]
    assert p95(recent) <= 0.034 + 1e-9
    assert limits.index(max(tail)) < 400  # proportional cuts: from 64 seats in a few windows


def test_margin_one_aims_at_the_target() -> None:
    clock, stats = Clock(), EngineStats()
    ctl = ITLController(target_ms=40, max_seats=64, margin=1.0, clock=clock)
    limits = []
    for _ in range(4000):
        ctl.update(stats, running=ctl.limit)
        limits.append(ctl.seat_limit)
        step(stats, clock, running=limits[-1])
    tail = limits[-1000:]
    assert max(tail) <= 15 and sum(tail) / len(tail) >= 0.8 * 15  # 10 + 2n <= 40 ms


def test_aimd_grows_back_when_latency_allows() -> None:
    clock, stats = Clock(), EngineStats()
    ctl = ITLController(target_ms=40, max_seats=64, margin=0.85, clock=clock)
    ctl.limit = 2.0
    for _ in range(3000):
        ctl.update(stats, running=int(ctl.limit))
        step(stats, clock, running=ctl.seat_limit)
    assert ctl.limit >= 10  # it grows while p95 < 0.9 x the aim (34 ms): 10 + 2n < 30.6 ms


def test_a_futile_cut_is_undone() -> None:
    """Every 10th step stalls 60 ms on a prefill, whatever the batch: p95 stays above the
    40 ms target at any seat count, so cutting below ~25 seats only loses throughput."""
    clock, stats = Clock(), EngineStats()
    ctl = ITLController(target_ms=40, max_seats=64, margin=1.0, clock=clock)
    limits = []
    for i in range(6000):
        ctl.update(stats, running=ctl.limit)
        limits.append(ctl.seat_limit)
        itl = 0.060 if i % 10 == 0 else 0.010 + 0.001 * limits[-1]
        clock.t += itl
        stats.record(StepRecord(clock.t, limits[-1], 0, 0.1, limits[-1]), itl=[itl] * limits[-1])
    assert min(limits) >= 16  # 64 -> 32 helped (p95 74 -> 60 ms); 32 -> 16 did not, and was undone
    tail = limits[-2000:]
    assert sum(tail) / len(tail) >= 25  # it tries a cut again after each hold, and undoes it again


def test_p95() -> None:
    assert p95([]) == 0.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0


def test_reading_the_seat_limit_never_steps_the_controller() -> None:
    """Only `update` (once per scheduler tick) steps the AIMD; /admin/engines, metrics and
    headroom checks read it. With latency far over the target, reads change nothing."""
    clock, stats = Clock(), EngineStats()
    d = SaturationDetector(max_seats=32, target_itl_ms=10, clock=clock)
    assert d.itl is not None
    for _ in range(2000):
        clock.t += 0.05
        stats.record(StepRecord(clock.t, 32, 0, 0.1, 32), itl=[0.05] * 32)  # 5x the target
    for _ in range(100):
        assert d.seat_limit == 32 and d.has_headroom(stats, 31) and not d.has_headroom(stats, 32)
        assert d.blocked_on_capacity(stats, 32)
    assert d.itl._next == 0.0 and d.itl.last_p95 is None  # no step was taken
    d.update(stats, running=32)
    assert d.seat_limit < 32 and d.itl.last_p95 == 0.05
    cut = d.seat_limit
    clock.t += 100  # time alone moves nothing either
    assert d.seat_limit == cut and d.has_headroom(stats, cut - 1) and not d.has_headroom(stats, cut)


def test_blocked_on_capacity_only_when_seats_or_kv_are_full() -> None:
    stats, d = EngineStats(), SaturationDetector(max_seats=4, kv_high=0.9, clock=Clock())
    assert d.blocked_on_capacity(stats, 4) and not d.blocked_on_capacity(stats, 3)
    stats.record(StepRecord(0, 3, 2, 0.1, 0))
    assert not d.has_headroom(stats, 3) and not d.blocked_on_capacity(stats, 3)  # the engine's queue drains itself
    stats.record(StepRecord(0, 3, 0, 0.95, 0))
    assert d.blocked_on_capacity(stats, 3)  # KV full
    assert not d.blocked_on_capacity(stats, 0)  # an idle engine takes one anyway
