"""The summary statistics every benchmark reports, defined once so figures are comparable.

Percentiles: linear interpolation between closest ranks. For sorted values x[0..n-1], the
q-th percentile is at rank k = (n - 1) * q / 100, and is x[floor(k)] + (x[ceil(k)] -
x[floor(k)]) * (k - floor(k)). This is numpy.percentile's default ("linear") and
statistics.quantiles(method="inclusive"); vLLM's `bench serve` (bench/overhead.py) computes
its percentiles with numpy's default too, so its figures use the same definition. The median
is the 50th percentile (the mean of the two middle values for an even count). No values give
NaN rather than an exception: a run where nothing finished still prints a row.

Before this module, some scripts used nearest-rank percentiles (s[int(q * n)] or
s[ceil(q * n) - 1]); figures in docs/benchmarks.md older than it may differ by up to one
rank's gap at high percentiles of small samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

NAN = math.nan


def pct(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`, linear interpolation; NaN for none."""
    s = sorted(values)
    if not s:
        return NAN
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: Iterable[float]) -> float:
    """The 50th percentile; NaN for none."""
    return pct(values, 50)


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean; NaN for none."""
    v = list(values)
    return statistics.fmean(v) if v else NAN


def stdev(values: Iterable[float]) -> float:
    """Sample standard deviation (n - 1); NaN for fewer than two values."""
    v = list(values)
    return statistics.stdev(v) if len(v) > 1 else NAN


def stderr(values: Iterable[float]) -> float:
    """Standard error of the mean: stdev / sqrt(n); NaN for fewer than two values."""
    v = list(values)
    return stdev(v) / math.sqrt(len(v)) if len(v) > 1 else NAN
