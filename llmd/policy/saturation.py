"""Saturation detection: does the engine have headroom for one more sequence?

Kept apart from the scheduler (as in llm-d's flow control) so the signal can
change without touching queueing: the scheduler sees only the `Saturation`
protocol. Headroom means: fewer sequences running than the seat limit, KV cache
below its high-water mark, and the engine's own waiting queue empty, so that
*our* queue, not the engine's FCFS, decides the order. With a target
inter-token latency the seat limit adapts: sized from a step-time model fitted
on the engine's own steps (StepModelITL), with AIMD on the clients' p95 as the
fine correction; or, without the engine's steps or before enough are seen, by
AIMD alone (ITLController): it shrinks multiplicatively when p95 ITL exceeds
the aim and grows by one when the seats are full and latency has room. The
controller steps only in `update` (once per scheduler tick); reading the limit
never changes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from llmd.policy.signals import Clock, EngineSignals
from llmd.policy.steptime import StepFit, StepSample, StepTimeModel


class Saturation(Protocol):
    """A saturation detector, as the scheduler uses one."""

    max_seats: int  # the most sequences ever let in at once

    def update(self, signals: EngineSignals, running: int) -> None:
        """One control step with the current signals and sequences running; once per tick."""

    @property
    def seat_limit(self) -> int:
        """Sequences allowed to run now; a pure read."""

    def has_headroom(self, signals: EngineSignals, running: int) -> bool:
        """May one more sequence start, with `running` already in the engine?"""

    def blocked_on_capacity(self, signals: EngineSignals, running: int) -> bool:
        """No headroom because seats or KV are full (not because the engine's own queue is)."""

    def describe(self) -> dict[str, float | str | None] | None:
        """The ITL controller's state, for /admin/engines; None without one. A pure read."""


def p95(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


class ITLController:
    """AIMD on measured p95 inter-token latency.

    It steers on the gaps between a request's tokens as they reach the gateway (the service
    feeds them in): what clients see, a preempted request's wait included, of the interactive
    class only (a batch stream yields its seat by design; its waits are not the target's). vLLM's own ITL
    samples ran 10% under the clients' p95 in bench/fairness.py (c) and let the limit grow
    past the target. Clients add their read loop, so the controller aims at `margin` x target.
    A cut scales with the overshoot (never below half), so a limit far too high converges in
    a few windows, not dozens. A cut
    is judged only on latency measured after the previous cut took effect: running must
    have come down to the limit and a full window (6 s; half of one when p95 is over 1.25x
    the aim) must have passed, or one noisy window (a burst of prefills, say) would drive
    the limit down. Growth is judged on the same full window. A cut that did not lower
    p95 at all is undone and the limit held there for `hold_s`: when the stalls come from
    prefills, not from the batch, fewer seats only cost throughput (and preemptions).
    """

    def __init__(self, target_ms: float, max_seats: int, *, clock: Clock, min_seats: int = 1, window_s: float = 6.0,
                 interval_s: float = 0.5, decrease: float = 0.9, margin: float = 0.88, hold_s: float = 10.0,
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
        self.lag = 0.0  # judge only samples at least this old (seconds)

    @property
    def seat_limit(self) -> int:
        return int(self.limit)

    def update(self, signals: EngineSignals, running: float) -> None:
        """One AIMD step (at most every `interval_s`) on the samples of the last window."""
        now = self.clock()
        if self._cut and running <= self.limit:
            self._cut, self._settled_at = False, now
        if now < self._next:
            return
        self._next = now + self.interval_s
        self._on_interval(now)
        edge = now - self.lag  # later samples are left to a step model, which reacts first
        since = edge - self._settled_at
        full, short = self._windows(self.samples() if self.samples is not None else signals.itl, edge)
        if len(full) < 8:
            return
        self.last_p95 = p95(full)
        # Only a binding limit is to blame: while sequences ramp up (running well below it)
        # the stalls are prefills, and a cut would only be undone.
        binding = not self._cut and running >= 0.9 * self.limit
        if binding and since >= self.window_s / 2 and len(short) >= 8 and p95(short) > 1.25 * self.target:
            self._cut_or_undo(now, p95(short))  # far over: half a window is evidence enough
        elif self.last_p95 > self.target:
            if binding and since >= self.window_s:
                self._cut_or_undo(now, self.last_p95)
        else:
            self._before = None
            self._maybe_grow(now, running)

    def _windows(self, itl: Iterable[tuple[float, float]], edge: float) -> tuple[list[float], list[float]]:
        """The gaps of the whole window and of its later half (since the last settling, up to
        `edge`), in one pass over the samples."""
        lo = max(edge - self.window_s, self._settled_at)
        lo_short = max(edge - self.window_s / 2, self._settled_at)
        full: list[float] = []
        short: list[float] = []
        for t, x in itl:
            if lo <= t <= edge:
                full.append(x)
                if t >= lo_short:
                    short.append(x)
        return full, short

    def _on_interval(self, now: float) -> None:
        """Called once per interval before the samples are judged (a subclass's model step)."""

    def describe(self) -> dict[str, float | str | None]:
        return {"mode": "aimd", "aim_ms": self.target * 1000,
                "client_p95_ms": None if self.last_p95 is None else self.last_p95 * 1000}

    def _maybe_grow(self, now: float, running: float) -> None:
        """One more seat, judged on a whole window at the current limit. A cut needs the same
        window unless the overshoot is large: on a half window a few prefills more or less
        decide, and those kept cutting a limit whose p95 over 20 s was 25% under the target
        (bench/fairness.py (c): 16 seats, where 24 met it)."""
        if running < int(self.limit) or now - self.lag - self._settled_at < self.window_s:
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


class StepModelITL(ITLController):
    """The seat limit from a step-time model fitted on the engine's own steps (steptime.py): the
    largest seat count whose predicted p95 step time meets the engine aim, recomputed every
    interval, so a flood or a slower engine moves the limit within a second or two instead of
    window by window. The AIMD rules above, on the clients' p95 and on the same windows, then
    correct the engine aim, not the limit: clients also see our streaming path and preemption
    waits, on top of the engine's steps. A cut lowers the aim by the overshoot (at least one
    seat's worth), growth by the room under 0.9x the target (at most `increase`, at least
    a seat's worth), a futile cut is undone and held, and a cut fewer seats cannot deliver (by the
    model) is not taken. Growth by one seat's worth alone left
    a halved aim at one or two seats for minutes while clients read half the target: each seat
    it added sat on the fit's edge and the next refit took it back (bench/plan.py (c), 80 %).
    Until the model has seen enough steps (a cold start), plain AIMD on the limit."""

    def __init__(self, target_ms: float, max_seats: int, *, clock: Clock, steps: Callable[[], Sequence[StepSample]],
                 min_seats: int = 1, window_s: float = 6.0, interval_s: float = 0.5,
                 margin: float = 0.88, hold_s: float = 10.0, model: StepTimeModel | None = None, lag_s: float = 2.0,
                 samples: Callable[[], Iterable[tuple[float, float]]] | None = None, increase: float = 1.25,
                 arrivals: Callable[[], float | None] | None = None) -> None:
        super().__init__(target_ms, max_seats, min_seats=min_seats, window_s=window_s, interval_s=interval_s,
                         margin=margin, hold_s=hold_s, clock=clock, samples=samples)
        self.steps = steps
        self.model = model if model is not None else StepTimeModel()
        self.engine_aim: float | None = None  # the p95 step time seats are sized for; None: cold start
        self.lag_s = lag_s  # AIMD judges only client gaps this old: the model reacts to a change first
        self._proposed: int | None = None  # a small move of the limit, waiting for a second interval
        self.aim_floor = 0.25 * self.target
        self.increase = increase  # the most one growth multiplies the engine aim by
        self.withheld = 0  # cuts not taken: fewer seats could not have delivered them (shown in describe)
        self.arrivals = arrivals  # new sequences per second: more seats bring no more prefills than these

    def _on_interval(self, now: float) -> None:
        self.model.ingest(self.steps())
        fit = self.model.refresh()
        if fit is None:
            return
        if self.arrivals is not None:
            fit = self.model.fit = fit.with_arrivals(self.arrivals())
        takeover = self.engine_aim is None
        if takeover:  # the model takes over; AIMD's state was about seat counts
            self.engine_aim = self.target
            self._before, self._floor_until = None, 0.0
            self.lag = self.lag_s
        self._size(now, fit, at_once=takeover)

    def _size(self, now: float, fit: StepFit, at_once: bool = False) -> None:
        """The limit for the engine aim. A move of a seat or two must hold for two intervals (or
        come from AIMD): the fit's noise would otherwise flap a seat in and out, and each lowering
        preempts a sequence, whose resume costs a re-prefill."""
        assert self.engine_aim is not None
        n = fit.seats_for(self.engine_aim, self.min_seats, self.max_seats)
        small = n != self.limit and abs(n - self.limit) <= max(2.0, 0.05 * self.limit)
        if small and not at_once and self._proposed != n:
            self._proposed = n
            return
        self._proposed = None
        if n != self.limit:
            self._settled_at = now  # AIMD judges latency at the new limit only
            self._cut = self._cut or n < 0.9 * self.limit  # and once running came down to it
        self.limit = float(n)

    def _cut_or_undo(self, now: float, seen: float) -> None:
        fit = self.model.fit
        if self.engine_aim is None or fit is None:
            return super()._cut_or_undo(now, seen)
        if self._before is not None and seen >= self._before[1]:
            if now - self.lag - self._settled_at < self.window_s:
                return None  # judged on a whole window: right after a cut, the preempted re-prefill
            self.engine_aim, self._before = self._before[0], None  # futile: undo it, and hold
            self._floor, self._floor_until = self.engine_aim, now + self.hold_s
            self._settled_at = now
            return self._size(now, fit, at_once=True)
        floor = max(self.aim_floor, self._floor if now < self._floor_until else 0.0)
        if self.engine_aim <= floor or self.limit <= self.min_seats:
            return None
        if not self._seats_can_reach(fit, seen):
            self.withheld += 1
            return None
        aim = max(floor, self.engine_aim * min(self.decrease, max(0.5, self.target / seen)))
        if fit.seats_for(aim, self.min_seats, self.max_seats) >= self.limit:  # at least one seat
            aim = max(floor, self._one_seat_fewer(fit, aim, self.engine_aim))
        self._before, self.engine_aim = (self.engine_aim, seen), aim
        self._size(now, fit, at_once=True)
        self._cut = True
        return None

    def _seats_can_reach(self, fit: StepFit, seen: float) -> bool:
        """Could fewer seats bring the clients' p95 (`seen`) to the aim? By the model, seats add
        predict(limit) - predict(min_seats) to a step; the rest of what clients see (a long prompt's
        prefill in the step, our streaming path) stays whatever the batch. Where that rest alone is
        over the aim, a cut only queues requests: bench/plan.py (c), the real engine at 50 %, cut
        3 seats to 1 on a burst of prefill stalls (the model's gain: 7 ms), and 3-7 chat
        requests queued for 16 s while their clients' p95 read 68 ms. A pure read."""
        return seen - (fit.predict(int(self.limit)) - fit.predict(self.min_seats)) <= self.target

    def _one_seat_fewer(self, fit: StepFit, aim: float, old: float) -> float:
        """An aim that seats one fewer than now: in the band [predict(limit - 1), predict(limit)),
        at its geometric middle or at half the old aim (a cut's bound), whichever is higher, not
        at its bottom. Where a prefill enters the p95 step at the limit, the band's bottom is a
        decode step's time: taking it sank the aim 3.5x for one seat (231 -> 65 ms, bench/plan.py
        (c), the real engine at 70 %), and the seats then stayed at 2-3 for a minute while growth
        rebuilt it window by window."""
        lo, hi = fit.predict(int(self.limit) - 1), fit.predict(int(self.limit))
        if hi <= lo * 1.001:  # no band to choose in
            return min(aim, lo)
        inside = max(math.sqrt(lo * hi), 0.5 * old)
        # 2 % under the top: the next refit's noise must not give the seat straight back
        return min(aim, max(lo, min(0.98 * hi, inside)))

    def _maybe_grow(self, now: float, running: float) -> None:
        fit = self.model.fit
        if self.engine_aim is None or fit is None:
            return super()._maybe_grow(now, running)
        judged = now - self.lag - self._settled_at >= self.window_s
        if running < int(self.limit) or not judged or self.limit >= self.max_seats:
            return None
        assert self.last_p95 is not None
        if self.last_p95 < 0.9 * self.target:
            scaled = min(self.target, self.engine_aim * min(self.increase, 0.9 * self.target / self.last_p95))
            self.engine_aim = max(self.engine_aim, scaled, fit.predict(int(self.limit) + 1))  # a seat at least
            self._size(now, fit, at_once=True)
            self._settled_at = now
        return None

    def describe(self) -> dict[str, float | str | None]:
        fit = self.model.fit
        if self.engine_aim is None or fit is None:
            return super().describe() | {"mode": "aimd (cold start: the step model has too few steps)"}
        return super().describe() | {
            "mode": "step model", "engine_aim_ms": self.engine_aim * 1000, "a_ms": fit.a * 1000,
            "b_ms_per_seq": fit.b * 1000, "c_ms_per_1k_prefill": fit.c * 1e6, "speed": fit.speed,
            "predicted_p95_ms": fit.predict(self.seat_limit) * 1000, "steps_fitted": fit.samples,
            "prefill_in_p95_tokens": fit.prefill_at(self.seat_limit), "cuts_withheld": self.withheld}


class SaturationDetector:
    """Seats (fixed, or adapted by the ITL controller), KV high-water mark, engine queue.
    With a target ITL and the engine's steps (`steps`), the step-time model sizes the seats."""

    def __init__(self, max_seats: int, *, clock: Clock, kv_high: float = 0.95, target_itl_ms: float | None = None,
                 itl_margin: float = 0.88,
                 itl_samples: Callable[[], Iterable[tuple[float, float]]] | None = None,
                 steps: Callable[[], Sequence[StepSample]] | None = None,
                 arrivals: Callable[[], float | None] | None = None) -> None:
        self.max_seats = max_seats
        self.kv_high = kv_high
        self.itl: ITLController | None = None
        if target_itl_ms and steps is not None:
            self.itl = StepModelITL(target_itl_ms, max_seats, margin=itl_margin, clock=clock, steps=steps,
                                    samples=itl_samples, arrivals=arrivals)
        elif target_itl_ms:
            self.itl = ITLController(target_itl_ms, max_seats, margin=itl_margin, clock=clock, samples=itl_samples)

    def describe(self) -> dict[str, float | str | None] | None:
        """The ITL controller's state for /admin/engines; None without a target."""
        return self.itl.describe() if self.itl is not None else None

    def update(self, signals: EngineSignals, running: int) -> None:
        if self.itl is not None:
            self.itl.update(signals, running)

    @property
    def seat_limit(self) -> int:
        return self.itl.seat_limit if self.itl is not None else self.max_seats

    def has_headroom(self, signals: EngineSignals, running: int) -> bool:
        if running >= self.seat_limit:
            return False
        if running == 0:
            return True  # an idle engine always takes one, whatever stale stats say
        return signals.kv_usage < self.kv_high and signals.waiting == 0

    def blocked_on_capacity(self, signals: EngineSignals, running: int) -> bool:
        # Preempting for a waiting request helps only then: the engine's own queue drains
        # by itself within a step.
        full = running >= self.seat_limit or signals.kv_usage >= self.kv_high
        return full and not self.has_headroom(signals, running)


class ThroughputEstimate:
    """Output tokens per second the engine delivers, for wait estimates (EWMA over busy time)."""

    def __init__(self, prior_tps: float, *, clock: Clock, alpha: float = 0.2) -> None:
        self.tps = prior_tps
        self.alpha = alpha
        self.clock = clock
        self._t = clock()
        self._tokens = 0

    def observe(self, signals: EngineSignals, busy: bool) -> None:
        now = self.clock()
        dt = now - self._t
        if dt < 0.5:
            return
        produced = signals.generated_tokens - self._tokens
        self._t, self._tokens = now, signals.generated_tokens
        if busy and produced > 0:
            self.tps = (1 - self.alpha) * self.tps + self.alpha * (produced / dt)
