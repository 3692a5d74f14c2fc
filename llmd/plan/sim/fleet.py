"""The fleet's event loop: arrivals through the ingress (gateway latency, one global admission
controller, routing by llmd.policy.placement), replicas stepping their engines, and the periodic
work (the router's view refresh, the autoscaler, the timeline's minutes, failures).

One heap of (time, serial, kind, replica, version) events; arrivals are read in order from the
trace, not pushed. A replica's boundary event is superseded (its version bumped) when the work
under way is cut short.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from llmd.config import TenantConfig
from llmd.plan.sim.degrade import SHED_REASON, Degradation
from llmd.plan.sim.events import BOUNDARY, GOSSIP, MINUTE
from llmd.plan.sim.hist import Hist
from llmd.plan.sim.metrics import Recorder
from llmd.plan.sim.replica import IDLE_TICK_S, Replica
from llmd.plan.sim.request import Req
from llmd.plan.sim.scaling import Scaler
from llmd.plan.sim.spec import SimSpec
from llmd.plan.sim.trace import CLASSES, Trace
from llmd.policy import draws
from llmd.policy.admission import AdmissionController, Ticket
from llmd.policy.placement import Candidate, ScoreRouting, VersionLoad
from llmd.policy.queue import QueuedRequest
from llmd.policy.reservations import Reservations
from llmd.stepmodel import StepTime

ROW_BLOCK: Final = 4096  # trace rows converted to Python numbers at a time


@contextmanager
def _rare_collections() -> Iterator[None]:
    """The cyclic garbage collector, rarely, for the run: a run makes millions of small objects
    (events, requests, steps) that die young or by reference count, and the collector's default
    thresholds walked every live one over and over (about 10 % of a seed-scale run). Objects from
    before the run are frozen out of its walks; cycles are still collected. Restored after."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def tenant_configs(spec: SimSpec, names: tuple[str, ...]) -> list[TenantConfig]:
    """The spec's tenants by name; a trace tenant it does not list gets weight 1 and no quota."""
    given = {t.name: t for t in spec.tenants}
    return [given.get(n) or TenantConfig(name=n) for n in names]


class Fleet:
    def __init__(self, spec: SimSpec, trace: Trace, step: StepTime) -> None:
        self.spec = spec
        self.trace = trace
        self.now = 0.0
        self.tenants = tenant_configs(spec, trace.tenants)
        self.rec = Recorder(trace.tenants, spec.warmup_s, spec.delivery_s, spec.horizon_s,
                            exact=spec.exact)
        clock: Callable[[], float] = lambda: self.now  # noqa: E731 - the one virtual clock
        self.clock = clock
        self.admission = AdmissionController(self.tenants, clock)
        self.reservations = Reservations(clock, ttl_s=max(1.0, 4 * spec.gossip_s))
        self.router = ScoreRouting(self.reservations, random.Random(spec.seed))
        self.rng = random.Random(spec.seed + 1)  # candidates and failures
        self.holds = random.Random(spec.seed + 2)  # each request's first-token hold
        self.replicas = [Replica(i, spec.engine, spec.scheduling, self.tenants, step, clock, self.rec,
                                 spec.control_interval_s, spec.exact)
                         for i in range(spec.replicas)]
        self.by_name = {r.name: r for r in self.replicas}  # the router answers with a node's name
        self.loads: list[VersionLoad] = [self._load(r) for r in self.replicas]
        self._cands: dict[tuple[int, int], Candidate] = {}  # (replica, cached tokens) -> its candidate
        self.vtc = spec.scheduling.fairness == "vtc"
        self.degrade = [Degradation(spec.degradation, clock, self.vtc) for _ in self.replicas] \
            if spec.degradation.steps else None
        self.prefill_tps = self.replicas[0].prefill_tps()
        self.scaler = Scaler(self)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self._serial = 0
        self._gossip_seq = 0
        self.in_flight = 0
        self.home: dict[int, int] = {}  # prefix group -> the replica its last request went to
        self.next_i = 0
        self._rows: list[tuple[int, int, int, int, float, int, int]] = []  # trace rows from _rows_from on
        self._rows_from = 0
        self.events = 0  # arrivals and events handled, for the speed bench
        self.minute_arrivals = 0
        self.timeline: list[dict[str, float | int | None]] = []

    # -- the loop ----------------------------------------------------------------------
    def push(self, t: float, kind: int, idx: int = -1, version: int = 0) -> None:
        self._serial += 1
        heapq.heappush(self.heap, (t, self._serial, kind, idx, version))

    def run(self) -> None:
        with _rare_collections():
            self._run()

    def _run(self) -> None:
        tr, ingress = self.trace, self.spec.ingress_s
        arrivals = (tr.t + ingress).tolist()
        n = len(arrivals)
        self.push(0.0, GOSSIP)
        self.push(60.0, MINUTE)
        self.scaler.start()
        heap = self.heap
        horizon = math.inf if self.spec.horizon_s is None else self.spec.horizon_s
        while True:
            ta = arrivals[self.next_i] if self.next_i < n else math.inf
            if heap and heap[0][0] <= ta:
                t, _, kind, idx, version = heapq.heappop(heap)
                if t > horizon:
                    break  # the clients cut what is still running
                if kind != BOUNDARY and self.next_i >= n and self.in_flight == 0:
                    break  # only the periodic work is left
                self.now = self.rec.now = t
                self._event(kind, idx, version)
            elif self.next_i < n:
                self.now = self.rec.now = ta
                self._arrive(self.next_i)
                self.next_i += 1
            else:
                break
        self.events = self._serial + n
        self._minute(final=True)

    def _event(self, kind: int, idx: int, version: int) -> None:
        if kind == BOUNDARY:
            rep = self.replicas[idx]
            if version == rep.version:
                self.boundary(rep)
        elif kind == GOSSIP:
            self._gossip()
        elif kind == MINUTE:
            self._minute()
        else:
            self.scaler.event(kind, idx)

    # -- requests ----------------------------------------------------------------------
    def _row(self, i: int) -> tuple[int, int, int, int, float, int, int]:
        """Trace row i as Python numbers (tenant, class, prompt, output, t, prefix, prefix tokens),
        converted a block of rows at a time: numpy's per-element reads cost more than the rest."""
        if not self._rows_from <= i < self._rows_from + len(self._rows):
            tr, j = self.trace, slice(i, i + ROW_BLOCK)
            self._rows_from = i
            self._rows = list(zip(tr.tenant[j].tolist(), tr.klass[j].tolist(), tr.prompt_tokens[j].tolist(),
                                  tr.output_tokens[j].tolist(), tr.t[j].tolist(), tr.prefix[j].tolist(),
                                  tr.prefix_tokens[j].tolist(), strict=True))
        return self._rows[i - self._rows_from]

    def _arrive(self, i: int) -> None:
        tr, spec = self.trace, self.spec
        tenant, klass, prompt, output, t_arr, prefix, prefix_tokens = self._row(i)
        prompt, output = max(1, prompt), max(1, output)
        cname = CLASSES[klass]
        q = QueuedRequest(str(i), tr.tenants[tenant], cname, prompt, output, t_arr + spec.deadline_s[cname])
        r = Req(i, tenant, klass, prompt, output, prefix, prefix_tokens, t_arr, q, t_arr >= spec.warmup_s)
        if spec.first_token_holds:
            r.hold = self.holds.choice(spec.first_token_holds)
        self.rec.counts["arrived"] += 1
        self.minute_arrivals += 1
        if prompt + output + spec.engine.block_size > spec.engine.kv_tokens:
            self.rec.refused(q.tenant, "request_too_large")
            return
        rep = self.route(r)
        if rep is None:
            self.rec.refused(q.tenant, "no_replica")
            return
        t = self.tenants[tenant]
        core = rep.core
        if self.degrade is not None and klass == 0 and not self._degraded(r, rep, self.degrade[rep.idx]):
            return
        got = self.admission.admit(t, prompt + r.output, queue_depth=len(core.queue),
                                   max_queue=spec.scheduling.max_queue,
                                   est_wait_s=core.estimate_wait(q.tenant, cname, self.vtc),
                                   time_left_s=q.deadline - self.now)
        if not isinstance(got, Ticket):
            self.reservations.release(rep.name, r.reserved)
            self.rec.refused(q.tenant, got.reason)
            return
        r.ticket = got
        self.in_flight += 1
        self.rec.counts["admitted"] += 1
        self.send(r, rep)

    def _degraded(self, r: Req, rep: Replica, d: Degradation) -> bool:
        """llmd's degradation on the replica's overload: max_tokens capped, or False: refused
        (a 503 that points at the Batch API)."""
        out = d.apply(rep.core, r.q.tenant, r.output)
        if out is None:
            self.reservations.release(rep.name, r.reserved)
            self.rec.refused(r.q.tenant, SHED_REASON)
            return False
        r.output = r.q.max_tokens = out
        return True

    def route(self, r: Req) -> Replica | None:
        """Placement's score among a few sampled replicas plus the one its prefix group last went to."""
        active = self.scaler.routable
        if not active:
            return None
        d = self.spec.route_candidates
        picks = draws.sample(self.rng, active, d) if len(active) > d else list(active)
        home = self.home.get(r.prefix) if r.prefix >= 0 else None
        if home is not None and home not in picks and self.replicas[home].state == "active":
            picks.append(home)
        cands = []
        memo, loads = self._cands, self.loads
        for idx in picks:
            rep = self.replicas[idx]
            cached = r.prefix_tokens if r.prefix >= 0 and rep.engine.holds(r.prefix) else 0
            key = (idx, min(cached, r.prompt))
            c = memo.get(key)
            if c is None or c.load is not loads[idx]:  # the same view as last time: the same (frozen) candidate
                c = memo[key] = Candidate(rep.name, loads[idx], key[1], 0.0, True)
            cands.append(c)
        choice = self.router.choose(cands, r.prompt + r.generated, r.output - r.generated)
        if choice is None:
            return None
        rep = self.by_name[choice.node]
        r.reserved = max(0, r.prompt + r.generated - choice.cached_tokens)
        if r.prefix >= 0:
            self.home[r.prefix] = rep.idx
        return rep

    def send(self, r: Req, rep: Replica) -> None:
        """Into `rep`'s queue; an idle engine ticks now, a busy one at the end of the step under way."""
        rep.submit(r, self.now)
        eng = rep.engine
        if eng.idle():
            self.boundary(rep)
            return
        end = eng.cut(self.now)
        if rep.next_t is None or end < rep.next_t - 1e-12:
            self._schedule(rep, end)

    def _schedule(self, rep: Replica, t: float | None) -> None:
        rep.version += 1
        rep.next_t = t
        if t is not None:
            self.push(t, BOUNDARY, rep.idx, rep.version)

    def boundary(self, rep: Replica) -> None:
        now, rec = self.now, self.rec
        started, done, dropped = rep.boundary(now)
        for r in started:
            if r.first_t is None:
                r.first_t = now
                rec.first_token(r, now)
                self.scaler.observe_ttft(now - r.t_arr)
            if r.reserved:
                self.reservations.release(rep.name, r.reserved)
                r.reserved = 0
        for r in done:
            self._end(r, r.prompt + r.output)
            rec.completed(r, now)
        for r in dropped:
            self._end(r, r.prompt + r.generated)
            rec.counts["deadline_dropped"] += 1
        if rep.next_t is None and len(rep.core.queue):
            # Idle engine, work queued that this tick held back (the batch cap's quiet period, a
            # lowered seat limit): llmd's scheduler loop ticks again every IDLE_TICK_S; so here.
            rep.next_t = now + IDLE_TICK_S
        self._schedule(rep, rep.next_t)
        if rep.state == "draining" and not rep.reqs:
            self.scaler.drained(rep)

    def _end(self, r: Req, used: int) -> None:
        if isinstance(r.ticket, Ticket):
            self.admission.settle(r.ticket, used)
        self.in_flight -= 1

    def requeue(self, reqs: list[Req]) -> None:
        """A failed replica's requests, back through the router (admitted already: no new ticket);
        each re-prefills its prompt and the tokens it had sent."""
        for r in reqs:
            r.q.running, r.q.preempt_requested = False, False
            rep = self.route(r)
            if rep is None:
                self._end(r, r.prompt + r.generated)
                self.rec.counts["failed_lost"] += 1
                continue
            self.rec.counts["failed_requeued"] += 1
            self.send(r, rep)

    # -- periodic -----------------------------------------------------------------------
    def _load(self, rep: Replica) -> VersionLoad:
        eng = rep.engine
        used = eng.kv_used()
        waiting = rep.queued_tokens + sum(s.plen - s.done for s in eng.waiting) + \
            sum(s.plen - s.done for s in eng.prefill)
        return VersionLoad("sim", "v", eng.spec.kv_tokens, eng.spec.kv_tokens - used, eng.running, used, waiting,
                           getattr(self, "prefill_tps", 0.0), rep.core.throughput.tps)

    def _gossip(self) -> None:
        """The router's view of each replica, as gossip would refresh it (placement's reservations
        cover what was sent since)."""
        self._gossip_seq += 1
        for i in self.scaler.routable:
            rep = self.replicas[i]
            self.loads[i] = self._load(rep)
            self.reservations.seen(rep.name, self._gossip_seq)
        self.push(self.now + self.spec.gossip_s, GOSSIP)

    def _minute(self, final: bool = False) -> None:
        rec = self.rec
        depth = sum(len(r.core.queue) + len(r.engine.waiting) for r in self.replicas)
        start = (len(self.timeline)) * 60.0
        span = max(1e-9, min(60.0, self.now - start)) if final else 60.0
        if final and self.now - start <= 0:
            return
        self.timeline.append({"t": start, "load_rps": self.minute_arrivals / span,
                              "replicas_active": self.scaler.count("active") + self.scaler.count("draining"),
                              "replicas_warm": self.scaler.count("warm"), "queue_depth": depth,
                              "ttft_p95_s": rec.minute_ttft.quantile(0.95), "itl_p95_s": rec.minute_itl.quantile(0.95)})
        self.minute_arrivals = 0
        rec.minute_ttft, rec.minute_itl = Hist(), Hist()
        if not final:
            self.push(self.now + 60.0, MINUTE)
