"""Opening the small SQLite stores (batches, registry): one place for the settings they share."""

from __future__ import annotations

from pathlib import Path

import aiosqlite


async def open_store(path: Path, schema: str) -> aiosqlite.Connection:
    """An autocommit connection (explicit BEGIN where a change spans statements), WAL, every
    commit synced (these stores are small and their writes rare, and a lost write would
    resume a batch or route traffic wrongly), rows as mappings, `schema` applied."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = await aiosqlite.connect(path, isolation_level=None)
    db.row_factory = aiosqlite.Row
    await db.execute("PRAGMA journal_mode=WAL")
    await db.execute("PRAGMA synchronous=FULL")
    await db.executescript(schema)
    return db


class SqliteStore:
    """A store with one connection: `SCHEMA` applied at start, `db` once started."""

    SCHEMA = ""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db: aiosqlite.Connection | None = None

    async def start(self) -> None:
        self._db = await open_store(self.path, self.SCHEMA)

    async def stop(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        assert self._db is not None, f"{type(self).__name__}.start() first"
        return self._db
