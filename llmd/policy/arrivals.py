"""How many sequences enter a model's queue per second lately: new requests and resumed ones,
each of which brings a prefill to some later engine step (the step-time model caps the prefill
share it predicts for more seats by this: llmd/policy/steptime.py)."""

from __future__ import annotations

from collections import deque

from llmd.policy.signals import Clock


class ArrivalRate:
    """Arrivals over the last `window_s` seconds, per second; None until a window has passed, so
    a cold start does not read a burst of a few requests as the steady rate."""

    def __init__(self, clock: Clock, window_s: float = 30.0) -> None:
        self.clock = clock
        self.window_s = window_s
        self._times: deque[float] = deque()
        self._since = clock()

    def note(self) -> None:
        self._times.append(self.clock())

    def per_s(self) -> float | None:
        now = self.clock()
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
        if now - self._since < self.window_s:
            return None
        return len(self._times) / self.window_s
