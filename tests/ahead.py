"""Real-engine servers started ahead of the tests that use them, in a background thread, while
other tests run: a start costs about a minute of one core here, mostly vLLM's processes importing
torch, and the fake-backend tests leave the other core mostly idle.

tests/conftest.py runs the tests under tests/engine last, those on servers started here first
among them, and half-way through the others begins the starts, one after another in the order
the tests first use them, with at most LIVE servers up at once (an engine holds 3-4 GB); a server
stops after its last test (`finish`), which makes room for the next. A fixture takes its server
(`take`), waiting for its start, or starting it then and there when nothing began it (a run of
engine tests alone) or when it waits for room. The servers are the same either way, and so is
their graceful stop, only made in the background."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from bench.lib.servers import inherit
from llmd.store import home

Starter = Callable[[], Any]
Stopper = Callable[[Any], None]
STARTERS: dict[str, tuple[Starter, Stopper]] = {}  # fixture name -> how its server starts and stops
ROOMS: dict[str, int] = {}  # fixture name -> engines its start holds, when more than one (a cluster's nodes)
# Jobs begun at the first test rather than half-way, without an engine's room: CPU work of minutes
# (a compiler run) that the idle core does while the fake-backend tests run.
EARLY: set[str] = set()
LIVE = 3
_ROOM = threading.Semaphore(LIVE)
# The environment as the session began: a server started in the background inherits this, not
# os.environ as it is at that moment, which a test running meanwhile may have monkeypatched.
SESSION_ENV = dict(os.environ)
SESSION_HOME = home()  # the weight store's LLMD_HOME as the session began


class _Ahead:
    def __init__(self, start: Starter, stop: Stopper, rooms: int = 1) -> None:
        self.start, self.stop, self.rooms = start, stop, rooms
        self.done, self.wanted = threading.Event(), threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.room = 0  # how many of _ROOM's places it holds
        self.cancelled = False  # finished before it started (a run that ended early): never started

    def run(self) -> None:
        while not self.cancelled and self.room < self.rooms:
            if _ROOM.acquire(timeout=0.2):
                self.room += 1
            elif self.wanted.is_set():  # a test waits for it: start it now, room or not
                break
        try:
            if not self.cancelled:
                self.value = self.start()
        except BaseException as e:  # handed to the fixture that takes it, which fails with it
            self.error = e
        finally:
            self.done.set()


_AHEAD: dict[str, _Ahead] = {}
_LOCK = threading.Lock()


def _claim(names: list[str]) -> list[_Ahead]:
    """The entries to run for these names, made now (whoever made one runs it)."""
    with _LOCK:
        new = [n for n in dict.fromkeys(names) if n in STARTERS and n not in _AHEAD]
        return [_AHEAD.setdefault(n, _Ahead(*STARTERS[n], rooms=0 if n in EARLY else ROOMS.get(n, 1))) for n in new]


def begin(names: list[str]) -> None:
    """Start these fixtures' servers one after another in a background thread (those not begun)."""
    todo = _claim(names)
    if todo:
        threading.Thread(target=_run_all, args=(todo,), name="llmd-ahead", daemon=True).start()


def _run_all(todo: list[_Ahead]) -> None:
    with inherit(SESSION_ENV):
        for a in todo:
            a.run()


def take(name: str) -> Any:
    """The server fixture `name` uses: started ahead (waiting for it), else started now."""
    for mine in _claim([name]):
        mine.wanted.set()
        mine.run()
    a = _AHEAD[name]
    a.wanted.set()
    a.done.wait()
    if a.error is not None:
        raise a.error
    return a.value


def finish(name: str) -> None:
    """Stop fixture `name`'s server (if it was started), once, in the background: a graceful stop
    waits ~10 s for vLLM's processes, which the next test need not."""
    with _LOCK:
        a = _AHEAD.pop(name, None)
    if a is None:
        return
    a.cancelled = not a.wanted.is_set()

    def stop() -> None:
        a.done.wait()
        try:
            if a.value is not None:
                a.stop(a.value)
        finally:
            for _ in range(a.room):
                _ROOM.release()

    t = threading.Thread(target=stop, name=f"llmd-stop-{name}", daemon=True)
    t.start()
    _STOPPING.append(t)


_STOPPING: list[threading.Thread] = []


def finish_all() -> None:
    """At the session's end: stop whatever was started ahead and never taken (an aborted run),
    and wait until every server is stopped."""
    for name in list(_AHEAD):
        finish(name)
    for t in _STOPPING:
        t.join()
