"""Idempotency-Key: one generation per key, however many times the client retries.

A request with a key runs in its own task (a LiveRun) that records every SSE
payload it produces; the HTTP handlers are only its readers. A retry while it
runs attaches and follows the same payloads (from `Last-Event-ID` on); a retry
after it finished replays the stored outcome from SQLite, kept 24 hours
(`server.idempotency_ttl_s`; expired ones are purged while serving); the
same key with another body is a 409. When every reader has gone, the run gets a
short grace period for a reconnect before it is cancelled (and its engine
request aborted). Outcomes of runs that never executed (refused, cancelled, dropped
from the queue at their deadline, engine dead before the first token) are not kept,
so a retry of those runs for real. No HTTP here: `IdempotentRuns.open`
gives the gateway a LiveRun to read, whichever of the three it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from llmd import streaming
from llmd.errors import APIError
from llmd.lifecycle import Lifecycle, RequestLife
from llmd.periodic import Periodic
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.runtime import Job

log = structlog.get_logger("llmd.idempotency")

TTL_S = 24 * 3600.0
PURGE_EVERY_S = 600.0  # expired outcomes are deleted this often while serving (at most the TTL)


@dataclass
class Outcome:
    """A finished request, replayable: an HTTP status with a JSON body, or a stream's payloads."""

    status: int
    headers: dict[str, str]
    body: dict[str, Any] | None = None
    events: list[str] | None = None

    def to_json(self) -> str:
        return json.dumps({"status": self.status, "headers": self.headers, "body": self.body, "events": self.events})

    @classmethod
    def from_json(cls, text: str) -> Outcome:
        d = json.loads(text)
        return cls(d["status"], d["headers"], d.get("body"), d.get("events"))


def request_hash(path: str, body: dict[str, Any]) -> str:
    return hashlib.sha256(f"{path}\n{json.dumps(body, sort_keys=True)}".encode()).hexdigest()


class LiveRun:
    def __init__(self, key: tuple[str, str], req_hash: str, stream: bool) -> None:
        self.key = key
        self.req_hash = req_hash
        self.stream = stream
        self.events: list[str] = []
        self.headers: dict[str, str] = {}
        self.outcome: Outcome | None = None
        self.task: asyncio.Task[None] | None = None
        self.readers = 0
        self.kept = False  # the outcome is stored for replay
        self._changed = asyncio.Event()
        self._grace: asyncio.TimerHandle | None = None

    @property
    def started(self) -> bool:
        return bool(self.events)

    def append(self, payload: str) -> None:
        self.events.append(payload)
        self._changed.set()

    async def append_async(self, payload: str) -> None:
        self.append(payload)

    def finish(self, outcome: Outcome) -> None:
        if outcome.events and not self.events:
            self.events = list(outcome.events)  # a stored stream being replayed
        self.outcome = outcome
        self._changed.set()

    async def _changed_wait(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    async def wait_start(self) -> None:
        """Until the stream has its first payload or the run has ended."""
        while not self.events and self.outcome is None:
            await self._changed_wait()

    async def wait_done(self) -> Outcome:
        while self.outcome is None:
            await self._changed_wait()
        return self.outcome

    async def follow(self, start: int) -> AsyncIterator[tuple[int, str]]:
        """(index, payload) from `start` on, live until the run ends."""
        i = start
        while True:
            while i < len(self.events):
                yield i, self.events[i]
                i += 1
            if self.outcome is not None and i >= len(self.events):
                return
            await self._changed_wait()

    def attach(self) -> None:
        self.readers += 1
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def detach(self, grace_s: float) -> None:
        self.readers -= 1
        if self.readers == 0 and self.outcome is None and self.task is not None:
            self._grace = asyncio.get_running_loop().call_later(grace_s, self.task.cancel)


class IdempotencyStore:
    """Finished runs' outcomes by (tenant, key), kept `ttl_s`."""

    def __init__(self, path: Path, ttl_s: float = TTL_S) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self._db: aiosqlite.Connection | None = None
        # While serving: a node up for weeks keeps only a TTL's worth of outcomes on disk.
        self._purger = Periodic("idempotency-purge", min(ttl_s, PURGE_EVERY_S), self.purge, log,
                                "idempotency_purged", "idempotency_purge_failed", "outcomes")

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = await aiosqlite.connect(self.path)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute(
            "CREATE TABLE IF NOT EXISTS idempotency (tenant TEXT NOT NULL, key TEXT NOT NULL,"
            " request_hash TEXT NOT NULL,"
            " outcome TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (tenant, key))")
        async with self._db.execute("PRAGMA table_info(idempotency)") as cur:
            cols = {row[1] for row in await cur.fetchall()}
        if "request_id" not in cols:  # a store from before the ledger read its finals
            await self._db.execute("ALTER TABLE idempotency ADD COLUMN request_id TEXT")
            await self._db.execute("ALTER TABLE idempotency ADD COLUMN final TEXT")
        await self._db.execute("CREATE INDEX IF NOT EXISTS idempotency_request ON idempotency(request_id)")
        await self.purge()
        self._purger.start()

    async def stop(self) -> None:
        await self._purger.stop()
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def purge(self) -> int:
        """Delete the outcomes past their TTL (lookups ignore them already); how many went."""
        assert self._db is not None
        cur = await self._db.execute("DELETE FROM idempotency WHERE created_at < ?", (time.time() - self.ttl_s,))
        await self._db.commit()
        return cur.rowcount

    async def lookup(self, key: tuple[str, str]) -> tuple[str, Outcome] | None:
        assert self._db is not None
        async with self._db.execute(
            "SELECT request_hash, outcome FROM idempotency WHERE tenant = ? AND key = ? AND created_at >= ?",
            (key[0], key[1], time.time() - self.ttl_s),
        ) as cur:
            row = await cur.fetchone()
        return (row[0], Outcome.from_json(row[1])) if row else None

    async def save(self, key: tuple[str, str], req_hash: str, outcome: Outcome, request_id: str | None = None,
                   final: tuple[str, int, int, int] | None = None) -> None:
        """Keep `outcome`, with the ledger close it comes with (`RequestLife.final`)."""
        assert self._db is not None
        await self._db.execute(
            "INSERT OR REPLACE INTO idempotency (tenant, key, request_hash, outcome, created_at, request_id, final)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key[0], key[1], req_hash, outcome.to_json(), time.time(), request_id,
             json.dumps(final) if final is not None else None))
        await self._db.commit()

    async def finals(self, request_ids: list[str]) -> dict[str, tuple[str, int, int, int]]:
        """The final numbers stored with these requests' outcomes: the ledger's crash recovery
        closes a row with them when the outcome was kept but the close not yet committed."""
        assert self._db is not None
        out: dict[str, tuple[str, int, int, int]] = {}
        for i in range(0, len(request_ids), 500):
            part = request_ids[i:i + 500]
            async with self._db.execute(
                    f"SELECT request_id, final FROM idempotency WHERE final IS NOT NULL AND request_id IN "
                    f"({','.join('?' * len(part))})", part) as cur:
                for rid, final in await cur.fetchall():
                    status, p, c, o = json.loads(final)
                    out[rid] = (str(status), int(p), int(c), int(o))
        return out


def conflict() -> APIError:
    return APIError(409, "This Idempotency-Key was already used with a different request body.",
                    "invalid_request_error", "idempotency_key_reused", "Idempotency-Key")


Admit = Callable[[RequestLife], Awaitable[Job]]  # admits the request under the life it is given


class IdempotentRuns:
    """The live runs by (tenant, key), over the store of finished ones."""

    def __init__(self, store: IdempotencyStore, lifecycle: Lifecycle, grace_s: float = 10.0) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self.grace_s = grace_s
        self.live: dict[tuple[str, str], LiveRun] = {}

    async def stop(self) -> None:
        for run in list(self.live.values()):
            if run.task is not None:
                run.task.cancel()
                with contextlib.suppress(BaseException):
                    await run.task

    async def open(self, life: RequestLife, key: tuple[str, str], req_hash: str,
                   req: ChatRequest | CompletionRequest, admit: Admit) -> LiveRun:
        """The run behind `key`: a live one to attach to, a stored one to replay (`life` is
        dropped: the request it belongs to already has its record), or a new one, to which
        `life` is handed. Raises the 409 of a key reused with another body."""
        run = self.live.get(key)
        if run is not None:
            life.drop()
            if run.req_hash != req_hash:
                raise conflict()
            return run
        run = LiveRun(key, req_hash, req.stream)
        self.live[key] = run  # reserved before any await: concurrent retries attach to it
        try:
            done = await self.store.lookup(key)
        except BaseException:
            self.live.pop(key, None)
            raise
        if done is None:
            owned = life.hand_off()
            run.task = asyncio.get_running_loop().create_task(self._execute(owned, run, req, admit))
            return run
        self.live.pop(key, None)
        life.drop()
        if done[0] != req_hash:
            raise conflict()
        log.info("idempotent_replay", tenant=key[0], request_id=life.record.request_id)
        run.headers = done[1].headers
        run.finish(done[1])
        return run

    async def _execute(self, life: RequestLife, run: LiveRun, req: ChatRequest | CompletionRequest,
                       admit: Admit) -> None:
        """The run itself, detached from any one reader; its life alone meters and records."""
        outcome: Outcome | None = None
        try:
            async with self.lifecycle.own(life):
                outcome = await self._generate(life, run, req, await admit(life))
        except APIError as e:
            outcome = Outcome(e.status, dict(e.headers), e.body(), list(run.events) if run.events else None)
        except asyncio.CancelledError:
            outcome = Outcome(499, {}, APIError(499, "the request was cancelled", "server_error", "cancelled").body(),
                              list(run.events) if run.events else None)
        except Exception:
            log.exception("idempotent_run_failed", request_id=life.record.request_id)
            outcome = Outcome(500, {}, APIError(500, "internal server error", "server_error", "internal_error").body())
        finally:
            if outcome is not None:
                await self._keep(life, run, outcome)
            self.live.pop(run.key, None)
            run.finish(outcome or Outcome(500, {}, None))

    async def _keep(self, life: RequestLife, run: LiveRun, outcome: Outcome) -> None:
        """Store the outcome for replay, once, and only for a run that ran (`RequestLife.used_key`):
        a refused, cancelled or never-run one leaves its key free."""
        if run.kept or not life.used_key:
            return
        run.kept = True
        with contextlib.suppress(Exception):
            await self.store.save(run.key, run.req_hash, outcome, life.record.request_id, life.final())

    async def _generate(self, life: RequestLife, run: LiveRun, req: ChatRequest | CompletionRequest,
                        job: Job) -> Outcome:
        """The outcome is stored, then the ledger's close committed (`RequestLife.finish`), then
        its readers see its end (the body, or `[DONE]`): a client that got a whole response and
        retries replays it, even across a crash, and is billed once; a crash between the two
        commits is closed by the next start with the outcome's numbers (`IdempotencyStore.finals`)."""
        run.headers = dict(job.headers)
        if not req.stream:
            outcome = Outcome(200, run.headers, await streaming.complete(job, req))
            await self._keep(life, run, outcome)
            await life.finish()
            return outcome

        async def keep_stream() -> None:
            await self._keep(life, run, Outcome(200, run.headers, None, [*run.events, streaming.DONE]))

        life.before_commit = keep_stream  # pump finishes the life before it emits [DONE]
        await streaming.pump(job, req, run.append_async)
        return Outcome(200, run.headers, None, list(run.events))
