"""Files on disk and batch state in SQLite: what a restart needs to resume every batch.

A file's bytes are written to a temporary name, fsynced and renamed before its row is
committed, so a row never names a missing or partial file. A batch's items are stored at
validation; each item's result is stored once (`state` goes from `pending` exactly once,
guarded in SQL) and then appended to the batch's output or error file as it finishes
(llmd/batch/results.py), so a batch resumed after a crash runs only what had no result, and
its files come out complete. Once a batch ends its rows' bodies and results are dropped (the
files hold them). A tenant's stored bytes (`[batch] max_bytes_per_tenant`) are its files plus
the bodies and results its batches' rows hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from llmd.batch.lines import Item, output_line
from llmd.batch.results import ResultFiles, file_id
from llmd.periodic import Periodic
from llmd.sqlite import SqliteStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0,
    expires_at INTEGER);
CREATE INDEX IF NOT EXISTS files_tenant ON files(tenant, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_id TEXT, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT, model TEXT,
    status TEXT NOT NULL, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches(tenant, created_at);
CREATE TABLE IF NOT EXISTS items (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending', status_code INTEGER, result TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line));
"""
log = structlog.get_logger("llmd.batch")
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
PURGE_EVERY_S = 600.0  # expired files are deleted this often while serving
TIMESTAMP = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
             "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
             "cancelled": "cancelled_at"}


@dataclass
class Batch:
    id: str
    tenant: str
    key_id: str | None
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    model: str | None
    status: str
    errors: dict[str, Any] | None  # {"object": "list", "data": [...]}
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int
    times: dict[str, int | None]


def window_seconds(window: str) -> int:
    """'24h', '90m', '30s' (config-validated) in seconds."""
    return int(window[:-1]) * {"h": 3600, "m": 60, "s": 1}[window[-1]]


class TooManyOpen(Exception):
    """The tenant already has its limit of unfinished batches."""


class BatchStore(SqliteStore):
    SCHEMA = SCHEMA

    def __init__(self, db_path: Path, files_dir: Path, file_ttl_s: float | None = None) -> None:
        super().__init__(db_path)
        self.dir = Path(files_dir)
        self.file_ttl_s = file_ttl_s  # a file's default life (None: until deleted)
        # One connection serves every coroutine: a transaction must not take in another's writes.
        self._lock = asyncio.Lock()
        self._rows: dict[str, int] = {}  # tenant -> bytes its batches' rows hold (cached once read)
        self.results = ResultFiles(self.dir)
        self._purger = Periodic("batch-files-purge", PURGE_EVERY_S, self.purge_expired, log,
                                "batch_files_expired", "batch_files_purge_failed", "files")

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        await super().start()  # synced: a stored result is never lost
        async with self.db.execute("PRAGMA table_info(files)") as cur:
            if "expires_at" not in {r[1] for r in await cur.fetchall()}:  # a store from before expiry
                await self.db.execute("ALTER TABLE files ADD COLUMN expires_at INTEGER")
        for p in self.dir.glob("*.tmp"):  # a file whose row was never committed
            p.unlink(missing_ok=True)
        await self.purge_expired()
        self._purger.start()

    async def stop(self) -> None:
        await self._purger.stop()
        await super().stop()

    # -- files ---------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.dir / file_id

    def _write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        tmp = self.dir / f"{file_id}.tmp"
        size = 0
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
                size += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.file_path(file_id))
        return size

    def expiry(self, now: int, seconds: int | None = None) -> int | None:
        """When a file made `now` expires: after `seconds` if given, else the store's TTL."""
        ttl = seconds if seconds is not None else self.file_ttl_s
        return now + int(ttl) if ttl is not None else None

    async def add_file(self, tenant: str, purpose: str, filename: str, data: bytes,
                       file_id: str | None = None) -> dict[str, Any]:
        file_id = file_id or new_file_id()
        size = await asyncio.to_thread(self._write, file_id, [data])
        now = int(time.time())
        row = (file_id, tenant, purpose, filename, size, now, self.expiry(now))
        async with self._lock:
            await self.db.execute("INSERT OR REPLACE INTO files (id, tenant, purpose, filename, bytes, created_at, "
                                  "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        return dict(zip(FILE_COLS, row, strict=True))

    def staging(self, file_id: str) -> Path:
        """Where an upload is written as it arrives; `commit_upload` makes it a file."""
        return self.dir / f"{file_id}.tmp"

    async def used_bytes(self, tenant: str) -> int:
        """The bytes `tenant` stores: its files and its batches' rows (bodies and results)."""
        async with self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ? AND deleted = 0",
                                   (tenant,)) as cur:
            row = await cur.fetchone()
        return (int(row[0]) if row else 0) + await self._row_bytes(tenant)

    async def _row_bytes(self, tenant: str) -> int:
        if tenant not in self._rows:
            async with self.db.execute(
                    "SELECT COALESCE(SUM(LENGTH(CAST(i.body AS BLOB)) + COALESCE(LENGTH(CAST(i.result AS BLOB)), 0)), "
                    "0) FROM items i JOIN batches b ON b.id = i.batch_id WHERE b.tenant = ?", (tenant,)) as cur:
                row = await cur.fetchone()
            self._rows[tenant] = int(row[0]) if row else 0
        return self._rows[tenant]

    async def commit_upload(self, tenant: str, purpose: str, filename: str, file_id: str, size: int,
                            expires_after_s: int | None, quota: int | None) -> dict[str, Any] | None:
        """The staged upload synced and renamed, then its row committed; None (and the upload
        gone) if it would take the tenant over `quota` bytes (checked here, under the lock,
        so concurrent uploads cannot together pass it)."""
        tmp = self.staging(file_id)
        await asyncio.to_thread(_sync, tmp)
        now = int(time.time())
        row = (file_id, tenant, purpose, filename, size, now, self.expiry(now, expires_after_s))
        async with self._lock:
            if quota is not None and await self.used_bytes(tenant) + size > quota:
                tmp.unlink(missing_ok=True)
                return None
            os.replace(tmp, self.file_path(file_id))
            await self.db.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, expires_at) "
                                  "VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        return dict(zip(FILE_COLS, row, strict=True))

    async def purge_expired(self) -> int:
        """Delete the files past their `expires_at` (not a running batch's input); how many."""
        now = int(time.time())
        q = ",".join("?" * len(UNFINISHED))
        async with self._lock:
            async with self.db.execute(
                    "SELECT id FROM files WHERE deleted = 0 AND expires_at IS NOT NULL AND expires_at <= ? AND id "
                    f"NOT IN (SELECT input_file_id FROM batches WHERE status IN ({q}))", (now, *UNFINISHED)) as cur:
                ids = [r[0] for r in await cur.fetchall()]
            await self.db.executemany("UPDATE files SET deleted = 1 WHERE id = ?", [(i,) for i in ids])
        for i in ids:
            self.file_path(i).unlink(missing_ok=True)
        return len(ids)

    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        async with self.db.execute("SELECT * FROM files WHERE id = ? AND tenant = ? AND deleted = 0",
                                   (file_id, tenant)) as cur:
            row = await cur.fetchone()
        return dict(row) if row else None

    async def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                         newest_first: bool = True) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM files WHERE tenant = ? AND deleted = 0", [tenant]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        order = "DESC" if newest_first else "ASC"
        if after:
            cmp = "<" if newest_first else ">"
            sql += f" AND (created_at, id) {cmp} (SELECT created_at, id FROM files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY created_at {order}, id {order} LIMIT ?"
        async with self.db.execute(sql, [*args, limit]) as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        async with self._lock:
            cur = await self.db.execute("UPDATE files SET deleted = 1 WHERE id = ? AND tenant = ? AND deleted = 0",
                                        (file_id, tenant))
        if cur.rowcount:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(cur.rowcount)

    # -- batches -------------------------------------------------------------------------
    async def add_batch(self, tenant: str, key_id: str | None, endpoint: str, input_file_id: str,
                        window: str, metadata: dict[str, str] | None, max_open: int | None = None) -> str:
        """A new batch (validating); `TooManyOpen` if the tenant already has `max_open` unfinished
        (counted under the lock: concurrent creates cannot together pass it)."""
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        q = ",".join("?" * len(UNFINISHED))
        async with self._lock:
            if max_open is not None:
                async with self.db.execute(f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN ({q})",
                                           (tenant, *UNFINISHED)) as cur:
                    row = await cur.fetchone()
                if row is not None and row[0] >= max_open:
                    raise TooManyOpen(f"tenant {tenant!r} has {row[0]} unfinished batches")
            await self.db.execute(
                "INSERT INTO batches (id, tenant, key_id, endpoint, input_file_id, completion_window, metadata, "
                "status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                (batch_id, tenant, key_id, endpoint, input_file_id, window,
                 json.dumps(metadata) if metadata is not None else None, now, now + window_seconds(window)))
        return batch_id

    async def get_batch(self, batch_id: str, tenant: str | None = None) -> Batch | None:
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if tenant is not None:
            sql, args = sql + " AND tenant = ?", [*args, tenant]
        async with self.db.execute(sql, args) as cur:
            row = await cur.fetchone()
        return _batch(row) if row else None

    async def list_batches(self, tenant: str, after: str | None, limit: int) -> list[Batch]:
        sql, args = "SELECT * FROM batches WHERE tenant = ?", [tenant]
        if after:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            args.append(after)
        async with self.db.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", [*args, limit]) as cur:
            return [_batch(r) for r in await cur.fetchall()]

    async def unfinished(self) -> list[Batch]:
        q = ",".join("?" * len(UNFINISHED))
        async with self.db.execute(f"SELECT * FROM batches WHERE status IN ({q}) ORDER BY created_at",
                                   UNFINISHED) as cur:
            return [_batch(r) for r in await cur.fetchall()]

    async def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...] = (), **cols: Any) -> bool:
        """Move a batch to `status` (stamping its time), if it is in one of `only_from`."""
        cols = dict(cols)
        if status in TIMESTAMP:
            cols.setdefault(TIMESTAMP[status], int(time.time()))
        sets = ", ".join(["status = ?"] + [f"{k} = ?" for k in cols])
        sql, args = f"UPDATE batches SET {sets} WHERE id = ?", [status, *cols.values(), batch_id]
        if only_from:
            sql += f" AND status IN ({','.join('?' * len(only_from))})"
            args += list(only_from)
        if self._lock.locked() and _in_tx.get(False):
            cur = await self.db.execute(sql, args)
        else:
            async with self._lock:
                cur = await self.db.execute(sql, args)
        return bool(cur.rowcount)

    # -- items ---------------------------------------------------------------------------
    async def add_items(self, batch_id: str, items: list[Item], model: str | None) -> None:
        """Store the items and start the batch, in one transaction (idempotent)."""
        async with self._tx():
            await self.db.executemany(
                "INSERT OR IGNORE INTO items (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                [(batch_id, i.line, i.custom_id, i.body) for i in items])
            await self.db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, model = ? "
                                  "WHERE id = ? AND status = 'validating'", (int(time.time()), model, batch_id))
        self._rows.clear()  # re-read: the bodies now count

    async def pending(self, batch_id: str) -> list[Item]:
        async with self.db.execute("SELECT line, custom_id, body FROM items WHERE batch_id = ? AND state = 'pending' "
                                   "ORDER BY line", (batch_id,)) as cur:
            return [Item(r["line"], r["custom_id"], r["body"]) for r in await cur.fetchall()]

    async def save_result(self, batch: Batch, line: int, custom_id: str, status_code: int,
                          response: dict[str, Any]) -> bool:
        """Store an item's response once, then append it to the batch's output (or error) file;
        False if it already had one."""
        u = (response.get("body") or {}).get("usage") or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        text = json.dumps(response, ensure_ascii=False)
        async with self._lock:
            cur = await self.db.execute(
                "UPDATE items SET state = ?, status_code = ?, result = ?, input_tokens = ?, cached_tokens = ?, "
                "output_tokens = ? WHERE batch_id = ? AND line = ? AND state = 'pending'",
                ("ok" if status_code == 200 else "failed", status_code, text,
                 u.get("prompt_tokens", 0), cached, u.get("completion_tokens", 0), batch.id, line))
            if cur.rowcount and batch.tenant in self._rows:
                self._rows[batch.tenant] += len(text.encode())
        if cur.rowcount:
            kind = "output" if status_code == 200 else "errors"
            await asyncio.to_thread(self.results.append, batch.id, kind,
                                    output_line(batch.id, line, custom_id, response))
        return bool(cur.rowcount)

    async def counts(self, batch_id: str) -> dict[str, int]:
        async with self.db.execute(
            "SELECT COUNT(*) AS total, COALESCE(SUM(state = 'ok'), 0) AS completed, "
            "COALESCE(SUM(state = 'failed'), 0) AS failed, COALESCE(SUM(input_tokens), 0) AS input_tokens, "
            "COALESCE(SUM(cached_tokens), 0) AS cached_tokens, COALESCE(SUM(output_tokens), 0) AS output_tokens "
            "FROM items WHERE batch_id = ?", (batch_id,)) as cur:
            row = await cur.fetchone()
        return dict(row) if row else {}

    async def finish(self, batch: Batch, status: str, unran: dict[str, str]) -> None:
        """Check the result files (rebuilt from the rows if a crash cut them short), add an error
        line `unran` for each item that never ran, seal the files, then record them and the final
        status and drop the rows' bodies and results, at once."""
        c = await self.counts(batch.id)
        if not await asyncio.to_thread(self.results.whole, batch.id, {"output": c.get("completed", 0),
                                                                        "errors": c.get("failed", 0)}):
            await asyncio.to_thread(self.results.discard, batch.id)
            await self._rewrite(batch, "state != 'pending'", None)
        await self._rewrite(batch, "state = 'pending'", unran)
        sizes = await asyncio.to_thread(self.results.seal, batch.id, self.dir)
        now = int(time.time())
        rows = [(file_id(batch.id, k), batch.tenant, "batch_output", f"{batch.id}_{k}.jsonl", size, now,
                 self.expiry(now)) for k, size in sizes.items() if size is not None]
        async with self._tx():
            await self.db.executemany("INSERT OR REPLACE INTO files (id, tenant, purpose, filename, bytes, "
                                      "created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            await self.db.execute("UPDATE items SET body = '', result = NULL WHERE batch_id = ?", (batch.id,))
            await self.set_status(batch.id, status, output_file_id=sizes["output"] and file_id(batch.id, "output"),
                                  error_file_id=sizes["errors"] and file_id(batch.id, "errors"))
        self._rows.pop(batch.tenant, None)

    async def _rewrite(self, batch: Batch, where: str, unran: dict[str, str] | None) -> None:
        """Append the lines of the items `where` selects to the result files, a page at a time, in
        line order: their stored results, or (`unran`) that error."""
        async with self.db.execute(f"SELECT line, custom_id, state, result FROM items WHERE batch_id = ? AND {where} "
                                   "ORDER BY line", (batch.id,)) as cur:
            while page := await cur.fetchmany(1000):
                lines = [("errors" if unran is not None or r["state"] == "failed" else "output",
                          output_line(batch.id, r["line"], r["custom_id"],
                                      None if unran is not None else json.loads(r["result"]), unran))
                         for r in page]
                await asyncio.to_thread(self.results.append_many, batch.id, lines)

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[None]:
        async with self._lock:
            token = _in_tx.set(True)
            await self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                await self.db.execute("ROLLBACK")
                raise
            else:
                await self.db.execute("COMMIT")
            finally:
                _in_tx.reset(token)


_in_tx: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_store_in_tx")
FILE_COLS = ("id", "tenant", "purpose", "filename", "bytes", "created_at", "expires_at")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def _sync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _batch(r: aiosqlite.Row) -> Batch:
    return Batch(
        id=r["id"], tenant=r["tenant"], key_id=r["key_id"], endpoint=r["endpoint"],
        input_file_id=r["input_file_id"], completion_window=r["completion_window"],
        metadata=json.loads(r["metadata"]) if r["metadata"] else None, model=r["model"], status=r["status"],
        errors=json.loads(r["errors"]) if r["errors"] else None, output_file_id=r["output_file_id"],
        error_file_id=r["error_file_id"], created_at=r["created_at"], expires_at=r["expires_at"],
        times={c: r[c] for c in TIMESTAMP.values()})
