"""A running node's serving-cost summaries, cached: GET /admin/cost and the dashboard ask for
them, and a fresh one reads both SQLite files in a thread that holds the GIL while it sums. Whole
buckets no request can change any more are kept between calls (settled.py), and the same question
within `max_age_s` gets the same answer: viewers polling at once cost one report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from llmd.config.cost import CostConfig
from llmd.cost.report import cost_summary
from llmd.cost.settled import Settled
from llmd.cost.split import Uptime

DAY_S = 24 * 3600.0
DASHBOARD_MAX_AGE_S = 30.0  # the dashboard's cost panel: hourly buckets, no need for 2-s freshness
MAX_KEPT = 64


class CostSummaries:
    """`get` answers one window; `today` is the dashboard's (the last 24 hours in hours)."""

    def __init__(self, db: Callable[[], Path], cost: Callable[[], CostConfig], flush: Callable[[], Awaitable[None]],
                 live: Callable[[], list[Uptime]], reach_s: Callable[[], float]) -> None:
        self._db, self._cost, self._flush, self._live, self._reach_s = db, cost, flush, live, reach_s
        self._settled = Settled()
        self._recent: dict[tuple[Any, ...], tuple[float, dict[str, Any]]] = {}

    async def get(self, since: float, until: float, bucket_s: float, now: float, max_age_s: float,
                  key: tuple[Any, ...]) -> dict[str, Any]:
        """The summary of [since, until) in `bucket_s` buckets; one made for `key` less than
        `max_age_s` ago is returned as it was. Raises ValueError for too many buckets."""
        hit = self._recent.get(key)
        if hit is not None and now - hit[0] < max_age_s:
            return hit[1]
        await self._flush()  # what is still queued counts
        data = await asyncio.to_thread(cost_summary, self._db(), self._cost(), since, until, bucket_s, now,
                                       self._live(), self._reach_s(), self._settled)
        if len(self._recent) >= MAX_KEPT:
            self._recent.clear()
        self._recent[key] = (now, data)
        return data

    async def today(self) -> dict[str, Any]:
        now = time.time()
        return await self.get(now - DAY_S, now, 3600.0, now, DASHBOARD_MAX_AGE_S, ("dashboard",))
