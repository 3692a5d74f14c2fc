"""One /metrics scrape, parsed once, summed over the labels a view does not show."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, ...]


@dataclass
class Scrape:
    """Samples by name: (labels, value) pairs, as the exposition text had them."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name].append((dict(s.labels), float(s.value)))
        return cls(dict(out))

    def total(self, name: str, by: tuple[str, ...]) -> dict[Key, float]:
        """Sum of `name` per combination of the `by` labels (the others summed away)."""
        out: dict[Key, float] = defaultdict(float)
        for labels, value in self.samples.get(name, ()):
            out[tuple(labels.get(k, "") for k in by)] += value
        return dict(out)

    def buckets(self, name: str, by: tuple[str, ...]) -> dict[Key, dict[float, float]]:
        """A histogram's cumulative bucket counts (upper bound -> count) per `by` labels."""
        out: dict[Key, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        for labels, value in self.samples.get(f"{name}_bucket", ()):
            le = float(labels["le"]) if labels.get("le") not in (None, "+Inf") else math.inf
            out[tuple(labels.get(k, "") for k in by)][le] += value
        return {k: dict(v) for k, v in out.items()}


def minus(cur: dict[float, float], prev: dict[float, float] | None) -> dict[float, float]:
    """Bucket counts observed between two scrapes (a counter that went down: the node restarted)."""
    if prev is None or any(cur.get(le, 0.0) < n for le, n in prev.items()):
        return dict(cur)
    return {le: n - prev.get(le, 0.0) for le, n in cur.items()}


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in; None without
    observations; the largest finite bound when the rank falls in +Inf."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, buckets[bounds[-1]] if bounds else 0.0)
    if not bounds or total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = (le if not math.isinf(le) else lower), count
    return lower
