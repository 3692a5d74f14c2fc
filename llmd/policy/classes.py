"""One model's waiting room: strict priority between classes (interactive before
batch); inside a class, a fairness policy picks the tenant and the tenant's own
queue (FIFO or earliest deadline) picks its request.

`PRIORITY_CLASSES` is the one table of priority classes: config validation, the
service's checks, our queue's order and the engine priority all derive from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from llmd.policy.fairness import FairnessPolicy
from llmd.policy.queue import ORDERINGS, QueuedRequest, RequestQueue


@dataclass(frozen=True)
class PriorityClass:
    name: str
    rank: int  # our queue's order: a lower rank is served first, strictly
    engine_priority: int  # vLLM's priority: lower runs first when the engine itself must choose


INTERACTIVE: Final = "interactive"  # the scheduler's seat and preemption rules name these two
BATCH: Final = "batch"
PRIORITY_CLASSES: Final = (PriorityClass(INTERACTIVE, rank=0, engine_priority=0),
                           PriorityClass(BATCH, rank=1, engine_priority=1))
CLASSES: Final = tuple(c.name for c in sorted(PRIORITY_CLASSES, key=lambda c: c.rank))  # highest priority first
ENGINE_PRIORITY: Final = {c.name: c.engine_priority for c in PRIORITY_CLASSES}


class ClassQueue:
    def __init__(self, fairness: FairnessPolicy, ordering_for: Callable[[str], str]) -> None:
        self.fairness = fairness
        self._ordering_for = ordering_for
        self._tenants: dict[str, RequestQueue] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[QueuedRequest]:
        for q in self._tenants.values():
            yield from q

    def push(self, req: QueuedRequest) -> None:
        q = self._tenants.get(req.tenant)
        if q is None or not len(q):
            self.fairness.on_backlogged(req.tenant, set(self._tenants))
            q = q or ORDERINGS[self._ordering_for(req.tenant)]()
            self._tenants[req.tenant] = q
        q.push(req)
        self._count += 1

    def heads(self) -> dict[str, QueuedRequest]:
        return {t: q.peek() for t, q in self._tenants.items()}

    def pop_next(self, eligible: Callable[[str], bool] | None = None,
                 prefer: Callable[[QueuedRequest], bool] | None = None) -> QueuedRequest | None:
        """The fairness policy's pick among tenants for which `eligible` holds (all by default).
        With `prefer`, each tenant offers its first preferred request, and only tenants that have
        one compete, unless none has: the rest wait behind them, in their own order."""
        heads = self.heads()
        if eligible is not None:
            heads = {t: r for t, r in heads.items() if eligible(t)}
        if not heads:
            return None
        if prefer is not None:
            preferred = {t: r for t in heads if (r := self._tenants[t].first(prefer)) is not None}
            heads = preferred or heads
        tenant = self.fairness.pick(heads)
        q, req = self._tenants[tenant], heads[tenant]
        if req is q.peek():
            q.pop()
        else:
            q.remove(req)
        self._count -= 1
        self.fairness.on_dispatch(req)
        self._forget_if_empty(tenant)
        return req

    def remove(self, req: QueuedRequest) -> bool:
        q = self._tenants.get(req.tenant)
        if q is None or not q.remove(req):
            return False
        self._count -= 1
        self._forget_if_empty(req.tenant)
        return True

    def _forget_if_empty(self, tenant: str) -> None:
        if not len(self._tenants[tenant]):
            del self._tenants[tenant]
            self.fairness.on_idle(tenant)


class ModelQueue:
    def __init__(self, fairness_factory: Callable[[], FairnessPolicy], ordering_for: Callable[[str], str]) -> None:
        self.classes = {c: ClassQueue(fairness_factory(), ordering_for) for c in CLASSES}

    def __len__(self) -> int:
        return sum(len(c) for c in self.classes.values())

    def depth(self, klass: str) -> int:
        return len(self.classes[klass])

    def push(self, req: QueuedRequest) -> None:
        self.classes[req.klass].push(req)

    def pop_next(self, eligible: Callable[[str], bool] | None = None,
                 prefer: Callable[[QueuedRequest], bool] | None = None) -> QueuedRequest | None:
        for c in self.classes.values():
            if len(c) and (req := c.pop_next(eligible, prefer)) is not None:
                return req
        return None

    def remove(self, req: QueuedRequest) -> bool:
        return self.classes[req.klass].remove(req)

    def heads(self) -> Iterator[QueuedRequest]:
        for c in self.classes.values():
            yield from c.heads().values()

    def ahead_of(self, klass: str) -> Iterator[QueuedRequest]:
        """Everything a new request of `klass` would wait behind (its class and higher)."""
        for name, c in self.classes.items():
            yield from c
            if name == klass:
                return

    def on_output(self, req: QueuedRequest, tokens: int) -> None:
        self.classes[req.klass].fairness.on_output(req.tenant, tokens)
