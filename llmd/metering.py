"""Usage ledger: exactly one billing row per request, in SQLite, written by one task.

Why this shape: billing must be exact, yet the serving path must never wait on a disk.
Callers enqueue plain tuples (sync, O(1)) on one list per kind of op; a single writer task
takes everything queued at once (a swap, no per-op work on the serving loop) and hands it to
a writer process (llmd/ledger_writer.py, which says why a process) that
commits it as ONE transaction (WAL, synchronous=NORMAL). A request's row is opened at
admission, updated with progress about once a second, and closed (an UPSERT, so requests
refused before admission get a row too). A request's close is committed before its response
ends (`RequestLife.finish` waits on `flush()`). After a crash the next start() closes every
row still open: with the final numbers an idempotent run stored with its outcome just before
(`Finals`), else as `interrupted` with the tokens last recorded, so at most one progress
interval of output goes unbilled and nothing is billed twice.

All times are wall-clock epoch seconds (time.time()); RequestRecord keeps monotonic times
beside its wall-clock arrival `ts`, from which the lifecycle derives the others.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from llmd.ledger_schema import MIGRATIONS, SCHEMA_VERSION
from llmd.ledger_writer import REQUEST_COLS, WriterProcess

log = structlog.get_logger("llmd.metering")

STATUSES = frozenset({"ok", "cancelled", "filtered", "deadline", "shed", "error", "interrupted"})
GROUP_KEYS = {"tenant": "tenant", "model": "model", "status": "status", "version": "version",
              "day": "strftime('%Y-%m-%d', t_arrival, 'unixepoch')"}
BATCH_MAX = 500  # this many queued ops end the batching window early

# Ordered schema history; PRAGMA user_version = how many have been applied. Append only.
BATCH_WINDOW_S = 0.1  # longest a queued op waits (bench/metering.py: fewer round trips)

# RequestRecord.as_log() spells some columns differently.
_ALIASES = {"cached_tokens": "cached_prompt_tokens", "queue_s": "queue_time_s", "total_s": "total_time_s"}
_LOG_KEYS = tuple(_ALIASES.get(c, c) for c in REQUEST_COLS)  # as_log() names, in column order
_TS = REQUEST_COLS.index("ts")
# Within a batch ops apply by kind in this order (stable within a kind): each kind is one
# statement, and a request's open < progress < close order is kept.
_ORDER = ("open", "progress", "close", "record")
WRITER_RESTARTS = 3  # a batch is resent to a fresh writer process this many times
# Request id -> (status, prompt, cached, output tokens) known elsewhere for rows a crash left
# open: an idempotent run's outcome is stored with them just before its close is committed.
Finals = Callable[[list[str]], Awaitable[dict[str, tuple[str, int, int, int]]]]


@dataclass
class Price:
    """Per-model list price in currency units per million tokens."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0

    def cost(self, prompt_tokens: int, output_tokens: int, multiplier: float = 1.0) -> float:
        return (prompt_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6 * multiplier


class Ledger:
    """The only writer of the usage DB; see the module docstring."""

    def __init__(self, path: Path, node: str, prices: dict[str, Price]) -> None:
        self.path, self.node, self.prices = Path(path), node, prices
        self._pending: dict[str, list[Any]] = {k: [] for k in _ORDER}  # queued params per op kind
        self._npending = 0
        self._progress: dict[str, list[Any]] = {}  # queued, not yet taken progress params per request
        self._seq = 0  # last enqueued
        self._applied = 0  # last applied (committed or given up on)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._window: asyncio.Future[None] | None = None  # the writer's batching pause, if in one
        self._proc: WriterProcess | None = None
        self._ro: aiosqlite.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, finals: Finals | None = None) -> int:
        """Open, migrate, close rows a crash left open (as `interrupted` with the tokens last
        saved, or with their final numbers where `finals` knows them), start the writer
        process; returns how many rows were closed so."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        async with aiosqlite.connect(self.path, isolation_level=None) as db:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA busy_timeout=5000")
            await self._migrate(db)
            interrupted = await self._recover(db, finals)
        self._ro = await aiosqlite.connect(self.path)
        self._ro.row_factory = aiosqlite.Row
        await self._ro.execute("PRAGMA query_only=ON")
        self._proc = WriterProcess(str(self.path))
        self._task = asyncio.create_task(self._writer(), name="usage-ledger-writer")
        if interrupted:
            log.warning("usage_rows_interrupted", count=interrupted, db=str(self.path))
        return interrupted

    async def stop(self) -> None:
        """Drain the queue, commit, close; ops enqueued later are logged, not written."""
        self._stopping = True
        self._wake.set()
        self._end_window()
        if self._task is not None:
            await self._task
        if self._proc is not None:
            await self._proc.close()
        if self._ro is not None:
            await self._ro.close()
        self._ro = self._proc = self._task = None

    @staticmethod
    async def _migrate(db: aiosqlite.Connection) -> None:
        async with db.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
            have = row[0] if row is not None else 0
        if have > SCHEMA_VERSION:
            raise RuntimeError(f"usage DB schema v{have} is newer than this llmd (v{SCHEMA_VERSION})")
        for v in range(have + 1, SCHEMA_VERSION + 1):
            try:
                await db.executescript(f"BEGIN; {MIGRATIONS[v - 1]}; PRAGMA user_version = {v}; COMMIT;")
            except sqlite3.Error:
                if db.in_transaction:
                    await db.execute("ROLLBACK")
                raise
            log.info("usage_schema_migrated", version=v)

    async def _recover(self, db: aiosqlite.Connection, finals: Finals | None) -> int:
        now = time.time()
        async with db.execute("SELECT request_id, model, prompt_tokens, cached_tokens, output_tokens, "
                              "cost_multiplier FROM usage WHERE status = 'open'") as cur:
            rows = list(await cur.fetchall())
        known = await finals([r[0] for r in rows]) if finals is not None and rows else {}
        params = []
        for rid, m, saved_p, saved_c, saved_o, k in rows:
            status, p, c, o = known.get(rid) or ("interrupted", saved_p, saved_c, saved_o)
            params.append((status, p, c, o, self._price(m).cost(p, o, k), now, rid))
        await db.execute("BEGIN")
        await db.executemany("UPDATE usage SET status = ?, prompt_tokens = ?, cached_tokens = ?, output_tokens = ?, "
                             "cost = ?, closed_at = ? WHERE request_id = ? AND status = 'open'", params)
        await db.execute("COMMIT")
        return len(params)

    def _price(self, model: str | None) -> Price:
        return self.prices.get(model or "") or Price()

    # -- writes (sync, non-blocking) -------------------------------------------------------
    def _put(self, kind: str, params: tuple | list[Any]) -> bool:
        if self._stopping:
            log.error("usage_op_after_stop", kind=kind, params=params)
            return False
        self._seq += 1
        self._pending[kind].append(params)
        self._npending += 1
        self._wake.set()
        if self._npending >= BATCH_MAX:
            self._end_window()
        return True

    @property
    def queued(self) -> int:
        """Ops enqueued and not yet taken by the writer."""
        return self._npending

    def open(self, request_id: str, *, tenant: str | None, key_id: str | None, model: str,
             version: str | None, prompt_tokens: int, max_tokens: int | None, priority_class: str | None,
             idempotency_key: str | None, t_arrival: float) -> None:
        """Insert the request's row as 'open' when it is admitted."""
        self._put("open", (request_id, tenant, key_id, model, version, self.node, prompt_tokens, max_tokens,
                           priority_class, idempotency_key, t_arrival, time.time()))

    def progress(self, request_id: str, *, output_tokens: int, cached_tokens: int) -> None:
        """Record tokens so far; a queued, not yet applied update for the same id is replaced."""
        queued = self._progress.get(request_id)
        if queued is not None:
            queued[0], queued[1] = output_tokens, cached_tokens
        elif self._put("progress", params := [output_tokens, cached_tokens, request_id]):
            self._progress[request_id] = params

    def close(self, request_id: str, *, status: str, tenant: str | None, key_id: str | None, model: str | None,
              version: str | None, prompt_tokens: int, cached_tokens: int, output_tokens: int,
              t_arrival: float, t_first_token: float | None, t_end: float, idempotency_key: str | None = None,
              priority_class: str | None = None, cost_multiplier: float = 1.0) -> None:
        """Final numbers: closes the open row, or inserts a closed one if it was never opened.

        The first close wins: a second close of the same id changes nothing (logged)."""
        if status not in STATUSES:
            raise ValueError(f"invalid usage status {status!r}; expected one of {sorted(STATUSES)}")
        cost = self._price(model).cost(prompt_tokens, output_tokens, cost_multiplier)
        self._progress.pop(request_id, None)  # the close carries the final numbers
        self._put("close", (request_id, tenant, key_id, model, version, self.node, status, prompt_tokens,
                            cached_tokens, output_tokens, priority_class, idempotency_key, cost_multiplier,
                            cost, t_arrival, t_first_token, t_end, time.time()))

    def record_request(self, rec: dict[str, Any]) -> None:
        """Telemetry row for one finished request (a RequestRecord.as_log() dict; missing keys → NULL)."""
        vals = list(map(rec.get, _LOG_KEYS))  # on the serving path: C-level lookups, no dict built
        vals[_TS] = vals[_TS] or time.time()
        self._put("record", vals)

    async def flush(self) -> None:
        """Return once everything enqueued before the call is committed."""
        target = self._seq
        if self._applied >= target:
            return
        if self._task is None or self._task.done():
            raise RuntimeError("usage ledger writer is not running")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        self._end_window()
        await fut

    def _end_window(self) -> None:
        if self._window is not None and not self._window.done():
            self._window.set_result(None)

    # -- the writer ------------------------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            if not self._npending:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._npending < BATCH_MAX and not self._stopping and not self._waiters:
                # Fewer, fuller transactions; flush(), stop() or BATCH_MAX ops end the pause early.
                loop = asyncio.get_running_loop()
                self._window = loop.create_future()
                timer = loop.call_later(BATCH_WINDOW_S, self._end_window)
                await self._window
                timer.cancel()
                self._window = None
            # Everything queued is one batch: a swap, so the serving loop pays nothing per op.
            # Under load a batch holds what arrived during the last commit (self-regulating).
            pending, upto = self._pending, self._seq
            self._pending, self._npending = {k: [] for k in _ORDER}, 0
            self._progress.clear()  # a later progress op starts a new queued one
            await self._apply([(kind, rows) for kind, rows in pending.items() if rows])
            self._applied = upto
            still = []
            for target, fut in self._waiters:
                if target <= self._applied:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    still.append((target, fut))
            self._waiters = still

    async def _apply(self, runs: list[tuple[str, list[Any]]]) -> None:
        """Hand one batch (per op kind in _ORDER, its rows) to the writer process and wait
        until it is committed. A writer that dies is replaced and the batch resent: resending
        is safe, because a committed open fails its unique key, a close only closes an open
        row and progress and records overwrite."""
        for attempt in range(WRITER_RESTARTS + 1):
            if self._proc is None or not self._proc.alive():
                self._proc = WriterProcess(str(self.path))
            proc = self._proc
            try:
                for level, event, fields in (await proc.commit(runs))["log"]:
                    getattr(log, level)(event, **fields)
                return
            except (OSError, ValueError, KeyError) as e:  # BrokenPipe and ConnectionError are OSErrors
                log.error("usage_writer_failed", attempt=attempt + 1, error=str(e), pid=proc.pid)
                proc.kill()
                self._proc = None
        for kind, rows in runs:  # last resort: the log line is the record
            for params in rows:
                log.error("usage_op_lost", kind=kind, params=params)

    # -- queries (a separate read-only connection: only committed data) ---------------------
    async def usage(self, tenant: str | None = None, since: float | None = None, until: float | None = None,
                    group_by: list[str] | tuple[str, ...] = ("tenant", "model", "day")) -> list[dict[str, Any]]:
        """Sums per group over rows with since <= t_arrival < until."""
        sql, params = _usage_sql(tenant, since, until, group_by)
        return [dict(r) for r in await self._read(sql, params)]

    async def rows(self, tenant: str | None = None, limit: int = 100, since: float | None = None
                   ) -> list[dict[str, Any]]:
        """Raw usage rows, newest first."""
        where, params = _where(tenant, since, None)
        sql = f"SELECT * FROM usage{where} ORDER BY t_arrival DESC, rowid DESC LIMIT ?"
        return [dict(r) for r in await self._read(sql, [*params, limit])]

    async def find_request(self, rid: str) -> dict[str, Any] | None:
        """One request's telemetry row, by our id or the client's X-Request-ID (the newest): two indexes."""
        rows = await self._read("SELECT * FROM requests WHERE request_id = ?1 OR client_request_id = ?1 "
                                "ORDER BY ts DESC LIMIT 1", [rid])
        return dict(rows[0]) if rows else None

    async def get(self, request_id: str) -> dict[str, Any] | None:
        rows = await self._read("SELECT * FROM usage WHERE request_id = ?", [request_id])
        return dict(rows[0]) if rows else None

    async def _read(self, sql: str, params: list[Any]) -> list[Any]:
        if self._ro is None:
            raise RuntimeError("usage ledger is not started")
        if self._task is not None and not self._task.done():
            await self.flush()  # read your writes: what is still queued is committed first
        async with self._ro.execute(sql, params) as cur:
            return list(await cur.fetchall())


def _where(tenant: str | None, since: float | None, until: float | None) -> tuple[str, list[Any]]:
    conds, params = [], []
    for cond, val in (("tenant = ?", tenant), ("t_arrival >= ?", since), ("t_arrival < ?", until)):
        if val is not None:
            conds.append(cond)
            params.append(val)
    return (" WHERE " + " AND ".join(conds) if conds else ""), params


def _usage_sql(tenant: str | None, since: float | None, until: float | None,
               group_by: list[str] | tuple[str, ...]) -> tuple[str, list[Any]]:
    bad = [g for g in group_by if g not in GROUP_KEYS]
    if bad:
        raise ValueError(f"cannot group by {bad}; choose from {sorted(GROUP_KEYS)}")
    keys = list(dict.fromkeys(group_by))
    where, params = _where(tenant, since, until)
    sel = [f"{GROUP_KEYS[g]} AS {g}" for g in keys]
    sums = ("COUNT(*) AS requests, COALESCE(SUM(prompt_tokens), 0) AS prompt_tokens, "
            "COALESCE(SUM(cached_tokens), 0) AS cached_tokens, COALESCE(SUM(output_tokens), 0) AS output_tokens, "
            "COALESCE(SUM(cost), 0.0) AS cost")
    sql = f"SELECT {', '.join([*sel, sums])} FROM usage{where}"
    if keys:
        order = ", ".join(str(i + 1) for i in range(len(keys)))
        sql += f" GROUP BY {order} ORDER BY {order}"
    return sql, params


def day_start(s: str, end: bool = False) -> float:
    """'YYYY-MM-DD' (UTC) or an ISO datetime → epoch; a bare date as `end` means that whole day."""
    try:
        if len(s) == 10:
            d = dt.datetime.combine(dt.date.fromisoformat(s), dt.time(), dt.UTC)
            return (d + dt.timedelta(days=1 if end else 0)).timestamp()
        d = dt.datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(f"invalid date {s!r}; expected YYYY-MM-DD") from None
    return (d if d.tzinfo else d.replace(tzinfo=dt.UTC)).timestamp()


def usage_report(path: Path, tenant: str | None, since: str | None, until: str | None,
                 group_by: list[str]) -> list[dict[str, Any]]:
    """Ledger.usage() for the CLI, read-only with plain sqlite3; `until` is an inclusive date."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no usage database at {path}")
    sql, params = _usage_sql(tenant, day_start(since) if since else None,
                             day_start(until, end=True) if until else None, group_by)
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql, params)]
    finally:
        conn.close()
