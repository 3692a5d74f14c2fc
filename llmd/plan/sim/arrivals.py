"""When requests arrive: a rate over time and a burstiness, drawn by time rescaling.

A renewal process of rate 1 (inter-arrival gaps with mean 1 and coefficient of variation `cv`:
exponential at cv = 1, i.e. Poisson; gamma with shape 1/cv² otherwise; evenly spaced at cv = 0)
is drawn in "expected-arrivals" time s, then mapped to wall time through the inverse of the
cumulative rate Λ(t) = ∫λ. So every profile gets every burstiness: a diurnal day with gamma
bursts is one draw, and an arbitrary λ(t) (a replayed ledger's, say) only needs its Λ.
Equivalent to thinning for Poisson, but without discarding draws, and it keeps the CV of a
non-Poisson process (thinning would smooth bursts toward Poisson).

    constant   λ(t) = rate                                     (Poisson unless cv is given)
    bursty     λ(t) = rate, gaps gamma with CV `cv` (default 3): bursts and lulls, same mean
    diurnal    λ(t) = rate · (1 − amplitude · (1 − cos 2π(t − peak_at)/period) / 2)
               rate is the peak, rate · (1 − amplitude) the trough; period defaults to the
               duration (one cycle: a day, or an hour's ramp up and down), peak_at to the
               middle of the first period
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from llmd.plan.errors import PlanError

PROFILES = ("constant", "bursty", "diurnal")
BURSTY_CV = 3.0
MAX_EXPECTED = 50_000_000  # arrivals; beyond it a workload is a typo, not a plan
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Arrivals:
    """An arrival process over [0, duration) seconds."""

    profile: str = "constant"
    rate: float = 1.0  # req/s: the mean (constant, bursty) or the peak (diurnal)
    duration: float = 3600.0
    cv: float | None = None  # inter-arrival CV; None: 1 (Poisson), or BURSTY_CV for bursty
    amplitude: float = 0.5  # diurnal: 1 − trough/peak
    period: float | None = None  # diurnal: seconds per cycle (None: the duration)
    peak_at: float | None = None  # diurnal: seconds of the peak (None: half a period)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise PlanError(f"unknown arrival profile {self.profile!r}; expected one of {', '.join(PROFILES)}")
        for name, v, ok in (("rate", self.rate, self.rate > 0), ("duration", self.duration, self.duration > 0),
                            ("cv", self.cv, self.cv is None or 0 <= self.cv <= 20),
                            ("amplitude", self.amplitude, 0 <= self.amplitude < 1),
                            ("period", self.period, self.period is None or self.period > 0)):
            if not ok or (isinstance(v, float) and not math.isfinite(v)):
                raise PlanError(f"arrivals: {name} = {v} is out of range (rate, duration, period > 0; "
                                f"0 ≤ cv ≤ 20; 0 ≤ amplitude < 1)")
        if self.expected() > MAX_EXPECTED:
            raise PlanError(f"arrivals: {self.expected():,.0f} expected requests; at most {MAX_EXPECTED:,}")

    @property
    def gap_cv(self) -> float:
        return self.cv if self.cv is not None else (BURSTY_CV if self.profile == "bursty" else 1.0)

    def rate_at(self, t: F64) -> F64:
        """λ(t), requests per second."""
        if self.profile != "diurnal":
            return np.full_like(t, self.rate)
        p, peak = self._cycle()
        out: F64 = self.rate * (1 - self.amplitude * (1 - np.cos(2 * np.pi * (t - peak) / p)) / 2)
        return out

    def cumulative(self, t: F64) -> F64:
        """Λ(t) = ∫₀ᵗ λ: how many arrivals are expected by t."""
        if self.profile != "diurnal":
            return self.rate * t
        p, peak = self._cycle()
        w = 2 * np.pi / p
        osc = (np.sin(w * (t - peak)) + np.sin(w * peak)) / w  # ∫₀ᵗ cos w(u − peak) du
        out: F64 = self.rate * ((1 - self.amplitude / 2) * t + self.amplitude / 2 * osc)
        return out

    def expected(self) -> float:
        return float(self.cumulative(np.array([self.duration]))[0])

    def _cycle(self) -> tuple[float, float]:
        p = self.period if self.period is not None else self.duration
        return p, self.peak_at if self.peak_at is not None else p / 2

    def sample(self, rng: np.random.Generator) -> F64:
        """Arrival times in [0, duration), sorted."""
        s = _unit_renewal(rng, self.expected(), self.gap_cv)
        if self.profile != "diurnal":
            return s / self.rate
        # Λ is smooth and increasing: invert it on a grid fine enough (≤ 1 s, ≥ 4,096 points)
        # that piecewise-linear interpolation is exact to well under a gap at any realistic rate.
        n = int(min(max(4096, math.ceil(self.duration)), 2_000_000)) + 1
        grid = np.linspace(0.0, self.duration, n)
        out: F64 = np.interp(s, self.cumulative(grid), grid)
        return out


def _unit_renewal(rng: np.random.Generator, horizon: float, cv: float) -> F64:
    """Points of a rate-1 renewal process (gap mean 1, CV `cv`) in [0, horizon)."""
    chunks: list[F64] = []
    start, first = 0.0, rng.uniform(0.0, 1.0)  # a random phase, so cv = 0 is not locked to t = 0
    while start < horizon:
        n = int(horizon - start + 8 * max(cv, 1.0) * math.sqrt(horizon - start + 1) + 16)
        if cv == 0:
            gaps = np.ones(n)
        elif cv == 1:
            gaps = rng.exponential(1.0, n)
        else:
            k = 1.0 / (cv * cv)
            gaps = rng.gamma(k, 1.0 / k, n)
        if not chunks:
            gaps[0] = first * gaps[0] if cv != 0 else first
        pts = start + np.cumsum(gaps)
        chunks.append(pts)
        start = float(pts[-1])
    s = np.concatenate(chunks) if chunks else np.empty(0)
    out: F64 = s[: int(np.searchsorted(s, horizon))]
    return out
