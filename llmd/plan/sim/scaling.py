"""The fleet's replicas over time: active, draining, warm, cold, starting, failed; what they cost
(active, draining, warm, starting and failed are billed: the machines are held); the autoscaler
(llmd.policy.warmpool's hysteresis on queue depth and TTFT) and failures (exponential, MTBF).

Scaling up: `step` replicas at a time, warm ones first (awake after warm_start_s), else cold ones
(cold_start_s); the warm pool is then refilled from cold. Scaling down: `step` active replicas
drain (no new requests) and go back to warm, or cold once the pool is full.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final, Protocol

from llmd.plan.sim.events import CONTROL, FAIL, READY
from llmd.plan.sim.metrics import Recorder
from llmd.plan.sim.replica import Replica
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import SimSpec
from llmd.policy.warmpool import ClusterLoad, WarmPoolPolicy

BILLED: Final = ("active", "draining", "warm", "starting", "waking", "failed")


class Fleet(Protocol):
    """What the scaler reads and does of the fleet (fleet.Fleet)."""

    spec: SimSpec
    now: float
    replicas: list[Replica]
    rng: random.Random
    rec: Recorder

    @property
    def clock(self) -> Callable[[], float]: ...

    def push(self, t: float, kind: int, idx: int = -1, version: int = 0) -> None: ...

    def requeue(self, reqs: list[Req]) -> None: ...


class Scaler:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.spec = fleet.spec
        self.routable: list[int] = []  # active replicas, by index
        self.billed_s = 0.0  # replica-seconds
        self._t = 0.0
        self._counts: dict[str, int] = {}
        self.failures = 0
        self.scale_ups = 0
        self.scale_downs = 0
        self._ttfts: list[float] = []
        self._target: dict[int, str] = {}  # a starting replica's state once ready
        a = self.spec.autoscale
        self.up = WarmPoolPolicy(a.bounds, fleet.clock) if a else None
        self.down = WarmPoolPolicy(a.bounds, fleet.clock) if a else None
        if self.down is not None:
            self.down.promoted = True  # it only ever demotes
        n = self.spec.replicas
        active = a.min_active if a else n
        warm = min(a.warm_pool, n - active) if a else 0
        for rep in fleet.replicas:
            rep.state = "active" if rep.idx < active else "warm" if rep.idx < active + warm else "cold"
            self._counts[rep.state] = self._counts.get(rep.state, 0) + 1
        self.routable = list(range(active))

    def count(self, state: str) -> int:
        return self._counts.get(state, 0)

    def _set(self, rep: Replica, state: str) -> None:
        now = self.fleet.now
        self.billed_s += sum(self._counts.get(s, 0) for s in BILLED) * (now - self._t)
        self._t = now
        self._counts[rep.state] -= 1
        self._counts[state] = self._counts.get(state, 0) + 1
        if rep.state == "active":
            self.routable.remove(rep.idx)
        rep.state = state
        if state == "active":
            self.routable.append(rep.idx)
            self.routable.sort()

    def close(self) -> float:
        """Bills up to now; returns the replica-seconds billed."""
        now = self.fleet.now
        self.billed_s += sum(self._counts.get(s, 0) for s in BILLED) * (now - self._t)
        self._t = now
        return self.billed_s

    def start(self) -> None:
        if self.spec.autoscale is not None:
            self.fleet.push(self.spec.autoscale.interval_s, CONTROL)
        if self.spec.mtbf_s is not None:
            for i in self.routable:
                self._next_failure(i)

    def _next_failure(self, idx: int) -> None:
        assert self.spec.mtbf_s is not None
        self.fleet.push(self.fleet.now + self.fleet.rng.expovariate(1.0 / self.spec.mtbf_s), FAIL, idx)

    def observe_ttft(self, x: float) -> None:
        if self.up is not None:
            self._ttfts.append(x)

    def event(self, kind: int, idx: int) -> None:
        if kind == CONTROL:
            self._control()
        elif kind == FAIL:
            self._fail(self.fleet.replicas[idx])
        elif kind == READY:
            rep = self.fleet.replicas[idx]
            self._set(rep, self._target.pop(idx, "active"))
            if rep.state == "active" and self.spec.mtbf_s is not None:
                self._next_failure(idx)

    def _control(self) -> None:
        a, f = self.spec.autoscale, self.fleet
        assert a is not None and self.up is not None and self.down is not None
        queue = sum(f.replicas[i].queued_tokens + sum(s.plen - s.done for s in f.replicas[i].engine.waiting)
                    for i in self.routable)
        self._ttfts.sort()
        p90 = self._ttfts[min(len(self._ttfts) - 1, int(0.9 * len(self._ttfts)))] if self._ttfts else None
        self._ttfts.clear()
        load = ClusterLoad(queue, p90)
        if self.up.observe(load) == "promote":
            self.up.reset()
            self._scale_up(a.step)
        if self.down.observe(load) == "demote":
            self.down.promoted = True
            self._scale_down(a.step)
        f.push(f.now + a.interval_s, CONTROL)

    def _wake(self, rep: Replica, state: str, delay: float, target: str) -> None:
        self._set(rep, state)
        self._target[rep.idx] = target
        self.fleet.push(self.fleet.now + delay, READY, rep.idx)

    def _scale_up(self, n: int) -> None:
        a = self.spec.autoscale
        assert a is not None
        reps = self.fleet.replicas
        for state, delay in (("warm", a.warm_start_s), ("cold", a.cold_start_s)):
            for rep in reps:
                if n and rep.state == state:
                    self._wake(rep, "waking" if state == "warm" else "starting", delay, "active")
                    n -= 1
        self.scale_ups += 1
        warm = self.count("warm") + sum(1 for t in self._target.values() if t == "warm")
        for rep in reps:
            if warm < a.warm_pool and rep.state == "cold":
                self._wake(rep, "starting", a.cold_start_s, "warm")
                warm += 1

    def _scale_down(self, n: int) -> None:
        a = self.spec.autoscale
        assert a is not None
        for idx in sorted(self.routable, reverse=True):
            if n and len(self.routable) > a.min_active:
                rep = self.fleet.replicas[idx]
                self._set(rep, "draining")
                n -= 1
                self.scale_downs += 1
                if not rep.reqs:
                    self.drained(rep)

    def drained(self, rep: Replica) -> None:
        a = self.spec.autoscale
        self._set(rep, "warm" if a is not None and self.count("warm") < a.warm_pool else "cold")

    def _fail(self, rep: Replica) -> None:
        if rep.state not in ("active", "draining"):
            return
        self.failures += 1
        self.fleet.rec.counts["replica_failures"] += 1
        reqs = rep.fail(self.fleet.now)
        target = "active" if rep.state == "active" else "cold"
        self._set(rep, "failed")
        self._target[rep.idx] = target
        self.fleet.push(self.fleet.now + self.spec.repair_s, READY, rep.idx)
        self.fleet.requeue(reqs)
