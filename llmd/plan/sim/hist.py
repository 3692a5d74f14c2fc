"""Fixed-bin, log-spaced latency histograms: O(1) to record (weighted), percentiles to within a
bin's width (about 2.3 %), and the same bins on every run, so reports are deterministic."""

from __future__ import annotations

import math
from typing import Final

LO_S: Final = 1e-4  # the first bin's lower edge; anything faster counts there
PER_DECADE: Final = 100
DECADES: Final = 9  # 0.1 ms .. 100,000 s
NBINS: Final = PER_DECADE * DECADES
_SCALE: Final = PER_DECADE / math.log(10.0)
_LOG_LO: Final = math.log(LO_S)


def bin_of(x: float) -> int:
    if x <= LO_S:
        return 0
    return min(NBINS - 1, int((math.log(x) - _LOG_LO) * _SCALE))


def bin_mid(i: int) -> float:
    """The geometric middle of bin `i`: what a percentile landing in it reports."""
    return float(LO_S * 10.0 ** ((i + 0.5) / PER_DECADE))


class Hist:
    """Weighted counts per bin; `add(x, w)` records w samples of x seconds."""

    __slots__ = ("bins", "n", "total")

    def __init__(self) -> None:
        self.bins = [0.0] * NBINS
        self.n = 0.0
        self.total = 0.0  # sum of x·w, for the mean

    def add(self, x: float, w: float = 1.0) -> None:
        i = 0 if x <= LO_S else int((math.log(x) - _LOG_LO) * _SCALE)  # math.log: compiled, a C call
        self.bins[i if i < NBINS else NBINS - 1] += w
        self.n += w
        self.total += x * w

    def merge(self, other: Hist) -> None:
        b = self.bins
        for i, v in enumerate(other.bins):
            if v:
                b[i] += v
        self.n += other.n
        self.total += other.total

    def quantile(self, q: float) -> float | None:
        """The q-quantile (bin middle); None without samples."""
        if self.n <= 0:
            return None
        need, acc = q * self.n, 0.0
        for i, v in enumerate(self.bins):
            acc += v
            if acc >= need and v > 0:
                return bin_mid(i)
        return bin_mid(NBINS - 1)

    def summary(self) -> dict[str, float | None]:
        return {"p50": self.quantile(0.5), "p95": self.quantile(0.95), "p99": self.quantile(0.99),
                "mean": self.total / self.n if self.n > 0 else None, "count": self.n}


class ExactHist(Hist):
    """A Hist that keeps every sample too, and answers percentiles from them: the same lower
    weighted quantile without the bins. For runs small enough to hold their samples: the
    end-to-end check against llmd, whose tolerance (3 %) is about one bin, reads errors of a
    bin or two where the true difference is a fraction of one."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[tuple[float, float]] = []

    def add(self, x: float, w: float = 1.0) -> None:
        Hist.add(self, x, w)
        self.samples.append((x, w))

    def merge(self, other: Hist) -> None:
        if not isinstance(other, ExactHist):
            raise TypeError("an ExactHist merges only another ExactHist: a Hist has no samples")
        Hist.merge(self, other)
        self.samples += other.samples

    def quantile(self, q: float) -> float | None:
        """The q-quantile: the first sample, in order, at which the weight reaches q of it all."""
        if self.n <= 0:
            return None
        need, acc = q * self.n, 0.0
        ordered = sorted(self.samples)
        for x, w in ordered:
            acc += w
            if acc >= need and w > 0:
                return x
        return ordered[-1][0]
