"""The registry's state in SQLite: which versions of each model are loaded (and how), and the
history of every model's split. A rollback is one write: the split before the current one
is appended again. The running routing view is rebuilt from this at start."""

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
"""
STATES = ("active", "standby", "draining", "unloaded")  # active = may be in a split


@dataclass(frozen=True)
class SplitRow:
    id: int
    weights: dict[str, float]
    created_at: float
    note: str | None


class RegistryStore(SqliteStore):
    SCHEMA = SCHEMA

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

    async def add_split(self, model: str, weights: dict[str, float], note: str | None = None) -> SplitRow:
        cur = await self.db.execute("INSERT INTO splits (model, weights, created_at, note) VALUES (?, ?, ?, ?)",
                                    (model, json.dumps(weights, sort_keys=True), time.time(), note))
        row = await self.splits(model, 1)
        assert row and row[0].id == cur.lastrowid
        return row[0]

    async def splits(self, model: str, limit: int = 2) -> list[SplitRow]:
        """The newest `limit` splits of `model`, newest first."""
        async with self.db.execute("SELECT * FROM splits WHERE model = ? ORDER BY id DESC LIMIT ?",
                                   (model, limit)) as cur:
            return [SplitRow(r["id"], json.loads(r["weights"]), r["created_at"], r["note"])
                    for r in await cur.fetchall()]
