"""Saturation detection: does the engine have headroom for one more sequence?

Kept apart from the scheduler (as in llm-d's flow control) so the signal can
change without touching queueing. Headroom means: fewer sequences running than
the seat limit, KV cache below its high-water mark, and the engine's own waiting
queue empty, so that *our* queue, not the engine's FCFS, decides the order.
With a target inter-token latency the seat limit adapts (AIMD): it shrinks
multiplicatively when p95 ITL exceeds the aim and grows by one when the seats
are full and latency has room.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

from llmd.backends.base import EngineStats


def p95(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


class ITLController:
    """AIMD on measured p95 inter-token latency.

    It steers on the gaps between a request's tokens as they reach the gateway (the service
    feeds them in): what clients see, a preempted request's wait included. vLLM's own ITL
    samples ran 10% under the clients' p95 in bench/fairness.py (c) and let the limit grow
    past the target. Clients add their read loop, so the controller aims at `margin` x target. A cut scales with the overshoot (never
    below half), so a limit far too high converges in a few windows, not dozens. A cut
    is judged only on latency measured after the previous cut took effect: running must
    have come down to the limit and a full window (6 s; half of one when p95 is over 1.25x
    the aim) must have passed, or one noisy window (a burst of prefills, say) would drive
    the limit down. Growth is judged on the same full window. A cut that did not lower
    p95 at all is undone and the limit held there for `hold_s`: when the stalls come from
    prefills, not from the batch, fewer seats only cost throughput (and preemptions).
    """

    def __init__(self, target_ms: float, max_seats: int, min_seats: int = 1, window_s: float = 6.0,
                 interval_s: float = 0.5, decrease: float = 0.9, margin: float = 0.92, hold_s: float = 10.0,
                 clock: Callable[[], float] = time.time,
                 samples: Callable[[], Iterable[tuple[float, float]]] | None = None) -> None:
        self.samples = samples  # (wall time, gap) per token; default: the engine's own ITL
        self.target = target_ms / 1000.0 * margin
        self.max_seats = max_seats
        self.min_seats = min_seats
        self.limit = float(max_seats)
        self.window_s = window_s
        self.interval_s = interval_s
        self.decrease = decrease
        self.clock = clock
        self._next = 0.0
        self._settled_at = 0.0  # when running last reached the limit after a cut
        self._cut = False
        self._before: tuple[float, float] | None = None  # (limit, p95) before the last cut
        self.hold_s = hold_s
        self._floor, self._floor_until = 0.0, 0.0  # no cut below _floor until _floor_until
        self.last_p95: float | None = None

    def update(self, stats: EngineStats, running: int | float) -> int:
        now = self.clock()
        if self._cut and running <= self.limit:
            self._cut, self._settled_at = False, now
        if now < self._next:
            return int(self.limit)
        self._next = now + self.interval_s
        since = now - self._settled_at
        itl = list(self.samples()) if self.samples is not None else stats.itl
        full = [x for t, x in itl if t >= max(now - self.window_s, self._settled_at)]
        if len(full) < 8:
            return int(self.limit)
        self.last_p95 = p95(full)
        # Only a binding limit is to blame: while sequences ramp up (running well below it)
        # the stalls are prefills, and a cut would only be undone.
        binding = not self._cut and running >= 0.9 * self.limit
        short = [x for t, x in itl if t >= max(now - self.window_s / 2, self._settled_at)]
        if binding and since >= self.window_s / 2 and len(short) >= 8 and p95(short) > 1.25 * self.target:
            self._cut_or_undo(now, p95(short))  # far over: half a window is evidence enough
        elif self.last_p95 > self.target:
            if binding and since >= self.window_s:
                self._cut_or_undo(now, self.last_p95)
        else:
            self._before = None
            self._maybe_grow(now, running)
        return int(self.limit)

    def _maybe_grow(self, now: float, running: int | float) -> None:
        """One more seat, judged on a whole window at the current limit. A cut needs the same
        window unless the overshoot is large: on a half window a few prefills more or less
        decide, and those kept cutting a limit whose p95 over 20 s was 25% under the target
        (bench/fairness.py (c): 16 seats, where 24 met it)."""
        if running < int(self.limit) or now - self._settled_at < self.window_s:
            return
        assert self.last_p95 is not None
        if self.last_p95 < 0.9 * self.target:
            self.limit = min(self.max_seats, self.limit + 1)
            self._settled_at = now

    def _cut_or_undo(self, now: float, seen: float) -> None:
        if self._before is not None and seen >= self._before[1]:
            self.limit, self._before = self._before[0], None  # futile: undo it, and hold
            self._floor, self._floor_until = self.limit, now + self.hold_s
            self._settled_at = now
            return
        floor = self._floor if now < self._floor_until else self.min_seats
        if self.limit <= floor:
            return
        factor = min(self.decrease, max(0.5, self.target / seen))
        self._before = (self.limit, seen)
        self.limit = max(floor, self.min_seats, self.limit * factor)
        self._cut = True


class SaturationDetector:
    def __init__(self, max_seats: int, kv_high: float = 0.95, target_itl_ms: float | None = None,
                 itl_margin: float = 0.92, clock: Callable[[], float] = time.time,
                 itl_samples: Callable[[], Iterable[tuple[float, float]]] | None = None) -> None:
        self.max_seats = max_seats
        self.kv_high = kv_high
        self.itl = (ITLController(target_itl_ms, max_seats, margin=itl_margin, clock=clock, samples=itl_samples)
                    if target_itl_ms else None)

    def seat_limit(self, stats: EngineStats, running: int) -> int:
        return self.itl.update(stats, running) if self.itl else self.max_seats

    def has_headroom(self, stats: EngineStats, running: int) -> bool:
        if running >= self.seat_limit(stats, running):
            return False
        if running == 0:
            return True  # an idle engine always takes one, whatever stale stats say
        return stats.kv_usage < self.kv_high and stats.waiting == 0


class ThroughputEstimate:
    """Output tokens per second the engine delivers, for wait estimates (EWMA over busy time)."""

    def __init__(self, prior_tps: float, alpha: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self.tps = prior_tps
        self.alpha = alpha
        self.clock = clock
        self._t = clock()
        self._tokens = 0

    def observe(self, stats: EngineStats, busy: bool) -> None:
        now = self.clock()
        dt = now - self._t
        if dt < 0.5:
            return
        produced = stats.generated_tokens - self._tokens
        self._t, self._tokens = now, stats.generated_tokens
        if busy and produced > 0:
            self.tps = (1 - self.alpha) * self.tps + self.alpha * (produced / dt)
