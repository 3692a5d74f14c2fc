"""The built-in dashboard's data (its page is llmd/dashboard/static/, served by
llmd/gateway/dashboard.py): live views, a ring of 2-second samples and the request inspector.

`Dashboard` is built by llmd/node.py and fed every finished request record (`observe`, beside
the Prometheus metrics). Two views come from elsewhere, set by the node (llmd/node.py): `slo` (a model's [slo]
targets, read per poll) and `cost` (the GPU-hour cost summary, llmd/cost/summaries.py)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Any

from llmd.batch.runner import BatchRunner
from llmd.batch.store import BatchStore
from llmd.cluster.node import ClusterNode
from llmd.dashboard import timeline, views
from llmd.dashboard.ring import INTERVAL_S, Ring
from llmd.metering import Ledger
from llmd.registry.registry import Registry
from llmd.telemetry import RequestRecord, log

__all__ = ["Dashboard"]


class Dashboard:
    def __init__(self, registry: Registry, ledger: Ledger, in_flight: dict[str, RequestRecord],
                 batches: BatchStore, runner: BatchRunner, clock: Callable[[], float] = time.time) -> None:
        self.registry, self.ledger, self.in_flight = registry, ledger, in_flight
        self.ring = Ring(clock, lambda: views.gauges(registry))
        self.batches = views.Batches(batches, lambda: runner.active)
        self.cluster: ClusterNode | None = None
        self.slo: Callable[[str], dict[str, Any] | None] | None = None  # set by the node: a model's [slo] targets
        self.cost: Callable[[], Awaitable[dict[str, Any]]] | None = None  # set by the node: the GPU-hour cost summary
        self._cost_of: dict[str, list[float]] = {}  # per model: [cost, prompt tokens, output tokens]

    async def open(self) -> None:
        """Seed today's spend per tenant from the ledger: one query, before any request runs."""
        day = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
        rows = await self.ledger.usage(None, day, None, ["tenant"])
        self.ring.seed({r["tenant"]: r["cost"] for r in rows if r["tenant"] is not None and r["cost"]})

    def observe(self, rec: dict[str, Any]) -> None:
        """Account one finished request record; never raises (it runs on the request's end)."""
        try:
            self.ring.observe(rec)
            if rec.get("cost") is not None:
                c = self._cost_of.setdefault(str(rec.get("model")), [0.0, 0.0, 0.0])
                c[0] += rec["cost"]
                c[1] += rec.get("prompt_tokens") or 0
                c[2] += rec.get("output_tokens") or 0
        except Exception:
            log.exception("dashboard_observe_failed", request_id=rec.get("request_id"))

    def _prices(self) -> dict[str, Any]:
        """Configured per-token prices' realised cost per million tokens since start, per model."""
        out = {}
        for model, (cost, p, o) in self._cost_of.items():
            out[model] = {"cost": cost, "per_mtok_total": cost / (p + o) * 1e6 if p + o else None,
                          "per_mtok_output": cost / o * 1e6 if o else None}
        return out

    async def overview(self, since: float | None) -> dict[str, Any]:
        """Everything the page shows; `since`: only the chart points after that time."""
        r = self.ring
        r.tick()
        live = views.gauges(self.registry)
        return {
            "now": r.clock(), "interval_s": INTERVAL_S, "points": r.since(since),
            "models": views.models(self.registry, live, self.slo),
            "latency": r.table, "statuses": dict(r.statuses), "shed": dict(r.shed), "dropped": dict(r.dropped),
            "filtered": dict(r.filtered), "spend_today": dict(sorted(r.spend.items())),
            "prices": self._prices(), "recent": list(reversed(r.recent)), "in_flight": len(self.in_flight),
            "batches": await self.batches.view(), "cluster": views.cluster(self.cluster),
            "cost": await self.cost() if self.cost is not None else None,  # null where the node sets none
        }

    async def inspect(self, rid: str) -> dict[str, Any] | None:
        """One request's timeline by our id or the client's X-Request-ID; None if unknown."""
        rec = self.in_flight.get(rid) or next(
            (r for r in list(self.in_flight.values()) if r.client_request_id == rid), None)
        if rec is not None:
            return timeline.from_record(rec)
        row = await self.ledger.find_request(rid)
        return timeline.from_row(row) if row is not None else None
