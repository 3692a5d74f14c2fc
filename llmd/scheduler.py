"""The scheduler in the event loop: runs llmd.policy.scheduler's pure core and applies its
decisions to the requests waiting on it.

It owns what the core must not: the loop task and its wake-up event, each waiting
request's future, each running request's abort callback (by the request's `seq`), and
the abort tasks of preempted ones. The core ticks when a request arrives, when a seat
frees, and every TICK_S while anything waits (headroom can then appear from engine stats,
KV freed or the engine's queue drained, without any event of ours).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType

from llmd.policy.queue import QueuedRequest
from llmd.policy.scheduler import Decision, SchedulerCore

Abort = Callable[[], Awaitable[None]]


class Dropped(Exception):
    """A queued request was dropped before reaching the engine (`reason` says why)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Scheduler:
    """Wraps a SchedulerCore for the event loop; every decision is the core's."""

    TICK_S = 0.01

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self._classes = core.queue.classes  # fixed for the core's life: on_output reads it per token
        self._turns: dict[int, asyncio.Future[None]] = {}  # seq -> resolved when seated (or dropped)
        self._aborts: dict[int, Abort] = {}  # seq -> stops its engine request
        self._aborting: set[asyncio.Future[None]] = set()  # kept referenced until done
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._held = False  # the engine is down: no one is seated until it is back

    # -- read-only views (metrics, /admin/engines) --------------------------
    @property
    def running(self) -> Mapping[int, QueuedRequest]:
        return MappingProxyType(self.core.running)

    @property
    def dropped(self) -> int:
        return self.core.dropped

    @property
    def preempted(self) -> int:
        return self.core.preempted

    @property
    def seat_limit(self) -> int:
        return self.core.seat_limit

    # -- lifecycle -------------------------------------------------------
    def hold(self, held: bool) -> None:
        """Seat no one while the engine is down (the queue keeps its order); seat again after."""
        self._held = held
        if not held:
            self._wake.set()

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
    async def wait_turn(self, req: QueuedRequest, abort: Abort) -> None:
        """Queue `req` and return once it holds a seat; raises Dropped, or CancelledError.
        `abort` stops its engine request, should it be preempted while it runs."""
        turn = asyncio.get_running_loop().create_future()
        self._turns[req.seq] = turn
        self._aborts[req.seq] = abort
        self.core.submit(req)
        if not self._held:
            self._apply(self.core.tick())
        if len(self.core.queue):
            self._wake.set()  # the loop polls for headroom while anything waits
        try:
            await turn
        except BaseException:
            if self._turns.pop(req.seq, None) is not None:
                self.core.withdraw(req)
            if req.running:
                self._release(req, None)  # seated just as it was cancelled: it never ran
            else:
                self._aborts.pop(req.seq, None)
            raise

    def finished(self, req: QueuedRequest, output_tokens: int | None) -> None:
        """The engine is done with `req` (finished, aborted, preempted, or its engine died);
        `output_tokens`: all it produced so far, every attempt included (None: not a whole run)."""
        self._release(req, output_tokens)

    def on_output(self, req: QueuedRequest, tokens: int) -> None:
        """The fairness charge, straight to the class's policy (SchedulerCore.on_output's effect,
        two calls less): this runs once per token of every stream."""
        req.started = True
        self._classes[req.klass].fairness.on_output(req.tenant, tokens)

    def estimate_wait(self, tenant: str, klass: str, fair: bool) -> float:
        return self.core.estimate_wait(tenant, klass, fair)

    def demote(self, tenant: str) -> int:
        """The tenant's queued and running interactive requests become batch-class (SchedulerCore.demote)."""
        moved = self.core.demote(tenant)
        if moved:
            self._wake.set()
        return moved

    def _release(self, req: QueuedRequest, output_tokens: int | None) -> None:
        self._aborts.pop(req.seq, None)
        if self.core.finished(req, output_tokens):
            self._wake.set()

    # -- the loop --------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if len(self.core.queue):
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.TICK_S):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            if not self._held:
                self._apply(self.core.tick())

    def _apply(self, d: Decision) -> None:
        for req in d.drop:
            self._resolve(req, Dropped("deadline", "the request's deadline could no longer be met while it "
                                                   "waited in the queue; it was not run"))
        for req in d.dispatch:
            self._resolve(req, None)
        for req in d.preempt:
            # The abort finds nothing when the sequence is seated but not in the engine yet:
            # its run then sees `preempt_requested` and re-queues without starting.
            if (abort := self._aborts.get(req.seq)) is not None:
                task = asyncio.ensure_future(abort())
                self._aborting.add(task)
                task.add_done_callback(self._aborting.discard)
        for req in d.heirs:
            self._resolve(req, None)

    def _resolve(self, req: QueuedRequest, error: Exception | None) -> None:
        turn = self._turns.pop(req.seq, None)
        if turn is None or turn.done():
            return
        if error is None:
            turn.set_result(None)
        else:
            turn.set_exception(error)
