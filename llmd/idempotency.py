"""Idempotency-Key: one generation per key, however many times the client retries.

A request with a key runs in its own task (a LiveRun) that records every SSE
payload it produces; the HTTP handlers are only its readers. A retry while it
runs attaches and follows the same payloads (from `Last-Event-ID` on); a retry
after it finished replays the stored outcome from SQLite, kept 24 hours; the
same key with another body is a 409. When every reader has gone, the run gets a
short grace period for a reconnect before it is cancelled (and its engine
request aborted). Outcomes of runs that never executed (refused, cancelled) are
not kept, so a retry of those runs for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import aiosqlite

TTL_S = 24 * 3600.0


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
    def from_json(cls, text: str) -> "Outcome":
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
        self._changed = asyncio.Event()
        self._grace: asyncio.TimerHandle | None = None

    @property
    def started(self) -> bool:
        return bool(self.events)

    def append(self, payload: str) -> None:
        self.events.append(payload)
        self._changed.set()

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
    def __init__(self, path: Path, grace_s: float = 10.0, ttl_s: float = TTL_S) -> None:
        self.path = path
        self.grace_s = grace_s
        self.ttl_s = ttl_s
        self.live: dict[tuple[str, str], LiveRun] = {}
        self._db: aiosqlite.Connection | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = await aiosqlite.connect(self.path)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute(
            "CREATE TABLE IF NOT EXISTS idempotency (tenant TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL,"
            " outcome TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (tenant, key))")
        await self._db.execute("DELETE FROM idempotency WHERE created_at < ?", (time.time() - self.ttl_s,))
        await self._db.commit()

    async def stop(self) -> None:
        for run in list(self.live.values()):
            if run.task is not None:
                run.task.cancel()
                with contextlib.suppress(BaseException):
                    await run.task
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def lookup(self, key: tuple[str, str]) -> tuple[str, Outcome] | None:
        assert self._db is not None
        async with self._db.execute(
            "SELECT request_hash, outcome FROM idempotency WHERE tenant = ? AND key = ? AND created_at >= ?",
            (key[0], key[1], time.time() - self.ttl_s),
        ) as cur:
            row = await cur.fetchone()
        return (row[0], Outcome.from_json(row[1])) if row else None

    async def save(self, key: tuple[str, str], req_hash: str, outcome: Outcome) -> None:
        assert self._db is not None
        await self._db.execute(
            "INSERT OR REPLACE INTO idempotency (tenant, key, request_hash, outcome, created_at) VALUES (?, ?, ?, ?, ?)",
            (key[0], key[1], req_hash, outcome.to_json(), time.time()))
        await self._db.commit()
