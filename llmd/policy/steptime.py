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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

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


@dataclass(frozen=True)
class StepFit:
    """One fit (coefficients in seconds), and what the recent steps say about now."""

    a: float  # per step, whatever the batch
    b: float  # per sequence in the step
    c: float  # per prefill token
    speed: float  # recent steps' duration over the fit's prediction (median): 1.0 while the fit is current
    noise: float  # recent steps' relative spread around speed·(a + b·running + c·prefill) (robust sigma)
    samples: int  # steps the fit used
    prefill_sizes: tuple[float, ...] = ()  # the window's prefills (steps with one): quantiles 1/20 .. 20/20
    prefill_share_per_seq: float = 0.0  # the window's share of steps with a prefill, per running sequence

    P95_SHARE = 0.05  # the slowest steps a p95 leaves out

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


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if (nearly) singular. `m` is scaled to a
    unit diagonal by the caller, so one absolute threshold fits every problem."""
    k = len(v)
    m = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-9:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for j in range(col, k + 1):
                m[r][j] -= f * m[col][j]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (m[r][k] - sum(m[r][j] * x[j] for j in range(r + 1, k))) / m[r][r]
    return x


def _normal(samples: Sequence[_Sample], w: Sequence[float]) -> tuple[list[list[float]], list[float]]:
    """The weighted normal equations over the columns (1, running, prefill)."""
    s = [0.0] * 9  # 1, r, p, rr, rp, pp, y, ry, py
    for (_, r, p, y), wi in zip(samples, w, strict=True):
        wr, wp = wi * r, wi * p
        s[0] += wi
        s[1] += wr
        s[2] += wp
        s[3] += wr * r
        s[4] += wr * p
        s[5] += wp * p
        s[6] += wi * y
        s[7] += wr * y
        s[8] += wp * y
    return [[s[0], s[1], s[2]], [s[1], s[3], s[4]], [s[2], s[4], s[5]]], [s[6], s[7], s[8]]


def _least_squares(m: list[list[float]], v: list[float], prior: tuple[float, float]) -> list[float] | None:
    """Nonnegative (a, b, c) from the normal equations, the intercept pulled toward prior[0]
    with weight prior[1]: a negative coefficient is dropped (held at 0) and the rest refitted."""
    cols = [i for i in range(3) if m[i][i] > 0]
    while cols:
        sub = [[m[i][j] for j in cols] for i in cols]
        rhs = [v[i] for i in cols]
        if 0 in cols:
            sub[0][0] += prior[1]
            rhs[0] += prior[1] * prior[0]
        d = [math.sqrt(sub[i][i]) for i in range(len(cols))]
        x = _solve([[sub[i][j] / (d[i] * d[j]) for j in range(len(cols))] for i in range(len(cols))],
                   [rhs[i] / d[i] for i in range(len(cols))])
        if x is None:
            cols.pop()  # prefill, then running, whichever the data cannot separate
            continue
        coef = dict(zip(cols, (xi / di for xi, di in zip(x, d, strict=True)), strict=True))
        negative = [i for i in (2, 1, 0) if i in coef and coef[i] < 0]
        if not negative:
            return [coef.get(i, 0.0) for i in range(3)]
        cols.remove(negative[0])
    return None


class StepTimeModel:
    """The last `window` steps and the fit over them; `refresh` refits, `fit` only reads."""

    def __init__(self, window: int = 512, min_steps: int = 6, recent_s: float = 3.0, recent_min: int = 24,
                 half_life_s: float = 30.0, prior_weight: float = 0.01, irls_rounds: int = 4) -> None:
        self.window: deque[_Sample] = deque(maxlen=window)
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
            self.window.append((t, running, prefill_tokens, duration))
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
        samples = list(self.window)
        newest = samples[-1][0]
        decay = [0.5 ** ((newest - s[0]) / self.half_life_s) for s in samples]
        w = decay
        coef: list[float] | None = None
        for _ in range(self.irls_rounds):
            m, v = _normal(samples, w)
            coef = _least_squares(m, v, (self.a_prior, self.prior_weight * sum(w)))
            if coef is None:
                return None
            w = _huber(samples, coef, decay)
        assert coef is not None
        a, b, c = coef
        if _spread(samples, decay) >= 4.0:
            self.a_prior, self.identified = a, True
        elif not self.identified:
            return None  # one batch size, and no intercept seen yet: a and b are anyone's guess
        sizes, share = _prefills(samples, decay)
        return replace(self._recent(a, b, c, samples), prefill_sizes=sizes, prefill_share_per_seq=share)

    def _recent(self, a: float, b: float, c: float, samples: list[_Sample]) -> StepFit:
        newest = samples[-1][0]
        recent = [s for s in samples if s[0] >= newest - self.recent_s] or samples
        if len(recent) < self.recent_min:
            recent = samples[-self.recent_min:]
        ratios = sorted(y / fitted for _, r, p, y in recent if (fitted := a + b * r + c * p) > 0)
        speed = quantile(ratios, 0.5) if ratios else 1.0
        spread = sorted(abs(x / speed - 1.0) for x in ratios)
        return StepFit(a, b, c, speed, 1.4826 * quantile(spread, 0.5), len(samples))


def _huber(samples: Sequence[_Sample], coef: Sequence[float], decay: Sequence[float]) -> list[float]:
    """Huber weights (k = 1.345 robust sigmas, sigma from the median absolute residual) times decay."""
    a, b, c = coef
    res = [y - (a + b * r + c * p) for _, r, p, y in samples]
    scale = 1.4826 * quantile(sorted(abs(x) for x in res), 0.5)
    if scale <= 0:
        return list(decay)
    k = 1.345 * scale
    return [d if abs(x) <= k else d * k / abs(x) for x, d in zip(res, decay, strict=True)]


def _prefills(samples: Sequence[_Sample], w: Sequence[float]) -> tuple[tuple[float, ...], float]:
    """(the weighted quantiles 1/20 .. 20/20 of the steps' prefills, the weighted share of steps
    with one per running sequence)."""
    total = sum(w)
    with_prefill = sorted((s[2], wi) for s, wi in zip(samples, w, strict=True) if s[2] > 0)
    if not with_prefill or total <= 0:
        return (), 0.0
    mass = sum(wi for _, wi in with_prefill)
    sizes, acc, k = [], 0.0, 1
    for p, wi in with_prefill:
        acc += wi
        while k <= 20 and acc >= mass * k / 20 - 1e-12:
            sizes.append(float(p))
            k += 1
    sizes += [float(with_prefill[-1][0])] * (20 - len(sizes))
    running = sum(wi * s[1] for s, wi in zip(samples, w, strict=True)) / total
    return tuple(sizes), mass / total / running if running > 0 else 0.0


def _spread(samples: Sequence[_Sample], w: Sequence[float]) -> float:
    """Weighted variance of the batch size: how well the data alone separates a from b."""
    total = sum(w)
    mean = sum(wi * s[1] for s, wi in zip(samples, w, strict=True)) / total
    return sum(wi * (s[1] - mean) ** 2 for s, wi in zip(samples, w, strict=True)) / total
