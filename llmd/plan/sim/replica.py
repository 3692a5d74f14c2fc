"""One replica: its engine (engine.py) behind llmd's own scheduling policies, on a virtual clock.

The queue, fairness, saturation detector (ITL target), throughput estimate, preemption rules and
SchedulerCore are built from the model's `[models.X.scheduling]` exactly as llmd/runtime.py's
build_runtime builds them; this module only plays the engine and the event loop that
llmd/scheduler.py plays around them: it feeds the detector the inter-token gaps and step samples
the real backend's stats would, ticks the core when something changed, and applies its Decisions.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Final

from llmd.config import TenantConfig
from llmd.config.parts import SchedulingConfig
from llmd.plan.sim.engine import HISTORY, Engine
from llmd.plan.sim.metrics import Recorder
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import EngineSpec
from llmd.policy.classes import ModelQueue
from llmd.policy.fairness import FAIRNESS, VTCFairness
from llmd.policy.preemption import preemption_rules
from llmd.policy.saturation import SaturationDetector, StepModelITL, ThroughputEstimate
from llmd.policy.scheduler import Decision, SchedulerCore
from llmd.policy.steptime import StepTimeModel
from llmd.stepmodel import StepShape, StepTime

TICK_EVERY_S: Final = 0.5  # the ITL controller's interval: a replica ticks at least this often while busy
IDLE_TICK_S: Final = 0.01  # llmd.scheduler.Scheduler.TICK_S: how often it ticks while requests wait and nothing runs
GAP_SAMPLES: Final = 96  # the gaps the ITL controller reads (the real gateway keeps 16,384: a cost here)
STEP_WINDOW: Final = HISTORY  # steps the step-time model fits over (llmd keeps 512: refits cost per replica here)
LLMD_GAPS: Final = 16384  # llmd/runtime.py's gaps, EngineStats.history: SimSpec.exact
LLMD_HISTORY: Final = 2048


class Replica:
    """Engine + llmd's scheduler for it. `state` is the fleet's: active, warm, cold, starting, failed."""

    def __init__(self, idx: int, spec: EngineSpec, sched: SchedulingConfig, tenants: list[TenantConfig],
                 step: StepTime, clock: Callable[[], float], rec: Recorder, control_s: float | None = None,
                 exact: bool = False) -> None:
        self.idx = idx
        self.name = f"r{idx:03d}"
        self.state = "active"
        self.clock = clock
        self.exact = exact  # the ITL controller sees what llmd's does (SimSpec.exact)
        self.engine = Engine(spec, step, rec, *((LLMD_GAPS, LLMD_HISTORY, True) if exact else (GAP_SAMPLES,)))
        self.gaps = self.engine.gaps
        self.tick_every_s = TICK_EVERY_S if control_s is None else control_s
        self.core = self._core(spec, sched, tenants)
        self.version = 0  # bumps when its pending boundary event moves
        self.next_t: float | None = None  # its pending boundary event
        self.dirty = False  # tick at the next boundary
        self.last_tick = -1e18
        self.aborts: list[Req] = []  # preempted by llmd mid-segment: out at the next boundary
        self.reqs: dict[int, Req] = {}  # queued or in the engine, by QueuedRequest.seq
        self.queued_tokens = 0  # prefill tokens waiting in its queue (routing reads it)
        self.sched_preempted = 0
        self.early: list[Req] = []  # dropped by a tick between boundaries (exact mode)
        self.recorded_waiting = 0  # the engine's queue as its last step record gave it (exact mode)
        self.deadlines: list[tuple[float, int, Req]] = []  # (deadline, n, request) of those sent to the engine
        self.sent = 0

    def _core(self, spec: EngineSpec, sc: SchedulingConfig, tenants: list[TenantConfig]) -> SchedulerCore:
        """llmd/runtime.py's build_runtime, on the virtual clock."""
        weights = {t.name: t.weight for t in tenants}
        ordering = {t.name: t.ordering for t in tenants}
        if sc.fairness == "vtc":
            queue = ModelQueue(lambda: VTCFairness(weights, sc.w_in, sc.w_out), lambda t: ordering.get(t, "fifo"))
        else:
            queue = ModelQueue(FAIRNESS["fcfs"], lambda t: ordering.get(t, "fifo"))
        seats = sc.max_running or spec.max_num_seqs
        detector = SaturationDetector(seats, kv_high=sc.kv_high, target_itl_ms=sc.target_itl_ms,
                                      itl_margin=sc.target_itl_margin, clock=self.clock,
                                      itl_samples=lambda: self.gaps,
                                      steps=(lambda: self.engine.history) if sc.itl_step_model else None)
        if isinstance(detector.itl, StepModelITL) and not self.exact:
            detector.itl.model = StepTimeModel(window=STEP_WINDOW)
        if detector.itl is not None:  # SimSpec.control_interval_s: coarser trades accuracy for speed
            detector.itl.interval_s = self.tick_every_s
        batch_seats = sc.batch_seats_with_interactive if sc.batch_seats_with_interactive is not None \
            else max(1, seats // 4)
        throughput = ThroughputEstimate(sc.prior_tokens_per_s, clock=self.clock)
        return SchedulerCore(queue, detector, self, throughput, clock=self.clock,
                             rules=preemption_rules(sc.preempt_batch, sc.preempt_for_fairness),
                             reserved_seats=sc.reserved_seats,
                             batch_seats_with_interactive=batch_seats,
                             interactive_quiet_s=sc.interactive_quiet_s, batch_ramp_s=sc.batch_ramp_s)

    # -- EngineSignals, as the backend's EngineStats would report them -------------
    @property
    def waiting(self) -> int:
        # llmd reads the engine's last step record: between boundaries it does not see what it
        # dispatched since, and sends every arrival in (exact mode models that)
        return self.recorded_waiting if self.exact else len(self.engine.waiting)

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_used() / self.engine.spec.kv_tokens

    @property
    def generated_tokens(self) -> int:
        return self.engine.generated

    @property
    def itl(self) -> deque[tuple[float, float]]:
        return self.gaps

    # -- requests ----------------------------------------------------------------
    def submit(self, r: Req, now: float) -> None:
        """Routed here (or back after a preemption): queued; seated at the next tick."""
        r.replica = self.idx
        r.queued_tokens = r.prompt + r.generated
        self.queued_tokens += r.queued_tokens
        self.reqs[r.q.seq] = r
        self.core.submit(r.q)
        self.dirty = True
        if self.exact and not self.engine.idle():  # llmd ticks as it queues: its preemptions stop mid-step
            self.early += self._tick(now)

    def boundary(self, now: float) -> tuple[list[Req], list[Req], list[Req]]:
        """The engine reached a step boundary (or was idle): finish what ended, tick if anything
        changed, start the next work. Returns (first tokens, finished, dropped by deadline).
        llmd hears of the finished requests only while the engine runs its next step (it reads
        the engine's output then, as llmd/scheduler.py does on the fake and the real engine): what
        arrived before the boundary is seated in the next step, a seat they free a step later."""
        eng = self.engine
        aborts, self.aborts = self.aborts, []  # those the ticks below ask for wait for the next boundary
        for r in aborts:  # first: llmd's abort takes effect mid-step, the step's token never reaches it
            self._abort(r, now)
        expired = self._expired(now)  # so does a stream's deadline
        started, done = eng.complete(now) if not eng.idle() else ([], [])
        if self.exact:  # the record: what waits once the engine admits (seats; plan() below is exact)
            self.recorded_waiting = max(0, len(eng.waiting) - max(0, eng.spec.max_num_seqs - eng.running))
        # A lowered limit or the batch cap's quiet period is seen by the next periodic tick (exact:
        # at every boundary while anything is queued, as llmd ticks every 10 ms then).
        queued = self.exact and len(self.core.queue) > 0
        dropped, self.early = self.early + expired, []
        if self.dirty or queued or now - self.last_tick >= self.tick_every_s:
            dropped += self._tick(now)
        self.next_t = eng.plan(now)
        if self.exact:
            self.recorded_waiting = len(eng.waiting)
        if self.next_t is not None and (td := self._next_deadline()) < self.next_t:
            self.next_t = eng.cut(td)  # a long decode segment ends at the step under way then
        for r in done:
            self._release(r, r.output)
        if done and len(self.core.queue):  # a freed seat matters only to a queued request
            waiting = len(eng.waiting)
            dropped += self._tick(now)
            if len(eng.waiting) > waiting or self.aborts:  # they join (leave) at the end of the step just started
                self.next_t = eng.cut(now) if self.next_t is not None else eng.plan(now)
        if self.exact and len(self.core.queue) and self.next_t is not None:
            self.next_t = eng.cut(now)  # a step at a time while anything waits: it is seated in the next one
        return started, done, dropped

    def _tick(self, now: float) -> list[Req]:
        self.dirty = False
        self.last_tick = now
        return self._apply(self.core.tick(), now)

    def _release(self, r: Req, output: int | None) -> None:
        self.core.on_output(r.q, r.generated - r.charged)
        r.charged = r.generated
        self.core.finished(r.q, output)
        self.reqs.pop(r.q.seq, None)

    def _expired(self, now: float) -> list[Req]:
        """Streams whose deadline passed in the step just ended: llmd's request ends then (the
        client gets the deadline error, the engine an abort), whatever it had produced; one
        preempted back into the queue is the core's to drop."""
        out: list[Req] = []
        h = self.deadlines
        while h and h[0][0] <= now:
            r = heapq.heappop(h)[2]
            if not self._live(r):
                continue  # finished, or waiting in the queue again
            self.engine.remove(r.seq, now)
            self._release(r, r.generated)
            out.append(r)
        return out

    def _live(self, r: Req) -> bool:
        """In the engine, on this replica, now."""
        return r.seq is not None and self.reqs.get(r.q.seq) is r

    def _next_deadline(self) -> float:
        """The earliest deadline of a request in the engine (stale entries dropped); inf: none."""
        h = self.deadlines
        while h and not self._live(h[0][2]):
            heapq.heappop(h)
        return h[0][0] if h else float("inf")

    def _abort(self, r: Req, now: float) -> None:
        """A preemption by llmd: out of the engine, back in the queue, to resume from its tokens."""
        if r.seq is None and r.generated >= r.output:
            return  # it finished in an earlier step: llmd's abort finds nothing to stop
        if r.seq is not None:
            self.engine.remove(r.seq, now)
        self.core.on_output(r.q, r.generated - r.charged)
        r.charged = r.generated
        self.core.finished(r.q, None)
        self.sched_preempted += 1
        self.submit(r, now)

    def _apply(self, d: Decision, now: float) -> list[Req]:
        dropped = []
        for q in d.drop:
            r = self.reqs.pop(q.seq)
            self.queued_tokens -= r.queued_tokens
            dropped.append(r)
        for q in (*d.dispatch, *d.heirs):
            r = self.reqs[q.seq]
            self.queued_tokens -= r.queued_tokens
            r.queued_tokens = 0
            self.engine.add(r)
            self.sent += 1  # (a preempted request sent again gets a second entry: the first finds it gone)
            heapq.heappush(self.deadlines, (q.deadline, self.sent, r))
        if len(self.deadlines) > 2 * len(self.reqs) + 64:  # entries of finished requests: drop them
            self.deadlines = [e for e in self.deadlines if self._live(e[2])]
            heapq.heapify(self.deadlines)
        for q in d.preempt:
            r = self.reqs[q.seq]
            if self.engine.idle():
                self._abort(r, now)
            else:
                self.aborts.append(r)
        return dropped

    def prefill_tps(self) -> float:
        """Prompt tokens per second a full chunk runs at: what the router's TTFT estimate divides by."""
        n = self.engine.spec.max_num_batched_tokens
        return n / max(1e-9, self.engine.step.seconds(StepShape(0, n, 1, 0, n * n / 2)))

    def fail(self, now: float) -> list[Req]:
        """Dead: everything it held (queued or running) goes back to the ingress."""
        out = self.engine.clear(now)
        queued = [r for r in self.reqs.values() if r.seq is None and not r.q.running]
        for r in out:
            self.core.finished(r.q, None)
        for r in queued:
            self.core.withdraw(r.q)
        self.reqs.clear()
        self.deadlines.clear()
        self.aborts.clear()
        self.queued_tokens = 0
        self.version += 1
        self.next_t = None
        everything = out + queued
        everything.sort(key=lambda r: r.q.seq)
        return everything
