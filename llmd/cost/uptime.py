"""Engine uptime: which versions of which models had an engine loaded on this node, and when.

An idle GPU costs as much as a busy one, so serving cost follows the time an engine is loaded,
not the requests. The node samples its loaded engines every `[cost] sample_s` and keeps one
row per stretch of uptime (node, model, version, t_start, t_end): a stretch's end moves forward
at each sample and again when the node stops; a version first seen by this process (loaded, or
the node restarted) starts a new stretch. The node samples once more as soon as its models have
loaded, so what goes uncounted is the time since the last sample before a crash (at most one
sample) and, for a version loaded later through the registry, its first moments (the same).
The rows live in `<db>.uptime.db`, beside the ledger."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

from llmd.cost.split import Uptime
from llmd.periodic import Periodic
from llmd.sqlite import SqliteStore

log = structlog.get_logger("llmd.cost")

SCHEMA = """
CREATE TABLE IF NOT EXISTS engine_uptime (
    node TEXT NOT NULL, model TEXT NOT NULL, version TEXT NOT NULL,
    t_start REAL NOT NULL, t_end REAL NOT NULL, PRIMARY KEY (node, model, version, t_start));
CREATE INDEX IF NOT EXISTS engine_uptime_end ON engine_uptime(t_end);
"""
Loaded = Callable[[], Iterable[tuple[str, str]]]  # (model, version) of every engine loaded now


def uptime_path(db: Path) -> Path:
    """The uptime store of the node whose ledger is `db`."""
    return Path(db).with_suffix(".uptime.db")


class UptimeStore(SqliteStore):
    SCHEMA = SCHEMA


class EngineUptime:
    """Records, every `every_s`, the engines `loaded` reports; `tick()` records now."""

    def __init__(self, store: UptimeStore, node: str, loaded: Loaded, every_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.node, self.loaded, self.every_s, self.clock = store, node, loaded, every_s, clock
        self._open: dict[tuple[str, str], float] = {}  # (model, version) -> its stretch's t_start
        self._job = Periodic("engine-uptime", every_s, self._sample, log, "engine_uptime_sampled",
                             "engine_uptime_failed", "engines")

    async def start(self) -> None:
        await self.store.start()
        self._job.start()

    async def stop(self) -> None:
        """Record up to now (call before the engines stop), then close the store."""
        await self._job.stop()
        try:
            await self.tick()
        finally:
            await self.store.stop()

    def live(self) -> list[Uptime]:
        """The stretches of the engines loaded now, up to now (the rows say: up to the last sample)."""
        now = self.clock()
        return [Uptime(self.node, m, v, start, now) for (m, v), start in self._open.items()]

    async def _sample(self) -> int:
        await self.tick()
        return 0  # nothing worth a log line each round

    async def tick(self) -> None:
        """Extend the stretch of every engine loaded now; start one for an engine new since the last tick."""
        if self.store._db is None:  # not started, or stopped: nothing to record into
            return
        now = self.clock()
        seen = set(self.loaded())
        rows = []
        for key in seen:
            start = self._open.setdefault(key, now)
            rows.append((self.node, *key, start, now))
        for key in set(self._open) - seen:
            del self._open[key]
        if rows:
            await self.store.db.executemany(
                "INSERT INTO engine_uptime (node, model, version, t_start, t_end) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (node, model, version, t_start) DO UPDATE SET t_end = excluded.t_end", rows)
