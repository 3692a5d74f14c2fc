"""Session-scoped real-engine servers started ahead of the tests that use them, in a background
thread, while the fake-backend tests run: a start costs about a minute of one core here, mostly
vLLM's processes importing torch, and the fake-backend tests leave the other core mostly idle.

tests/conftest.py runs the tests under tests/engine last, and half-way through the others begins
the starts that the collected tests will need, one after another (an engine holds about 4 GB).
The fixtures then take the started server (`take`), or start it then and there when nothing began
it (a run of engine tests alone). The servers and what they serve are the same either way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Starter = Callable[[], Any]
Stopper = Callable[[Any], None]
STARTERS: dict[str, tuple[Starter, Stopper]] = {}  # fixture name -> how its server starts and stops


class _Ahead:
    def __init__(self, start: Starter, stop: Stopper) -> None:
        self.start, self.stop = start, stop
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.start()
        except BaseException as e:  # handed to the fixture that takes it, which fails with it
            self.error = e
        finally:
            self.done.set()


_AHEAD: dict[str, _Ahead] = {}
_LOCK = threading.Lock()


def begin(names: list[str]) -> None:
    """Start these fixtures' servers one after another in a background thread (those not begun)."""
    with _LOCK:
        todo = [_AHEAD.setdefault(n, _Ahead(*STARTERS[n])) for n in names if n in STARTERS and n not in _AHEAD]
    if todo:
        threading.Thread(target=lambda: [a.run() for a in todo], name="llmd-ahead", daemon=True).start()


def take(name: str) -> Any:
    """The server fixture `name` uses: started ahead (waiting for it), else started now."""
    begin([name])
    a = _AHEAD[name]
    a.done.wait()
    if a.error is not None:
        raise a.error
    return a.value


def finish(name: str) -> None:
    """Stop fixture `name`'s server (if it was started), once."""
    with _LOCK:
        a = _AHEAD.pop(name, None)
    if a is not None:
        a.done.wait()
        if a.value is not None:
            a.stop(a.value)


def finish_all() -> None:
    """At the session's end: stop whatever was started ahead and never taken (an aborted run)."""
    for name in list(_AHEAD):
        finish(name)
