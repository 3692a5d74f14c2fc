"""Pure arithmetic for serving cost: which version held a model's GPUs when, cut into time buckets.

The rule (docs/cost.md): a model's GPUs cost `gpus x gpu_hour_price` for every hour a node has
an engine of it loaded, busy or idle. Each loaded version is its own engine on the model's GPUs,
so at each instant that node's cost of the model is split equally between the versions it has
loaded then (two versions side by side: half each). A version's *share* below is those split
seconds; its *loaded* seconds are the wall-clock time its engine was up (for its idle fraction).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

Key = tuple[str, str, float]  # (model, version, bucket start)
MAX_BUCKETS = 20_000


@dataclass(frozen=True)
class Uptime:
    """One stretch of an engine's uptime on one node."""

    node: str
    model: str
    version: str
    start: float
    end: float


@dataclass
class Served:
    """Seconds in one bucket: the version's share of its model's GPUs, its engine's wall-clock uptime."""

    share_s: float = 0.0
    loaded_s: float = 0.0


def bucket_edges(since: float, until: float, bucket_s: float) -> list[float]:
    """since, the multiples of bucket_s (from the epoch: whole UTC hours, days) strictly between, until."""
    if bucket_s <= 0 or until < since:
        raise ValueError("need bucket_s > 0 and since <= until")
    first = math.floor(since / bucket_s) * bucket_s + bucket_s
    if (until - first) / bucket_s > MAX_BUCKETS:
        raise ValueError(f"more than {MAX_BUCKETS} buckets: choose a larger bucket or a shorter window")
    inner, t = [], first
    while t < until:
        inner.append(t)
        t += bucket_s
    return [since, *inner, until]


def bucket_of(t: float, bucket_s: float) -> float:
    return math.floor(t / bucket_s) * bucket_s


def served(stretches: Iterable[Uptime], since: float, until: float, bucket_s: float) -> dict[Key, Served]:
    """Share and loaded seconds per (model, version, bucket) within [since, until)."""
    by_engine: dict[tuple[str, str], list[Uptime]] = defaultdict(list)
    for u in stretches:
        if u.end > since and u.start < until and u.end > u.start:
            by_engine[(u.node, u.model)].append(u)
    out: dict[Key, Served] = defaultdict(Served)
    edges = bucket_edges(since, until, bucket_s)
    for (_, model), ups in by_engine.items():
        cuts = {max(since, min(until, t)) for u in ups for t in (u.start, u.end)}
        cuts.update(e for e in edges if min(u.start for u in ups) < e < max(u.end for u in ups))
        points = sorted(cuts)
        for a, b in itertools.pairwise(points):
            versions = {u.version for u in ups if u.start <= a and u.end >= b}
            for v in versions:
                s = out[(model, v, bucket_of(a, bucket_s))]
                s.share_s += (b - a) / len(versions)
                s.loaded_s += b - a
    return dict(out)


def spread(islands: Iterable[tuple[str, str, float, float]], since: float, until: float,
           bucket_s: float) -> dict[Key, float]:
    """Seconds per (model, version, bucket) covered by disjoint busy stretches (model, version, start, end)."""
    out: dict[Key, float] = defaultdict(float)
    for model, version, start, stop in islands:
        a, end = max(start, since), min(stop, until)
        while a < end:
            b = min(end, bucket_of(a, bucket_s) + bucket_s)
            out[(model, version, bucket_of(a, bucket_s))] += b - a
            a = b
    return dict(out)


def per_million(cost: float | None, tokens: int) -> float | None:
    """Cost per million tokens; None without a price or without tokens."""
    return None if cost is None or tokens <= 0 else cost / tokens * 1e6
