"""CPU-time instruments: what a piece of code costs the thread it runs on, measured directly.

CPU time, not wall time: on a busy 2-CPU box a thread is often descheduled mid-call, and
wall time would bill that to whatever was running. bench/metering.py uses these to time the
ledger's share of the serving event loop.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a child process has used, from /proc; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TimedCalls:
    """`real` with the methods in `names` behind a stopwatch: `.seconds` is the calling thread's
    CPU time inside them; every other attribute is `real`'s. A clock read costs about as much
    as a cheap call, so each reading is corrected by one clock read timed right after it (the
    forwarding of arguments still counts: time a no-op stand-in the same way to see it).
    Attributes in `copy` are copied, so reading them costs what it costs on `real` (a miss
    that falls through to __getattr__ is a Python call)."""

    def __init__(self, real: Any, names: Iterable[str], copy: Iterable[str] = ()) -> None:
        self.real, self.seconds = real, 0.0
        for name in copy:
            setattr(self, name, getattr(real, name))
        for name in names:
            setattr(self, name, self._timed(getattr(real, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time

        def call(*a: Any, **k: Any) -> Any:
            t0 = clock()
            out = fn(*a, **k)
            t1 = clock()
            self.seconds += (t1 - t0) - (clock() - t1)
            return out
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@types.coroutine
def stopwatch(coro: Any, acc: list[float]) -> Any:
    """Drive `coro`, adding the CPU time of each of its steps to acc[0]: what a task costs the
    event loop's thread, without the time it spends waiting."""
    value, exc = None, None
    while True:
        t = time.thread_time()
        try:
            out = coro.send(value) if exc is None else coro.throw(exc)
        except StopIteration as stop:
            acc[0] += time.thread_time() - t
            return stop.value
        acc[0] += time.thread_time() - t
        try:
            value, exc = (yield out), None
        except BaseException as e:
            value, exc = None, e
