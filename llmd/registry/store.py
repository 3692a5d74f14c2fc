"""The registry's state in SQLite: which versions of each model are loaded (and how), and the
history of every model's split. A rollback is one write: the split before the current one
is appended again. The running routing view is rebuilt from this at start.

Across a cluster every split carries a revision that orders it cluster-wide (hybrid wall
time in ns, ties broken by the node that made it: last writer wins per model), the node
that made it, and the split it replaced (what a rollback restores on every node alike).
`meta.revision` is the registry's own clock (llmd/registry/registry.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from llmd.sqlite import SqliteStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    model TEXT NOT NULL, version TEXT NOT NULL, state TEXT NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (model, version));
CREATE TABLE IF NOT EXISTS splits (
    id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL, weights TEXT NOT NULL,
    created_at REAL NOT NULL, note TEXT);
CREATE INDEX IF NOT EXISTS splits_model ON splits(model, id);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# Columns added since the first schema: a store from before gets them (old splits: revision 0,
# which any split made in a cluster outranks).
MIGRATIONS = {"rev": "ALTER TABLE splits ADD COLUMN rev INTEGER NOT NULL DEFAULT 0",
              "origin": "ALTER TABLE splits ADD COLUMN origin TEXT NOT NULL DEFAULT ''",
              "previous": "ALTER TABLE splits ADD COLUMN previous TEXT"}
# active = may be in a split; pool = loaded asleep for the warm pool, promoted under load
STATES = ("active", "standby", "draining", "unloaded", "pool")


@dataclass(frozen=True)
class SplitRow:
    id: int
    weights: dict[str, float]
    created_at: float
    note: str | None
    rev: int = 0
    origin: str = ""
    previous: dict[str, float] | None = None

    @property
    def order(self) -> tuple[int, str]:
        """Last writer wins: the newer revision, then the greater node name."""
        return self.rev, self.origin


class RegistryStore(SqliteStore):
    SCHEMA = SCHEMA

    async def start(self) -> None:
        await super().start()
        async with self.db.execute("PRAGMA table_info(splits)") as cur:
            have = {row[1] for row in await cur.fetchall()}
        for column, ddl in MIGRATIONS.items():
            if column not in have:
                await self.db.execute(ddl)

    async def set_state(self, model: str, version: str, state: str) -> None:
        assert state in STATES
        await self.db.execute(
            "INSERT INTO versions (model, version, state, updated_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(model, version) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            (model, version, state, time.time()))

    async def versions(self, model: str) -> dict[str, str]:
        async with self.db.execute("SELECT version, state FROM versions WHERE model = ? ORDER BY updated_at",
                                   (model,)) as cur:
            return {r["version"]: r["state"] for r in await cur.fetchall()}

    async def add_split(self, model: str, weights: dict[str, float], note: str | None = None, rev: int = 0,
                        origin: str = "", previous: dict[str, float] | None = None) -> SplitRow:
        prev = json.dumps(previous, sort_keys=True) if previous is not None else None
        cur = await self.db.execute(
            "INSERT INTO splits (model, weights, created_at, note, rev, origin, previous) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (model, json.dumps(weights, sort_keys=True), time.time(), note, rev, origin, prev))
        row = await self.splits(model, 1)
        assert row and row[0].id == cur.lastrowid
        return row[0]

    async def splits(self, model: str, limit: int = 2) -> list[SplitRow]:
        """The newest `limit` splits of `model`, newest first."""
        async with self.db.execute("SELECT * FROM splits WHERE model = ? ORDER BY id DESC LIMIT ?",
                                   (model, limit)) as cur:
            return [SplitRow(r["id"], json.loads(r["weights"]), r["created_at"], r["note"], r["rev"], r["origin"],
                             json.loads(r["previous"]) if r["previous"] else None)
                    for r in await cur.fetchall()]

    async def revision(self) -> int:
        """The registry's clock as last saved (0 for a new store)."""
        async with self.db.execute("SELECT value FROM meta WHERE key = 'revision'") as cur:
            row = await cur.fetchone()
        return int(row[0]) if row is not None else 0

    async def set_revision(self, rev: int) -> None:
        await self.db.execute("INSERT INTO meta (key, value) VALUES ('revision', ?) "
                              "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (rev,))
