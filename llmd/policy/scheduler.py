"""The scheduler's decisions: which queued requests go into the engine, and when.

It only orchestrates: the queue (classes.py) decides order, the saturation detector
(saturation.py) decides when, the preemption rules (preemption.py) decide who yields a
seat. It also drops requests at the head whose deadline can no longer be met. It is
pure: state in, decisions out, time from an injected clock. llmd.scheduler runs it in
the event loop and tells each request what was decided for it; a simulator can step it
with a virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from llmd.policy.arrivals import ArrivalRate
from llmd.policy.classes import BATCH, INTERACTIVE, ModelQueue
from llmd.policy.preemption import PreemptionRound, PreemptionRule, preemption_rules
from llmd.policy.queue import QueuedRequest
from llmd.policy.saturation import Saturation, ThroughputEstimate
from llmd.policy.signals import Clock, EngineSignals


@dataclass(init=False, unsafe_hash=True)
class Decision:
    """What one tick decided, in the order it is to be applied (immutable; the __init__ written
    out: placement.VersionLoad says why)."""

    drop: Final[tuple[QueuedRequest, ...]]  # out of the queue: the deadline can no longer be met
    dispatch: Final[tuple[QueuedRequest, ...]]  # seated: may start in the engine
    preempt: Final[tuple[QueuedRequest, ...]]  # asked to yield their seats: abort, re-queue, resume
    heirs: Final[tuple[QueuedRequest, ...]]  # seated at once in the seats of those preempted for them

    def __init__(self, drop: tuple[QueuedRequest, ...] = (), dispatch: tuple[QueuedRequest, ...] = (),
                 preempt: tuple[QueuedRequest, ...] = (), heirs: tuple[QueuedRequest, ...] = ()) -> None:
        self.drop = drop
        self.dispatch = dispatch
        self.preempt = preempt
        self.heirs = heirs


class SchedulerCore:
    """One model's seats: who holds them (per request, tenant and class), the queue, the
    saturation detector and the throughput estimate; `tick` turns that state into a Decision."""

    def __init__(self, queue: ModelQueue, detector: Saturation, signals: EngineSignals,
                 throughput: ThroughputEstimate, *, clock: Clock, rules: Sequence[PreemptionRule] | None = None,
                 reserved_seats: int = 0, avg_output_prior: float = 128.0,
                 batch_seats_with_interactive: int | None = None, interactive_quiet_s: float = 1.0,
                 batch_ramp_s: float = 0.0, arrivals: ArrivalRate | None = None,
                 late_after_s: float | None = None) -> None:
        self.queue = queue
        self.detector = detector
        self.signals = signals
        self.throughput = throughput
        self.clock = clock
        self.rules = list(preemption_rules() if rules is None else rules)
        self.reserved_seats = reserved_seats
        # While interactive requests run or wait (and for `interactive_quiet_s` after), batch-class
        # sequences keep at most this many seats: every sequence in a step lengthens the step,
        # so batch work that merely shares the engine still delays interactive tokens.
        self.batch_seats_with_interactive = (detector.max_seats if batch_seats_with_interactive is None
                                             else batch_seats_with_interactive)
        self.interactive_quiet_s = interactive_quiet_s
        # After that quiet time, batch work regains the other seats over `batch_ramp_s`, not at
        # once: a refill of every seat is one long prefill that an arriving chat cannot interrupt.
        self.batch_ramp_s = batch_ramp_s
        self.arrivals = arrivals  # noted at each submit; the step-time model reads it
        # An interactive request that has waited this long for its first seat has missed its
        # first-token objective: it yields to those still on time (None or 0: arrival order).
        self.late_after_s = late_after_s or None
        self._last_interactive = -1e18
        self.running: dict[int, QueuedRequest] = {}  # by seq, in dispatch order
        self.tenant_running: dict[str, int] = {}
        self.class_running: dict[str, int] = {}
        self.avg_output = avg_output_prior
        self.dropped = 0
        self.preempted = 0

    # -- the request's side ----------------------------------------------
    def submit(self, req: QueuedRequest) -> None:
        """Queue `req` (new, or preempted and resuming); the next tick may seat it."""
        if req.queued_at is None:
            req.queued_at = self.clock()
        self.queue.push(req)
        if self.arrivals is not None:
            self.arrivals.note()

    def withdraw(self, req: QueuedRequest) -> bool:
        """Take a queued request out (its client went away); False if it was not queued."""
        return self.queue.remove(req)

    def finished(self, req: QueuedRequest, output_tokens: int | None) -> bool:
        """The engine is done with `req` (finished, aborted or preempted): free its seat.
        `output_tokens` (all it produced, every attempt) teaches the wait estimate, unless it
        was preempted (it is not done) or is None. False if it held no seat."""
        if self.running.pop(req.seq, None) is None:
            return False
        req.running = False
        self.tenant_running[req.tenant] -= 1
        self.class_running[req.klass] -= 1
        if not req.preempt_requested and output_tokens is not None:
            self.avg_output = 0.9 * self.avg_output + 0.1 * output_tokens
        req.preempt_requested = False
        return True

    def on_output(self, req: QueuedRequest, tokens: int) -> None:
        self.queue.on_output(req, tokens)

    def demote(self, tenant: str) -> int:
        """Make every interactive request of `tenant`, queued or running, batch-class: from the next
        tick its seats yield to other tenants' interactive work (a tenant that hammers:
        llmd/policy/pacing.py). How many changed."""
        moved = 0
        for r in self.running.values():
            if r.tenant == tenant and r.klass == INTERACTIVE:
                self.class_running[INTERACTIVE] -= 1
                self.class_running[BATCH] = self.class_running.get(BATCH, 0) + 1
                r.klass = BATCH
                moved += 1
        for r in [r for r in self.queue.classes[INTERACTIVE] if r.tenant == tenant]:
            self.queue.remove(r)
            r.klass = BATCH
            self.queue.push(r)
            moved += 1
        return moved

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

    @property
    def seat_limit(self) -> int:
        return self.detector.seat_limit

    # -- the tick ----------------------------------------------------------
    def tick(self) -> Decision:
        """Step the detector once, then drop, seat and preempt what the state calls for."""
        self.throughput.observe(self.signals, busy=bool(self.running))
        self.detector.update(self.signals, len(self.running))
        drop = self._drop_expired()
        on_time = self._on_time()  # one cut-off for the whole tick: seating and heirs agree
        dispatch = self._seat_from_queue(on_time)
        preempt, heirs = self._preempt(on_time)
        return Decision(drop, dispatch, preempt, heirs)

    def _seat_from_queue(self, on_time: Callable[[QueuedRequest], bool] | None) -> tuple[QueuedRequest, ...]:
        seated: list[QueuedRequest] = []
        while len(self.queue) and self.detector.has_headroom(self.signals, len(self.running)):
            # The last `reserved_seats` seats go only to tenants below their fair share of seats,
            # so one tenant's flood cannot make a newcomer wait for a long generation to end.
            limit = self.detector.seat_limit
            reserve_only = limit - len(self.running) <= min(self.reserved_seats, limit // 4)
            pred = self.below_share(self.fair_share(limit)) if reserve_only else None
            if self.class_running.get(BATCH, 0) < self.batch_cap(limit):
                req = self.queue.pop_next(pred, on_time)
            else:
                req = self.queue.classes[INTERACTIVE].pop_next(pred, on_time)
            if req is None:
                break
            self._seat(req)
            seated.append(req)
        return tuple(seated)

    def _on_time(self) -> Callable[[QueuedRequest], bool] | None:
        """Late last: under overload, serving requests in arrival order makes every one of them
        late; serving those that can still meet the first-token objective first keeps as many
        as possible within it, and the late ones still run when there is room (or end at their
        deadline). A request that already started (preempted, resuming) is never late."""
        if self.late_after_s is None:
            return None
        cutoff = self.clock() - self.late_after_s
        return lambda r: (r.klass != INTERACTIVE or r.started or r.queued_at is None or r.queued_at > cutoff)

    def batch_cap(self, limit: int) -> int:
        """Seats batch-class work may hold now: all of them, unless interactive traffic is about
        or was lately (`batch_ramp_s`: one more seat at the end of the quiet time, then linearly
        up to all of them)."""
        now = self.clock()
        if self.class_running.get(INTERACTIVE, 0) or self.queue.depth(INTERACTIVE):
            self._last_interactive = now
        quiet = now - self._last_interactive
        base = min(limit, self.batch_seats_with_interactive)
        if quiet < self.interactive_quiet_s:
            return base
        ramped = (quiet - self.interactive_quiet_s) / self.batch_ramp_s if self.batch_ramp_s > 0 else 1.0
        return limit if ramped >= 1.0 else min(limit, base + 1 + int(ramped * (limit - base)))

    def holds(self, tenant: str) -> int:
        return self.tenant_running.get(tenant, 0)

    def below_share(self, share: int) -> Callable[[str], bool]:
        """Holds for a tenant with fewer than `share` seats, whenever it is asked."""
        return lambda tenant: self.holds(tenant) < share

    def fair_share(self, limit: int) -> int:
        active = {t for t, n in self.tenant_running.items() if n} | {r.tenant for r in self.queue.heads()}
        return max(1, limit // max(1, len(active)))

    def blocked_on_capacity(self, running: int) -> bool:
        return self.detector.blocked_on_capacity(self.signals, running)

    def _seat(self, req: QueuedRequest) -> None:
        req.running = True
        self.running[req.seq] = req
        self.tenant_running[req.tenant] = self.tenant_running.get(req.tenant, 0) + 1
        self.class_running[req.klass] = self.class_running.get(req.klass, 0) + 1

    def _drop_expired(self) -> tuple[QueuedRequest, ...]:
        now = self.clock()
        itl = max(self.signals.itl[-1][1], 0.001) if self.signals.itl else 0.02
        dropped: list[QueuedRequest] = []
        for req in list(self.queue.heads()):
            # Too late even if it started now and got its first token after one step.
            if now + itl < req.deadline:
                continue
            self.queue.remove(req)
            self.dropped += 1
            dropped.append(req)
        return tuple(dropped)

    def _preempt(self, on_time: Callable[[QueuedRequest], bool] | None
                 ) -> tuple[tuple[QueuedRequest, ...], tuple[QueuedRequest, ...]]:
        """Run the preemption rules in order; returns (victims, heirs seated in their place)."""
        running, limit = len(self.running), self.detector.seat_limit
        pending = sum(1 for t in self.running.values() if t.preempt_requested)
        live = [t for t in self.running.values() if not t.preempt_requested and t.preemptible]
        r = PreemptionRound(self, running, limit, pending=pending, live=live,
                            waiting_interactive=self.queue.depth(INTERACTIVE), prefer=on_time)
        for rule in self.rules:
            rule.choose(r)
        for t in r.victims:
            t.preempt_requested = True
            self.preempted += 1
        heirs: list[QueuedRequest] = []
        if r.heirs and running >= limit and self.signals.waiting == 0:
            # The seats are full, or over a limit the ITL controller just lowered: hand each
            # victim's seat over now, not after its abort.
            for heir in r.heirs:
                if (req := heir()) is not None:
                    self._seat(req)
                    heirs.append(req)
        return tuple(r.victims), tuple(heirs)
