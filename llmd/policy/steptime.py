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

    def __init__(self, a: float, b: float, c: float, speed: float, noise: float, samples: int,
                 prefill_sizes: tuple[float, ...] = (), prefill_share_per_seq: float = 0.0) -> None:
        self.a = a
        self.b = b
        self.c = c
        self.speed = speed
        self.noise = noise
        self.samples = samples
        self.prefill_sizes = prefill_sizes
        self.prefill_share_per_seq = prefill_share_per_seq

    P95_SHARE: ClassVar[float] = 0.05  # the slowest steps a p95 leaves out

    def prefill_at(self, n: int) -> float:
        """Prompt tokens in a p95 step with `n` sequences: none while fewer than 1 step in 20
        carries a prefill; else, with a share f of steps carrying one, the (1 - 0.05/f)
        quantile of the prefills (the p95 of all steps is that far up among those)."""
        f = self.prefill_share_per_seq * n
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


def _solve(m: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on an augmented matrix [A | v] (changed in
    place); None if (nearly) singular. A is scaled to a unit diagonal by the caller, so one
    absolute threshold fits every problem. (A hot path: a refit solves it 4 times a replica
    every half second; the entries below the diagonal are left as they are, never read again.)"""
    k = len(m)
    if k == 3:
        (a00, a01, a02, v0), (a10, a11, a12, v1), (a20, a21, a22, v2) = m
        x3 = _solve3(a00, a01, a02, v0, a10, a11, a12, v1, a20, a21, a22, v2)
        return None if x3 is None else list(x3)
    for col in range(k):
        piv, top = col, abs(m[col][col])  # the first row with the largest |pivot|
        for r in range(col + 1, k):
            if (a := abs(m[r][col])) > top:
                piv, top = r, a
        if top < 1e-9:
            return None
        m[col], m[piv] = m[piv], m[col]
        pivot_row = m[col]
        p = pivot_row[col]
        for r in range(col + 1, k):
            row = m[r]
            f = row[col] / p
            for j in range(col + 1, k + 1):
                row[j] -= f * pivot_row[j]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        row = m[r]
        x[r] = (row[k] - sum([row[j] * x[j] for j in range(r + 1, k)])) / row[r]
    return x


def _solve3(a00: float, a01: float, a02: float, v0: float, a10: float, a11: float, a12: float, v1: float,
            a20: float, a21: float, a22: float, v2: float) -> tuple[float, float, float] | None:
    """`_solve` of three unknowns (the refit's usual case), unrolled on the rows [a_i0 a_i1 a_i2 |
    v_i]: the same operations on the same values in the same order, so the same floats (the back
    substitution's sums start from 0.0 as `sum` does), without lists or loops."""
    top, piv = abs(a00), 0
    if abs(a10) > top:
        top, piv = abs(a10), 1
    if abs(a20) > top:
        top, piv = abs(a20), 2
    if top < 1e-9:
        return None
    if piv == 1:
        a00, a01, a02, v0, a10, a11, a12, v1 = a10, a11, a12, v1, a00, a01, a02, v0
    elif piv == 2:
        a00, a01, a02, v0, a20, a21, a22, v2 = a20, a21, a22, v2, a00, a01, a02, v0
    p = a00
    f = a10 / p
    b11, b12, b13 = a11 - f * a01, a12 - f * a02, v1 - f * v0
    f = a20 / p
    b21, b22, b23 = a21 - f * a01, a22 - f * a02, v2 - f * v0
    top = abs(b11)
    if abs(b21) > top:
        top = abs(b21)
        b11, b12, b13, b21, b22, b23 = b21, b22, b23, b11, b12, b13
    if top < 1e-9:
        return None
    f = b21 / b11
    c22, c23 = b22 - f * b12, b23 - f * b13
    if abs(c22) < 1e-9:
        return None
    x2 = c23 / c22
    x1 = (b13 - (0.0 + b12 * x2)) / b11
    x0 = (v0 - (0.0 + a01 * x1 + a02 * x2)) / p
    return x0, x1, x2


def _normal(run: list[float], pre: list[float], dur: list[float], decay: list[float],
            coef: list[float] | None) -> tuple[list[list[float]], float]:
    """The weighted normal equations over the rows (1, running, prefill) against the durations,
    row i = [M_i0, M_i1, M_i2 | v_i], and the weights' sum, in one pass. The weights are the
    decay, times Huber's (k = 1.345 robust sigmas, sigma from the median absolute residual) of
    the fit `coef` where one is given. The refit is loops, not numpy: compiled
    (llmd/plan/compiled.py) they run at C's speed, where numpy's per-call cost over the
    simulator's 64-step windows was a third of a seed-scale simulation. As Python, over llmd's
    own 512-step window, a refit costs about 1 ms every 0.5 s (numpy's: 0.2 ms; bench/plan.py (b))."""
    a, b, c = coef if coef is not None else (0.0, 0.0, 0.0)
    k = 0.0  # no Huber weights
    if coef is not None:
        res = [abs(dur[i] - (a + b * run[i] + c * pre[i])) for i in range(len(dur))]
        res.sort()
        k = 1.345 * (1.4826 * _median(res))
    s0 = s1 = s2 = s11 = s12 = s22 = v0 = v1 = v2 = w_sum = 0.0
    for i in range(len(decay)):
        r, p, d = run[i], pre[i], dur[i]
        wi = decay[i]
        if k > 0:
            x = abs(d - (a + b * r + c * p))  # the residual as the median saw it
            wi = wi * (k / (x if x > k else k))  # k/k = 1 within k
        w_sum += wi
        wr, wp = wi * r, wi * p
        s0 += wi
        s1 += wr
        s2 += wp
        s11 += wr * r
        s12 += wr * p
        s22 += wp * p
        v0 += wi * d
        v1 += wr * d
        v2 += wp * d
    return [[s0, s1, s2, v0], [s1, s11, s12, v1], [s2, s12, s22, v2]], w_sum


def _least_squares(mv: list[list[float]], prior: tuple[float, float]) -> list[float] | None:
    """Nonnegative (a, b, c) from the normal equations (rows [M_i | v_i]), the intercept pulled
    toward prior[0] with weight prior[1]: a negative coefficient is dropped (held at 0) and the
    rest refitted."""
    pull, pull_to = prior[1], prior[1] * prior[0]
    if (coef3 := _least_squares3(mv, pull, pull_to)) is not None:
        return coef3
    cols = [i for i in range(3) if mv[i][i] > 0]
    while cols:
        d = [math.sqrt(mv[i][i]) for i in cols]
        if cols[0] == 0:
            d[0] = math.sqrt(mv[0][0] + pull)
        aug = [[row[j] / (di * dj) for j, dj in zip(cols, d, strict=True)] + [row[3] / di]
               for row, di in zip([mv[i] for i in cols], d, strict=True)]
        if cols[0] == 0:  # the pull, on the intercept's diagonal and right-hand side
            aug[0][0], aug[0][-1] = (mv[0][0] + pull) / (d[0] * d[0]), (mv[0][3] + pull_to) / d[0]
        x = _solve(aug)
        if x is None:
            cols.pop()  # prefill, then running, whichever the data cannot separate
            continue
        coef = [0.0, 0.0, 0.0]
        for i, xi, di in zip(cols, x, d, strict=True):
            coef[i] = xi / di
        if coef[0] >= 0 and coef[1] >= 0 and coef[2] >= 0:
            return coef
        cols.remove(next(i for i in (2, 1, 0) if coef[i] < 0))  # a dropped one is 0.0: not negative
    return None


def _least_squares3(mv: list[list[float]], pull: float, pull_to: float) -> list[float] | None:
    """`_least_squares`' first round when all three columns have data and the solution is
    nonnegative (the usual case), on locals: the same operations in the same order, so the same
    floats; None otherwise, and `_least_squares` takes the general path (and repeats this round)."""
    r0, r1, r2 = mv[0], mv[1], mv[2]
    m00, m11, m22 = r0[0], r1[1], r2[2]
    if not (m00 > 0 and m11 > 0 and m22 > 0):
        return None
    d0, d1, d2 = math.sqrt(m00 + pull), math.sqrt(m11), math.sqrt(m22)
    x = _solve3((m00 + pull) / (d0 * d0), r0[1] / (d0 * d1), r0[2] / (d0 * d2), (r0[3] + pull_to) / d0,
                r1[0] / (d1 * d0), m11 / (d1 * d1), r1[2] / (d1 * d2), r1[3] / d1,
                r2[0] / (d2 * d0), r2[1] / (d2 * d1), m22 / (d2 * d2), r2[3] / d2)
    if x is None:
        return None
    a, b, c = x[0] / d0, x[1] / d1, x[2] / d2
    return [a, b, c] if a >= 0 and b >= 0 and c >= 0 else None


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
            mv, w_sum = _normal(run, pre, dur, decay, coef)
            coef = _least_squares(mv, (self.a_prior, self.prior_weight * w_sum))
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
        speed = _median(ratios) if ratios else 1.0
        spread = sorted([abs(x / speed - 1.0) for x in ratios])
        return speed, 1.4826 * _median(spread)


def _median(sorted_values: list[float]) -> float:
    """`quantile(sorted_values, 0.5)`."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(0.5 * n) - 1))] if n else 0.0


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
