"""Splits and rollbacks made on any node reach every node.

Each node gossips one int, `registry_rev` (`Registry.revision`: a hybrid clock that moves on
every split this node applies, its own or a peer's). When a peer's value is not the one this
node last fetched from it, this node GETs the peer's snapshot (`/internal/v1/registry`) and
merges it model by model: a split with a newer (revision, node) wins, last writer wins. So a
change reaches every node within one gossip heartbeat (`load_heartbeat_s`, <= 1 s) plus one
fetch; a failed fetch is retried at the next heartbeat.

Why "changed", not "newer than ours": revisions are wall time, and a node whose clock lags
may make a split with a lower revision than ours on another model; comparing with our own
value would never fetch it. Cost: after one change, each node fetches from each peer at most
once more (N·(N-1) small GETs per change; changes are rare admin actions).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from llmd.registry.registry import Registry
from llmd.registry.store import SplitRow

log = structlog.get_logger("llmd.cluster.registry_sync")
Fetch = Callable[[str], Awaitable[dict[str, Any]]]  # a peer's base URL -> its snapshot


def snapshot(registry: Registry) -> dict[str, Any]:
    """What a peer needs to merge this node's registry: per model, the cluster split, its
    revision and author, and the split it replaced (what a rollback restores)."""
    return {"node": registry.node, "revision": registry.revision,
            "models": {name: {"weights": row.weights, "rev": row.rev, "origin": row.origin, "note": row.note,
                              "previous": row.previous}
                       for name, row in registry.splits.items()}}


def _row(entry: Mapping[str, Any]) -> SplitRow:
    """A snapshot entry as a split row; KeyError/TypeError/ValueError for a malformed one."""
    weights = {str(v): float(w) for v, w in dict(entry["weights"]).items()}
    prev = entry.get("previous")
    previous = {str(v): float(w) for v, w in dict(prev).items()} if prev is not None else None
    note = entry.get("note")
    return SplitRow(0, weights, 0.0, str(note) if note is not None else None, int(entry["rev"]),
                    str(entry["origin"]), previous)


class RegistrySync:
    """Merges peers' registries into this node's (the gossip calls `on_peer_rev`)."""

    def __init__(self, registry: Registry, fetch: Fetch) -> None:
        self.registry = registry
        self.fetch = fetch
        self.fetched: dict[str, int] = {}  # peer URL -> its revision as last merged
        self.failures = 0
        self._busy: set[str] = set()

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self.registry)

    async def on_peer_rev(self, peer_url: str, rev: int) -> list[str]:
        """A peer gossiped its `registry_rev`: fetch and merge its registry if it changed
        since we last did. Returns the models whose split changed here."""
        if self.fetched.get(peer_url) == rev or peer_url in self._busy:
            return []
        self._busy.add(peer_url)
        try:
            snap = await self.fetch(peer_url)
            changed = await self.merge(snap)
            self.fetched[peer_url] = int(snap.get("revision", rev))
            return changed
        except Exception as e:  # the peer's fault (down, slow, garbled): never the gossip loop's
            self.failures += 1  # retried when the peer's next heartbeat arrives
            log.warning("registry_fetch_failed", peer=peer_url, error=f"{type(e).__name__}: {e}")
            return []
        finally:
            self._busy.discard(peer_url)

    async def merge(self, snap: Mapping[str, Any]) -> list[str]:
        """Apply each model's split that is newer than ours; a malformed entry is skipped (logged)."""
        changed = []
        for name, entry in dict(snap.get("models", {})).items():
            try:
                row = _row(entry)
                if await self.registry.merge(str(name), row):
                    changed.append(str(name))
            except (KeyError, TypeError, ValueError) as e:
                log.warning("registry_entry_malformed", model=name, peer=snap.get("node"), error=str(e))
        return changed

    def forget(self, peer_url: str) -> None:
        """A peer left or died: next time it is seen, fetch it again."""
        self.fetched.pop(peer_url, None)
