"""Figures of whole buckets no request can change any more, kept between reports.

A bucket's usage figures are final once every request that arrived in it has ended: the
bucket ended more than `reach_s` (the longest a request can live: its deadline) ago. A node
polled every couple of seconds for the last day's cost (the dashboard, `llmd top`) then reads
only its last few buckets from SQLite, not the whole day again (docs/cost.md)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
MAX_ENTRIES = 50_000  # buckets kept (per kind and size); past it the cache starts afresh


class Settled:
    def __init__(self) -> None:
        self._kept: dict[tuple[str, float, float], Any] = {}
        self._lock = threading.Lock()  # reports run in threads: one at a time fills and reads it

    def figures(self, kind: str, since: float, until: float, bucket_s: float, settled_before: float,
                compute: Callable[[float, float], dict[float, T]], empty: Callable[[], T]) -> dict[float, T]:
        """compute(since, until) per bucket start, with the whole buckets that ended before
        `settled_before` taken from (or added to) what is kept."""
        with self._lock:
            return self._figures(kind, since, until, bucket_s, settled_before, compute, empty)

    def _figures(self, kind: str, since: float, until: float, bucket_s: float, settled_before: float,
                 compute: Callable[[float, float], dict[float, T]], empty: Callable[[], T]) -> dict[float, T]:
        first = math.ceil(since / bucket_s) * bucket_s
        last = math.floor(min(until, settled_before) / bucket_s) * bucket_s  # end of the settled whole buckets
        if last <= first:
            return compute(since, until)
        out = compute(since, first) if since < first else {}
        starts = [first + i * bucket_s for i in range(round((last - first) / bucket_s))]
        missing = [b for b in starts if (kind, bucket_s, b) not in self._kept]
        if missing:
            if len(self._kept) + len(missing) > MAX_ENTRIES:
                self._kept.clear()
            got = compute(missing[0], missing[-1] + bucket_s)
            for b in missing:
                self._kept[(kind, bucket_s, b)] = got.get(b, empty())
        out |= {b: self._kept[(kind, bucket_s, b)] for b in starts}
        if last < until:
            out |= compute(last, until)
        return out
