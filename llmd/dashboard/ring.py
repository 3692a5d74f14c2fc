"""The dashboard's memory: a ring of 2-second samples, fed by every finished request record.

Why a ring and not the ledger: the page polls every ~2 s from any number of browsers, and the
issue's budget is < 1 % of serving throughput with 5 of them. So the serving path only adds a
record's numbers to the current interval (`observe`: O(1) plus its ITL samples, capped), and a
closed interval becomes one point at most once per INTERVAL_S, however many viewers poll:
every poll between two closes reads the same cached points and tables.

Intervals close lazily (on the next record or poll after their end): with nobody watching
and no traffic nothing runs. Live gauges (queues, seats, KV) are read at the close, from a
callable the owner passes in (views.py), so this module touches no runtime object itself.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INTERVAL_S = 2.0
KEEP = 300  # points kept: 10 minutes
WINDOW = 30  # intervals in the latency tables: the last minute
MAX_SAMPLES = 400  # latency samples kept per (model, tenant) per interval: a stride beyond that
RECENT = 40  # the newest finished requests, for the inspector's list

Key = tuple[str, str]  # (model, tenant)
Gauges = Callable[[], dict[str, dict[str, Any]]]


def quantile(sorted_xs: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank); None for none."""
    if not sorted_xs:
        return None
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


def _keep(into: list[float], xs: list[float]) -> None:
    """Append `xs` to `into`, at most MAX_SAMPLES in all (evenly strided when more come)."""
    room = MAX_SAMPLES - len(into)
    if room <= 0:
        return
    into.extend(xs if len(xs) <= room else [xs[i * len(xs) // room] for i in range(room)])


@dataclass
class Interval:
    """What finished during one INTERVAL_S."""

    t: float
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    shed: int = 0
    dropped: int = 0
    filtered: int = 0
    ttft: dict[Key, list[float]] = field(default_factory=dict)
    itl: dict[Key, list[float]] = field(default_factory=dict)


def _pcts(xs: list[float]) -> tuple[float | None, float | None]:
    s = sorted(xs)
    return quantile(s, 0.5), quantile(s, 0.95)


def _by_model(samples: dict[Key, list[float]]) -> dict[str, list[float | None]]:
    models: dict[str, list[float]] = {}
    for (model, _), xs in samples.items():
        models.setdefault(model, []).extend(xs)
    return {m: list(_pcts(xs)) for m, xs in models.items()}


class Ring:
    """Samples for the charts, cumulative counters for the tables; `clock` is wall-clock time."""

    def __init__(self, clock: Callable[[], float], gauges: Gauges) -> None:
        self.clock, self.gauges = clock, gauges
        self.points: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.closed: deque[Interval] = deque(maxlen=WINDOW)
        self.cur = Interval(self._start(clock()))
        self.shed: Counter[str] = Counter()  # by reason, since start
        self.dropped: Counter[str] = Counter()  # deadline drops by reason
        self.filtered: Counter[str] = Counter()  # stops by filter/rule
        self.statuses: Counter[str] = Counter()
        self.spend: dict[str, float] = {}  # per tenant, today (UTC): seeded from the ledger at open
        self.day = self._day(clock())
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.table: list[dict[str, Any]] = []  # latency by (model, tenant) over the last WINDOW intervals
        self._last: dict[str, dict[str, Any]] = {}  # the gauges at the previous close: deltas of counters

    @staticmethod
    def _start(now: float) -> float:
        return math.floor(now / INTERVAL_S) * INTERVAL_S

    @staticmethod
    def _day(now: float) -> int:
        return int(now // 86400)

    def seed(self, spend: dict[str, float]) -> None:
        """Today's spend per tenant as the ledger had it at open (before any request ran)."""
        self.spend = dict(spend)

    def tick(self) -> bool:
        """Close the current interval if it is over; True if one closed (new points, new tables)."""
        now = self.clock()
        if now < self.cur.t + INTERVAL_S:
            return False
        self._close(self.cur)
        self.cur = Interval(self._start(now))
        if self._day(now) != self.day:
            self.day, self.spend = self._day(now), {}
        return True

    def observe(self, rec: dict[str, Any]) -> None:
        """Account one finished request record (a RequestRecord.as_log() dict)."""
        self.tick()
        iv, status = self.cur, rec.get("status") or ""
        key = (str(rec.get("model") or ""), str(rec.get("tenant") or ""))
        decision = rec.get("decision") or ""
        iv.requests += 1
        self.statuses[status] += 1
        if status not in ("ok", "cancelled"):
            iv.errors += 1
        if status == "shed":
            iv.shed += 1
            self.shed[decision.partition("shed:")[2] or str(rec.get("error_code") or "shed")] += 1
        if decision.startswith("dropped:") or (status == "deadline" and rec.get("queue_time_s") is None):
            iv.dropped += 1
            self.dropped[decision.partition("dropped:")[2] or "deadline"] += 1
        if status == "filtered" or rec.get("filter"):
            iv.filtered += 1
            self.filtered[str(rec.get("filter") or "filter")] += 1
        iv.prompt_tokens += rec.get("prompt_tokens") or 0
        iv.output_tokens += rec.get("output_tokens") or 0
        if (ttft := rec.get("ttft_s")) is not None:
            _keep(iv.ttft.setdefault(key, []), [ttft])
        if samples := rec.get("itl_samples"):
            _keep(iv.itl.setdefault(key, []), samples)
        cost, tenant = rec.get("cost"), rec.get("tenant")
        if cost and tenant and self._day(rec.get("ts") or 0.0) == self.day:
            self.spend[tenant] = self.spend.get(tenant, 0.0) + cost
        self.recent.append({"request_id": rec.get("request_id"), "client_request_id": rec.get("client_request_id"),
                            "model": key[0], "tenant": key[1], "status": status, "ttft_s": ttft,
                            "output_tokens": rec.get("output_tokens"), "ts": rec.get("ts")})

    def _close(self, iv: Interval) -> None:
        gauges = self.gauges()
        point: dict[str, Any] = {
            "t": iv.t + INTERVAL_S, "rps": iv.requests / INTERVAL_S, "errors": iv.errors,
            "prompt_tps": iv.prompt_tokens / INTERVAL_S, "output_tps": iv.output_tokens / INTERVAL_S,
            "shed": iv.shed, "dropped": iv.dropped, "filtered": iv.filtered,
            "ttft": _by_model(iv.ttft), "itl": _by_model(iv.itl), "models": {},
        }
        for model, g in gauges.items():
            last = self._last.get(model, g)
            queries = g["prefix_queries"] - last["prefix_queries"]
            point["models"][model] = {
                "queue": g["queue"], "running": g["running"], "seat_limit": g["seat_limit"], "kv": g["kv_usage"],
                "prefix_hit": (g["prefix_hits"] - last["prefix_hits"]) / queries if queries > 0 else None,
                "preempted": g["preemptions"] - last["preemptions"],
            }
        self._last = gauges
        self.points.append(point)
        self.closed.append(iv)
        self.table = self._table()

    def _table(self) -> list[dict[str, Any]]:
        ttft: dict[Key, list[float]] = {}
        itl: dict[Key, list[float]] = {}
        for iv in self.closed:
            for src, dst in ((iv.ttft, ttft), (iv.itl, itl)):
                for k, xs in src.items():
                    dst.setdefault(k, []).extend(xs)
        rows = []
        for model, tenant in sorted(set(ttft) | set(itl)):
            t50, t95 = _pcts(ttft.get((model, tenant), []))
            i50, i95 = _pcts(itl.get((model, tenant), []))
            rows.append({"model": model, "tenant": tenant, "requests": len(ttft.get((model, tenant), [])),
                         "ttft_p50": t50, "ttft_p95": t95, "itl_p50": i50, "itl_p95": i95})
        return rows

    def since(self, t: float | None) -> list[dict[str, Any]]:
        """Points closed after `t` (all kept ones for None): a poller asks only for what is new."""
        return [p for p in self.points if t is None or p["t"] > t]
