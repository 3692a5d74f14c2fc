"""Ordering *within* one tenant: a small abstract queue with FCFS and earliest-deadline
implementations (after vLLM's RequestQueue). Fairness *between* tenants lives in
fairness.py; the two are composed by classes.py."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_seq = itertools.count()


@dataclass(init=False, eq=False)
class QueuedRequest:
    """What the policies know about one request, from its arrival to its end: what it asks
    for, and where it stands (queued, running, asked to yield its seat). Nothing
    engine-specific. It keeps its `seq` when a preempted request queues again. (The __init__
    is written out: llmd.policy.placement.VersionLoad says why.)"""

    request_id: str
    tenant: str
    klass: str
    input_tokens: int
    max_tokens: int
    deadline: float  # seconds on the scheduler's clock
    seq: int  # arrival order (default: the next of a process-wide count)
    running: bool  # holds a seat: released to the engine and not yet finished
    preempt_requested: bool  # chosen to yield its seat; cleared when it finishes
    # False when resuming from its output so far would change the output (a structured
    # output's grammar restarts at the prompt's end): such a sequence keeps its seat.
    preemptible: bool
    started: bool  # its first output token came: its prefill is done
    queued_at: float | None  # when it first queued, on the scheduler's clock (kept when it queues again)

    def __init__(self, request_id: str, tenant: str, klass: str, input_tokens: int, max_tokens: int,
                 deadline: float, seq: int | None = None, running: bool = False, preempt_requested: bool = False,
                 preemptible: bool = True, started: bool = False, queued_at: float | None = None) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.klass = klass
        self.input_tokens = input_tokens
        self.max_tokens = max_tokens
        self.deadline = deadline
        self.seq = next(_seq) if seq is None else seq
        self.running = running
        self.preempt_requested = preempt_requested
        self.preemptible = preemptible
        self.started = started
        self.queued_at = queued_at

    @property
    def cost(self) -> int:
        return self.input_tokens + self.max_tokens


class RequestQueue(ABC):
    @abstractmethod
    def push(self, req: QueuedRequest) -> None: ...

    @abstractmethod
    def peek(self) -> QueuedRequest: ...

    @abstractmethod
    def pop(self) -> QueuedRequest: ...

    @abstractmethod
    def remove(self, req: QueuedRequest) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[QueuedRequest]: ...

    def first(self, pred: Callable[[QueuedRequest], bool]) -> QueuedRequest | None:
        """The first request in this queue's order for which `pred` holds."""
        return next((r for r in self if pred(r)), None)


class FCFSQueue(RequestQueue):
    """Arrival order. A request that queues again (preempted, or its engine died) keeps its `seq`
    and goes back to its place among those that arrived after it, not to the end."""

    def __init__(self) -> None:
        self._q: deque[QueuedRequest] = deque()

    def push(self, req: QueuedRequest) -> None:
        if not self._q or self._q[-1].seq < req.seq:
            self._q.append(req)
            return
        i = len(self._q)
        while i and self._q[i - 1].seq > req.seq:
            i -= 1
        self._q.insert(i, req)

    def peek(self) -> QueuedRequest:
        return self._q[0]

    def pop(self) -> QueuedRequest:
        return self._q.popleft()

    def remove(self, req: QueuedRequest) -> bool:
        try:
            self._q.remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._q)


class DeadlineQueue(RequestQueue):
    """Earliest deadline first; ties in arrival order."""

    def __init__(self) -> None:
        self._h: list[tuple[float, int, QueuedRequest]] = []

    def push(self, req: QueuedRequest) -> None:
        heapq.heappush(self._h, (req.deadline, req.seq, req))

    def peek(self) -> QueuedRequest:
        return self._h[0][2]

    def pop(self) -> QueuedRequest:
        return heapq.heappop(self._h)[2]

    def remove(self, req: QueuedRequest) -> bool:
        for i, (_, _, r) in enumerate(self._h):
            if r is req:
                self._h.pop(i)
                heapq.heapify(self._h)
                return True
        return False

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return (r for _, _, r in sorted(self._h, key=lambda e: (e[0], e[1])))


ORDERINGS: dict[str, type[RequestQueue]] = {"fifo": FCFSQueue, "deadline": DeadlineQueue}
