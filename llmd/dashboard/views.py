"""What the dashboard reads from live objects: each served model's gauges, its versions and split,
batches in progress, the cluster's members. All of it is in memory (no ledger scan per poll);
batches' item counts are one indexed query per batch, at most once per BATCH_EVERY_S."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmd.batch.store import BatchStore
from llmd.cluster.node import ClusterNode
from llmd.registry.registry import Registry

BATCH_EVERY_S = 5.0


def gauges(registry: Registry) -> dict[str, dict[str, Any]]:
    """Each loaded model's queue per class, seats, engine and cache counters, right now."""
    out: dict[str, dict[str, Any]] = {}
    for name, rt in registry.primaries().items():
        if rt is None:
            continue
        s, sched = rt.backend.stats, rt.scheduler
        out[name] = {"queue": {k: rt.queue.depth(k) for k in rt.queue.classes}, "running": len(sched.running),
                     "seat_limit": sched.seat_limit, "engine_running": s.running, "engine_waiting": s.waiting,
                     "kv_usage": s.kv_usage, "prefix_queries": s.prefix_queries, "prefix_hits": s.prefix_hits,
                     "preemptions": s.preemptions + sched.preempted, "dropped": sched.dropped}
    return out


def models(registry: Registry, live: dict[str, dict[str, Any]],
           slo: Callable[[str], dict[str, Any] | None] | None) -> dict[str, Any]:
    """Per configured model: live gauges, engine state, versions with their share of traffic, SLO targets."""
    out: dict[str, Any] = {}
    for name, rt in registry.primaries().items():
        g = live.get(name)
        desc = registry.describe(name) if rt is not None else {"split": {}, "versions": []}
        out[name] = {
            "ready": rt is not None and rt.ready, "engine": rt.watch.state if rt else None,
            "restarts": rt.watch.restarts if rt else 0, "error": registry.load_error(name),
            "prefix_hit_rate": g["prefix_hits"] / g["prefix_queries"] if g and g["prefix_queries"] else None,
            **(g or {}),
            "versions": [{"version": v["version"], "weight": v["weight"], "state": v["state"],
                          "in_flight": v["in_flight"]} for v in desc["versions"]],
            "slo": slo(name) if slo is not None else None,  # the model's [slo] targets
        }
    return out


class Batches:
    """Batches in progress with their item counts, cached for BATCH_EVERY_S."""

    def __init__(self, store: BatchStore, active: Callable[[], list[str]]) -> None:
        self.store, self.active = store, active
        self._at = -BATCH_EVERY_S
        self._view: list[dict[str, Any]] = []

    async def view(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if now - self._at >= BATCH_EVERY_S:
            self._at = now
            out = []
            for bid in self.active()[:50]:
                b = await self.store.get_batch(bid)
                if b is not None:
                    out.append({"id": b.id, "tenant": b.tenant, "model": b.model, "status": b.status,
                                "created_at": b.created_at, **await self.store.counts(bid)})
            self._view = out
        return self._view


def cluster(node: ClusterNode | None) -> dict[str, Any] | None:
    """Members and their load (gossip's view) when [cluster] is on; None otherwise."""
    if node is None:
        return None
    st = node.status()
    members = [{"name": st["node"], "state": "self", "age_s": 0.0, "versions": st["self"]["versions"],
                "queued": st["self"]["queued"]}]
    members += [{"name": m["name"], "state": m["state"], "age_s": m["age_s"], "versions": m["versions"],
                 "queued": None} for m in st["members"]]
    return {"node": st["node"], "draining": st["draining"], "members": members,
            "forwarded": st["forwarded"], "failovers": st["failovers"]}
