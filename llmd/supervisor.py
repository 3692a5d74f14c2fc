"""The engine supervisor: a dead engine is rebuilt from the local weight store, with backoff,
while the server keeps running.

Each served version has an `EngineWatch`: whether its engine is up, being rebuilt, or given
up on, and an event the requests it carried wait on. A request whose engine died waits for
the watch (bounded by `restart_timeout_s` and its deadline), then runs again on the new engine
(llmd.dispatch): from its prompt if it had produced nothing, else resumed from prompt + the
tokens it delivered. The version's queue and scheduler stay; only its backend is swapped, and
the scheduler seats no one while the engine is down, so queued requests keep their place.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from llmd.backends import Backend
from llmd.config import ModelConfig
from llmd.telemetry import log

UP, RESTARTING, FAILED = "up", "restarting", "failed"
STOP_OLD_S = 30.0  # a dead engine's shutdown that takes longer is left behind


class EngineWatch:
    """One engine's state as its requests and the node's health see it."""

    def __init__(self, attempts: int = 0, timeout_s: float = 0.0, wake: Callable[[], None] | None = None) -> None:
        self.attempts = attempts  # rebuilds tried in a row before giving up (0: unsupervised)
        self.timeout_s = timeout_s  # how long a request waits for the engine to come back
        self.state = UP
        self.closed = False  # the version was unloaded: never rebuilt
        self.restarts = 0
        self.restart_s: list[float] = []  # death noticed -> new engine serving, per restart
        self.resumed = 0  # streams carried over a restart with tokens already delivered
        self.requeued = 0  # requests carried over a restart before their first token
        self._wake = wake
        self._changed = asyncio.Event()

    @property
    def recoverable(self) -> bool:
        """Up or coming back: requests may still wait for it."""
        return self.attempts > 0 and self.state != FAILED and not self.closed

    def dead(self) -> bool:
        """The engine was seen dead: the supervisor looks at once. True if it will be rebuilt
        (requests may wait for it)."""
        if self._wake is not None:
            self._wake()
        if self.recoverable and self.state == UP:
            self.set(RESTARTING)
        return self.recoverable

    def set(self, state: str) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    async def back(self, timeout_s: float) -> bool:
        """Wait until the engine serves again; False if given up on or not back within `timeout_s`."""
        end = time.monotonic() + min(timeout_s, self.timeout_s)
        while self.recoverable:
            if self.state == UP:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()
        return False

    def carried(self, delivered: bool) -> None:
        if delivered:
            self.resumed += 1
        else:
            self.requeued += 1


class Supervised(Protocol):
    """What the supervisor reads and swaps on a served version (ModelRuntime satisfies it)."""

    cfg: ModelConfig
    backend: Backend
    watch: EngineWatch

    def hold(self, held: bool) -> None:
        """Seat no one (True) while the engine is down; seat again (False)."""


Rebuild = Callable[[ModelConfig], Awaitable[Backend]]  # constructed (not started) from the weight store


class Supervisor:
    """Watches every served version's engine and rebuilds the dead ones, one task each."""

    POLL_S = 0.25  # a death no request saw (an idle engine) is noticed within this

    def __init__(self, served: Callable[[], Iterable[Supervised]], rebuild: Rebuild) -> None:
        self._served = served
        self._rebuild = rebuild
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._restarts: dict[int, asyncio.Task[None]] = {}

    def watch(self, cfg: ModelConfig) -> EngineWatch:
        e = cfg.engine
        return EngineWatch(e.restart_attempts, e.restart_timeout_s, self._wake.set)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-supervisor")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._restarts.values()) if t is not None]
        self._task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.POLL_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self._look()
            except Exception:  # the supervisor must outlive a bug in what it reads
                log.exception("engine_supervisor_error")

    def _look(self) -> None:
        """Start a rebuild for each dead engine not already being rebuilt (or given up on)."""
        for rt in list(self._served()):
            w = rt.watch
            if w.state != FAILED and not w.closed and not rt.backend.healthy and id(rt) not in self._restarts:
                task = asyncio.get_running_loop().create_task(self._restart(rt), name="engine-restart")
                self._restarts[id(rt)] = task
                task.add_done_callback(functools.partial(self._forget, id(rt)))

    def _forget(self, key: int, _task: asyncio.Task[None]) -> None:
        self._restarts.pop(key, None)

    async def _restart(self, rt: Supervised) -> None:
        w, old, t0 = rt.watch, rt.backend, time.monotonic()
        name = rt.cfg.name
        if w.attempts == 0:
            log.error("engine_dead", model=name, version=old.version, restart="disabled")
            w.set(FAILED)
            return
        log.error("engine_dead", model=name, version=old.version, restart="rebuilding")
        rt.hold(True)
        if w.state != RESTARTING:
            w.set(RESTARTING)
        new = await self._rebuilt(rt, old)
        if new is None or w.closed:
            if new is not None:
                await new.stop()
            w.set(FAILED)
            rt.hold(False)  # the queued requests meet the dead engine and end with `engine_dead` now
            return
        rt.backend = new
        w.restarts += 1
        w.restart_s.append(time.monotonic() - t0)
        w.set(UP)
        # Seat again only once the requests that waited for this engine have queued again (their
        # tasks wake before this callback runs): they go back to their places, ahead of later ones.
        asyncio.get_running_loop().call_soon(rt.hold, False)
        log.info("engine_restarted", model=name, version=new.version, seconds=round(w.restart_s[-1], 2))
        with contextlib.suppress(Exception):  # its process is gone already; this frees what is left
            async with asyncio.timeout(STOP_OLD_S):
                await old.stop()

    async def _rebuilt(self, rt: Supervised, old: Backend) -> Backend | None:
        """A started engine of the same weights (the same version), or None once every attempt failed."""
        cfg, w = rt.cfg, rt.watch
        if cfg.source:
            cfg = cfg.model_copy(update={"version": old.version})
        for attempt in range(w.attempts):
            if attempt:
                await asyncio.sleep(cfg.engine.restart_backoff_s * 2 ** (attempt - 1))
            if w.closed:
                return None
            new: Backend | None = None
            try:
                new = await self._rebuild(cfg)
                new.stats = old.stats  # the scheduler and the ITL controller read this one object
                new.stats.running = new.stats.waiting = 0
                new.stats.kv_usage = 0.0
                await new.start()
                return new
            except Exception as e:
                if new is not None:
                    with contextlib.suppress(Exception):
                        await new.stop()
                log.error("engine_restart_failed", model=cfg.name, attempt=attempt + 1, error=str(e))
        log.error("engine_given_up", model=cfg.name, attempts=w.attempts)
        return None
