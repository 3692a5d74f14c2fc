"""A step-time model fitted on the engine's own steps: how long a step takes with n sequences.

A decoding sequence gets one token per engine step, so its inter-token latency is about the
step time. Each step is taken as

    duration ≈ a + b·running + c·prefill_tokens

fitted by weighted least squares (Huber weights, so a stray slow step cannot drag the fit;
recent steps count more) over the last `window` steps. The intercept is pulled gently toward
the last one the data determined: while every step runs with about the same batch (a flood
that fills every seat), a and b cannot be told apart from the data, and the pull resolves
them. Until batch sizes have varied once (a cold start into a flood), there is no fit: a line
through the one batch size seen would have to guess the intercept, and a low guess lets too
many seats in when it extrapolates down; the controller runs plain AIMD until then, whose
first cut brings the second batch size.

On the most recent steps it then measures what the fit cannot know yet: the engine's `speed`
now (the median of duration over fitted time; 1.0 while the fit is current; above it when
another process takes the cores or contexts grew) and the steps' `noise` around the fit (a
robust sigma, relative). A decoding step's p95 time with n sequences is predicted as

    speed·(a + b·n)·(1 + 1.645·noise)

and `seats_for(aim)` is the largest n it lets meet the aim. A prefill adds c·P to the step it
lands in, and once more than 1 step in 20 carries one, a p95 gap is such a step. With the
seats full, sequences start as others end, so the share f of steps with a prefill grows with
n; past 5%, the prediction adds c·P, P the (1 - 0.05/f) quantile of the prefills seen (the p95
of all steps lies that far up among them). The share (per running sequence) and the prefills'
quantiles are taken over the whole window, decay-weighted, not the recent steps: a flood's
burst of prefills must not swing the seats. The controller's
AIMD on the clients' p95 corrects what remains between an engine step and a client's gap.

Pure: samples in (with their own time stamps), numbers out; no clock, no engine.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Protocol

from llmd.policy import wls

_Sample = tuple[float, int, int, float]  # (t, running, prefill tokens, duration s)


class StepSample(Protocol):
    """One engine step as the model reads it (llmd.backends.base.StepRecord satisfies it)."""

    @property
    def t(self) -> float:
        """When the step ended (any clock, used consistently)."""

    @property
    def running(self) -> int:
        """Sequences in the step."""

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the step computed (0: decode only)."""

    @property
    def duration(self) -> float:
        """Seconds the step took; 0 where unknown (such a step is not used)."""


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of already sorted values; 0.0 for none."""
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


@dataclass(init=False, unsafe_hash=True)
class StepFit:
    """One fit (coefficients in seconds), and what the recent steps say about now. Immutable;
    the __init__ written out (llmd.policy.placement.VersionLoad says why)."""

    a: Final[float]  # per step, whatever the batch
    b: Final[float]  # per sequence in the step
    c: Final[float]  # per prefill token
    speed: Final[float]  # recent steps' duration over the fit's prediction (median): 1.0 while the fit is current
    noise: Final[float]  # recent steps' relative spread around speed·(a + b·running + c·prefill) (robust sigma)
    samples: Final[int]  # steps the fit used
    prefill_sizes: Final[tuple[float, ...]]  # the window's prefills (steps with one): quantiles 1/20 .. 20/20
    prefill_share_per_seq: Final[float]  # the window's share of steps with a prefill, per running sequence
    arrivals_per_s: Final[float | None]  # new sequences per second lately (each brings a prefill); None: unknown

    # the slowest steps a p95 leaves out (a ClassVar: compiled with the written __init__, a plain
    # class attribute read through self was an unset instance attribute)
    P95_SHARE: ClassVar[float] = 0.05

    def __init__(self, a: float, b: float, c: float, speed: float, noise: float, samples: int,
                 prefill_sizes: tuple[float, ...] = (), prefill_share_per_seq: float = 0.0,
                 arrivals_per_s: float | None = None) -> None:
        self.a = a
        self.b = b
        self.c = c
        self.speed = speed
        self.noise = noise
        self.samples = samples
        self.prefill_sizes = prefill_sizes
        self.prefill_share_per_seq = prefill_share_per_seq
        self.arrivals_per_s = arrivals_per_s

    def with_arrivals(self, per_s: float | None) -> StepFit:
        """This fit, knowing how many new sequences arrive per second."""
        return StepFit(self.a, self.b, self.c, self.speed, self.noise, self.samples, self.prefill_sizes,
                       self.prefill_share_per_seq, per_s)

    def prefill_at(self, n: int) -> float:
        """Prompt tokens in a p95 step with `n` sequences: none while fewer than 1 step in 20
        carries a prefill; else, with a share f of steps carrying one, the (1 - 0.05/f)
        quantile of the prefills (the p95 of all steps is that far up among those). More seats
        bring more prefills per step only while they drain a backlog: never more than the
        arrivals bring, one each, so f is capped at arrivals per second times the step time."""
        f = self.prefill_share_per_seq * n
        if self.arrivals_per_s is not None:
            f = min(f, self.arrivals_per_s * self.speed * (self.a + self.b * n))
        if f <= self.P95_SHARE or not self.prefill_sizes:
            return 0.0
        q = 1.0 - self.P95_SHARE / min(f, 1.0)
        return self.prefill_sizes[min(len(self.prefill_sizes) - 1, max(0, math.ceil(q * len(self.prefill_sizes)) - 1))]

    def predict(self, n: int) -> float:
        """Predicted p95 time (seconds) of a step with `n` sequences, its prefill included."""
        return self.speed * (self.a + self.b * n + self.c * self.prefill_at(n)) * (1.0 + 1.645 * self.noise)

    def seats_for(self, aim: float, lo: int, hi: int) -> int:
        """The largest n in [lo, hi] whose predicted p95 step time meets `aim`. If not even `lo`
        meets it, fewer seats cannot buy the aim: the most whose step is within 10% of the
        fastest (`lo`'s), so a batch size that barely matters (a GPU's) is not cut for nothing."""
        aim = max(aim, 1.1 * self.predict(lo)) if self.predict(lo) > aim else aim
        if self.predict(hi) <= aim:
            return hi
        while hi - lo > 1:  # predict is nondecreasing in n; invariant: predict(hi) > aim
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.predict(mid) <= aim else (lo, mid)
        return lo


class StepWindow:
    """The last `maxlen` steps, kept as columns (time, running, prefill tokens, duration) of
    floats: a refit reads each column as one list copy, with no per-step unpacking or
    conversion (compiled, that was a fifth of the refit). Appends and iterates as (t, running,
    prefill tokens, duration) tuples."""

    def __init__(self, maxlen: int) -> None:
        self.t: deque[float] = deque(maxlen=maxlen)
        self.running: deque[float] = deque(maxlen=maxlen)
        self.prefill: deque[float] = deque(maxlen=maxlen)
        self.duration: deque[float] = deque(maxlen=maxlen)

    def __len__(self) -> int:
        return len(self.t)

    def __iter__(self) -> Iterator[_Sample]:
        for t, r, p, d in zip(self.t, self.running, self.prefill, self.duration, strict=True):
            yield t, int(r), int(p), d

    def add(self, t: float, running: int, prefill_tokens: int, duration: float) -> None:
        self.t.append(t)
        self.running.append(float(running))
        self.prefill.append(float(prefill_tokens))
        self.duration.append(duration)

    def append(self, s: _Sample) -> None:
        self.add(s[0], s[1], s[2], s[3])

    def extend(self, steps: Iterable[_Sample]) -> None:
        for s in steps:
            self.add(s[0], s[1], s[2], s[3])


class StepTimeModel:
    """The last `window` steps and the fit over them; `refresh` refits, `fit` only reads."""

    def __init__(self, window: int = 512, min_steps: int = 6, recent_s: float = 3.0, recent_min: int = 24,
                 half_life_s: float = 30.0, prior_weight: float = 0.01, irls_rounds: int = 4) -> None:
        self.window = StepWindow(window)
        self.min_steps = min_steps
        self.recent_s = recent_s
        self.recent_min = recent_min
        self.half_life_s = half_life_s
        self.prior_weight = prior_weight
        self.irls_rounds = irls_rounds
        self.a_prior = 0.0  # the last intercept the data determined (a spread of batch sizes)
        self.identified = False  # a spread of batch sizes was seen: a and b told apart once
        self.fit: StepFit | None = None
        self._last_t = -math.inf
        self._fresh = 0  # steps added since the last fit

    def observe(self, t: float, running: int, prefill_tokens: int, duration: float) -> None:
        if t <= self._last_t:
            return
        self._last_t = t
        if duration > 0 and running > 0:
            self.window.add(t, running, prefill_tokens, duration)  # per engine step: no tuple to unpack
            self._fresh += 1

    def ingest(self, steps: Sequence[StepSample]) -> int:
        """Take the steps newer than any seen (`steps` oldest first, as EngineStats.history keeps
        them); returns how many were new."""
        new: list[StepSample] = []
        for s in reversed(steps):
            if s.t <= self._last_t:
                break
            new.append(s)
        for s in reversed(new):
            self.observe(s.t, s.running, s.prefill_tokens, s.duration)
        return len(new)

    def refresh(self) -> StepFit | None:
        """Refit if steps arrived since the last fit (and enough are held); returns the fit."""
        if self._fresh and len(self.window) >= self.min_steps:
            self._fresh = 0
            self.fit = self._fit() or self.fit
        return self.fit

    def _fit(self) -> StepFit | None:
        win = self.window
        t, run, pre, dur = list(win.t), list(win.running), list(win.prefill), list(win.duration)
        n, last, half_life = len(t), t[-1], self.half_life_s
        decay = [math.pow(0.5, (last - ti) / half_life) for ti in t]  # C's pow, as 0.5 ** x: the same floats
        total = 0.0
        for d in decay:
            total += d
        coef: list[float] | None = None
        for _ in range(self.irls_rounds):
            # rounds after the first weigh by the previous round's fit (Huber); the last round's go unused
            mv, w_sum = wls.normal(run, pre, dur, decay, coef)
            coef = wls.least_squares(mv, (self.a_prior, self.prior_weight * w_sum))
            if coef is None:
                return None
        assert coef is not None
        a, b, c = coef
        mean_running = spread = 0.0
        for i in range(n):
            mean_running += decay[i] * run[i]
        mean_running /= total
        for i in range(n):
            dev = run[i] - mean_running
            spread += decay[i] * (dev * dev)  # as ** 2 (both the correctly rounded square), without the generic power
        if spread / total >= 4.0:  # batch sizes varied: a, b apart
            self.a_prior, self.identified = a, True
        elif not self.identified:
            return None  # one batch size, and no intercept seen yet: a and b are anyone's guess
        sizes, share = _prefills(pre, decay, total, mean_running)
        speed, noise = self._recent(a, b, c, t, run, pre, dur)
        return StepFit(a, b, c, speed, noise, len(t), sizes, share)

    def _recent(self, a: float, b: float, c: float, t: list[float], run: list[float], pre: list[float],
                dur: list[float]) -> tuple[float, float]:
        """Speed and noise over the steps of the last `recent_s` (at least `recent_min` steps)."""
        start = min(bisect_left(t, t[-1] - self.recent_s), max(0, len(t) - self.recent_min))
        ratios: list[float] = []
        for i in range(start, len(t)):
            fitted = a + b * run[i] + c * pre[i]
            if fitted > 0:
                ratios.append(dur[i] / fitted)
        ratios.sort()
        speed = wls.median(ratios) if ratios else 1.0
        spread = sorted([abs(x / speed - 1.0) for x in ratios])
        return speed, 1.4826 * wls.median(spread)


def _prefills(prefill: list[float], w: list[float], total: float,
              mean_running: float) -> tuple[tuple[float, ...], float]:
    """(the weighted quantiles 1/20 .. 20/20 of the steps' prefills, the weighted share of steps
    with one per running sequence); `w` the window's decay (nondecreasing, oldest step first),
    `total` its sum, `mean_running` the weighted batch size."""
    # By size, ties oldest first (so by weight: the decay grows with time), sorted as one float
    # each, size·n + index: exact for whole token counts, and it compares as (size, index) does
    # (compiled, sorting floats is several times faster than sorting (size, weight) tuples).
    n = len(prefill)
    keys = [prefill[i] * n + i for i in range(n) if prefill[i] > 0]
    if not keys or total <= 0:
        return (), 0.0
    keys.sort()
    acc: list[float] = []
    mass = 0.0
    for key in keys:
        mass += w[int(key) % n]
        acc.append(mass)
    last = len(keys) - 1
    # the first reaching k/20 of the weight, k = 1 .. 20
    sizes = tuple(prefill[int(keys[min(bisect_left(acc, mass * k / 20 - 1e-12), last)]) % n] for k in range(1, 21))
    return sizes, mass / total / mean_running if mean_running > 0 else 0.0
