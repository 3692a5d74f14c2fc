"""The scheduler: releases requests from our queues into the engine while it has headroom.

It only orchestrates: the queue (classes.py) decides order, the detector
(saturation.py) decides when, and this loop applies both. It also drops
requests at the head whose deadline can no longer be met, and preempts
batch-class sequences when interactive ones wait for a seat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from llmd.backends.base import EngineStats
from llmd.policy.classes import ModelQueue
from llmd.policy.queue import QueuedRequest
from llmd.policy.saturation import SaturationDetector, ThroughputEstimate


class Dropped(Exception):
    """A queued request was dropped before reaching the engine (`reason` says why)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class Entry:
    """The scheduler's handle on one request while it waits or runs."""

    req: QueuedRequest
    abort: Callable[[], Awaitable[None]] | None = None
    dispatched: asyncio.Future[None] | None = None
    running: bool = False
    preempt_requested: bool = False
    preemptions: int = 0
    output_tokens: int = 0
    events: list[str] = field(default_factory=list)


class Scheduler:
    TICK_S = 0.01

    def __init__(self, queue: ModelQueue, detector: SaturationDetector, stats: EngineStats,
                 throughput: ThroughputEstimate, preempt_batch: bool = True, reserved_seats: int = 0,
                 preempt_for_fairness: bool = True, avg_output_prior: float = 128.0,
                 batch_seats_with_interactive: int | None = None, interactive_quiet_s: float = 1.0) -> None:
        self.queue = queue
        self.detector = detector
        self.stats = stats
        self.throughput = throughput
        self.preempt_batch = preempt_batch
        self.reserved_seats = reserved_seats
        self.preempt_for_fairness = preempt_for_fairness
        # While interactive requests run or wait (and for `interactive_quiet_s` after), batch-class
        # sequences keep at most this many seats: every sequence in a step lengthens the step,
        # so batch work that merely shares the engine still delays interactive tokens.
        self.batch_seats_with_interactive = (detector.max_seats if batch_seats_with_interactive is None
                                             else batch_seats_with_interactive)
        self.interactive_quiet_s = interactive_quiet_s
        self._last_interactive = -1e18
        self.running: dict[int, Entry] = {}
        self.tenant_running: dict[str, int] = {}
        self.class_running: dict[str, int] = {}
        self._waiting: dict[int, Entry] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.avg_output = avg_output_prior
        self.dropped = 0
        self.preempted = 0

    @property
    def seat_limit(self) -> int:
        return self.detector.seat_limit

    # -- lifecycle -------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the request's side ----------------------------------------------
    async def wait_turn(self, t: Entry) -> None:
        """Queue `t` and return once it may use the engine; raises Dropped, or CancelledError."""
        t.dispatched = asyncio.get_running_loop().create_future()
        self._waiting[t.req.seq] = t
        self.queue.push(t.req)
        self._tick()
        if len(self.queue):
            self._wake.set()  # the loop polls for headroom while anything waits
        try:
            await t.dispatched
        except BaseException:
            if self._waiting.pop(t.req.seq, None) is not None:
                self.queue.remove(t.req)
            if t.running and not t.dispatched.cancelled():
                self.finished(t)  # dispatched just as it was cancelled
            raise

    def finished(self, t: Entry) -> None:
        """The engine is done with `t` (finished, aborted or preempted)."""
        if self.running.pop(t.req.seq, None) is not None:
            t.running = False
            self.tenant_running[t.req.tenant] -= 1
            self.class_running[t.req.klass] -= 1
            if not t.preempt_requested:
                self.avg_output = 0.9 * self.avg_output + 0.1 * t.output_tokens
            self._wake.set()

    def on_output(self, t: Entry, tokens: int) -> None:
        t.output_tokens += tokens
        self.queue.on_output(t.req, tokens)

    def estimate_wait(self, tenant: str, klass: str, fair: bool) -> float:
        """Seconds until a new request would start, from the work queued ahead of it."""
        ahead = 0.0
        own = sum(1 for r in self.queue.classes[klass] if r.tenant == tenant)
        per_tenant: dict[str, int] = {}
        for r in self.queue.ahead_of(klass):
            if fair and r.klass == klass and r.tenant != tenant:
                per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + 1
                if per_tenant[r.tenant] > own + 1:
                    continue  # under fair queueing a neighbour's backlog does not all go first
            ahead += min(r.max_tokens, self.avg_output)
        if ahead == 0 and len(self.running) < self.detector.max_seats:
            return 0.0
        return ahead / max(self.throughput.tps, 1e-6)

    # -- the loop --------------------------------------------------------
    async def _loop(self) -> None:
        # Event-driven; polls only while requests wait, since headroom can then appear
        # from engine stats (KV freed, engine queue drained) without any event of ours.
        while True:
            if len(self.queue):
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.TICK_S):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            self._tick()

    def _tick(self) -> None:
        self.throughput.observe(self.stats, busy=bool(self.running))
        self.detector.update(self.stats, len(self.running))  # the one control step per tick
        self._drop_expired()
        while len(self.queue) and self.detector.has_headroom(self.stats, len(self.running)):
            # The last `reserved_seats` seats go only to tenants below their fair share of seats,
            # so one tenant's flood cannot make a newcomer wait for a long generation to end.
            limit = self.detector.seat_limit
            reserve_only = limit - len(self.running) <= min(self.reserved_seats, limit // 4)
            share = self._fair_share(limit)
            pred = (lambda t: self._holds(t) < share) if reserve_only else None
            if self.class_running.get("batch", 0) < self._batch_cap(limit):
                req = self.queue.pop_next(pred)
            else:
                req = self.queue.classes["interactive"].pop_next(pred)
            if req is None:
                break
            self._dispatch(self._waiting.pop(req.seq))
        self._preempt()

    def _batch_cap(self, limit: int) -> int:
        """Seats batch-class work may hold now: all of them, unless interactive traffic is about."""
        now = time.monotonic()
        if self.class_running.get("interactive", 0) or self.queue.depth("interactive"):
            self._last_interactive = now
        if now - self._last_interactive < self.interactive_quiet_s:
            return min(limit, self.batch_seats_with_interactive)
        return limit

    def _holds(self, tenant: str) -> int:
        return self.tenant_running.get(tenant, 0)

    def _fair_share(self, limit: int) -> int:
        active = {t for t, n in self.tenant_running.items() if n} | {r.tenant for r in self.queue.heads()}
        return max(1, limit // max(1, len(active)))

    def _dispatch(self, t: Entry) -> None:
        t.running = True
        self.running[t.req.seq] = t
        self.tenant_running[t.req.tenant] = self.tenant_running.get(t.req.tenant, 0) + 1
        self.class_running[t.req.klass] = self.class_running.get(t.req.klass, 0) + 1
        assert t.dispatched is not None
        if not t.dispatched.done():
            t.dispatched.set_result(None)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        itl = max(self.stats.itl[-1][1], 0.001) if self.stats.itl else 0.02
        for req in list(self.queue.heads()):
            # Too late even if it started now and got its first token after one step.
            if now + itl < req.deadline:
                continue
            self.queue.remove(req)
            t = self._waiting.pop(req.seq)
            self.dropped += 1
            assert t.dispatched is not None
            if not t.dispatched.done():
                t.dispatched.set_exception(Dropped(
                    "deadline", "the request's deadline could no longer be met while it waited in the queue; it was not run"))

    def _preempt(self) -> None:
        """Free seats (a preempted request is aborted, re-queued and later resumed from the
        tokens it already has):
        - batch sequences over their cap while interactive traffic is about;
        - sequences over a seat limit the ITL controller lowered, newest of the tenant holding
          the most seats first (waiting for them to end takes a whole generation);
        - when the seats are full: batch sequences for waiting interactive requests, and the
          most over-share tenant's newest sequence for a tenant below its fair share. The seat
          of each of these passes straight to the request it was preempted for."""
        running = len(self.running)
        limit = self.detector.seat_limit
        pending = sum(1 for t in self.running.values() if t.preempt_requested)
        live = [t for t in self.running.values() if not t.preempt_requested]
        chosen: list[Entry] = []
        heirs: list[Callable[[], QueuedRequest | None]] = []
        waiting_interactive = self.queue.depth("interactive")
        if self.preempt_batch:
            batch = sorted((t for t in live if t.req.klass == "batch"), key=lambda t: -t.req.seq)
            chosen += batch[:max(0, len(batch) - self._batch_cap(limit))]
            heirs += [self.queue.classes["interactive"].pop_next] * min(len(chosen), waiting_interactive)
        excess = running - pending - len(chosen) - limit
        if excess > 0:
            rest = [t for t in live if t not in chosen]
            rest.sort(key=lambda t: (t.req.klass == "batch", self._holds(t.req.tenant), t.req.seq), reverse=True)
            chosen += rest[:excess]
        # Preempting for a waiting request helps only when seats or KV are what it waits for,
        # not when the engine's own queue is (that drains by itself within a step).
        full = running - len(chosen) >= limit or self.stats.kv_usage >= self.detector.kv_high
        if full and not self.detector.has_headroom(self.stats, running - len(chosen)):
            taken = set(map(id, chosen))
            live = [t for t in live if id(t) not in taken]
            share = self._fair_share(limit)
            if self.preempt_batch:
                need = waiting_interactive - pending - len(heirs)
                batch = sorted((t for t in live if t.req.klass == "batch"), key=lambda t: -t.req.seq)
                victims = batch[:max(0, need)]
                chosen += victims
                heirs += [self.queue.classes["interactive"].pop_next] * len(victims)
            if self.preempt_for_fairness and not pending and not heirs:
                # One at a time: each preemption costs a re-prefill, which every running stream feels.
                if any(self._holds(r.tenant) < share for r in self.queue.heads()):
                    victim = self._most_over_share(live, share)
                    if victim is not None:
                        chosen.append(victim)
                        heirs.append(lambda: self.queue.pop_next(lambda tenant: self._holds(tenant) < share))
        for t in chosen:
            t.preempt_requested = True
            t.preemptions += 1
            self.preempted += 1
            if t.abort is not None:
                asyncio.get_running_loop().create_task(t.abort())
        if heirs and running >= limit and self.stats.waiting == 0:
            # The seats are full, or over a limit the ITL controller just lowered: hand each
            # victim's seat over now, not after its abort.
            for heir in heirs:
                if (req := heir()) is not None:
                    self._dispatch(self._waiting.pop(req.seq))

    def _most_over_share(self, live: list[Entry], share: int) -> Entry | None:
        cands = [t for t in live if self._holds(t.req.tenant) > share]
        if not cands:
            return None
        # Batch before interactive, then the tenant holding the most seats, then its newest sequence.
        return max(cands, key=lambda t: (t.req.klass == "batch", self._holds(t.req.tenant), t.req.seq))
