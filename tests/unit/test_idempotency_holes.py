"""Idempotency and metering holes (issue I.6): a key reused after its TTL, outcomes that never
ran, expired keys purged while serving, a negative Last-Event-ID, and the usage close committed
before a response's end leaves the server. Real HTTP, the fake backend, a real SQLite ledger."""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest

from llmd import idempotency
from tests.conftest import LiveServer, async_wait_until
from tests.unit.test_idempotency import KEY, headers, sse, toml, usage_rows


def ttl_toml(ttl_s: float, **kw: float) -> str:
    return toml(**kw).replace("[server]\n", f"[server]\nidempotency_ttl_s = {ttl_s}\n", 1)


def committed(live: LiveServer, request_id: str) -> dict | None:
    """The row as it is on disk now (a plain sqlite3 read: nothing queued is flushed first)."""
    with sqlite3.connect(live.node.ledger.path) as c:
        c.row_factory = sqlite3.Row
        row = c.execute("SELECT * FROM usage WHERE request_id = ?", (request_id,)).fetchone()
    return dict(row) if row else None


async def test_key_reused_after_its_ttl_bills_the_new_run(make_server) -> None:
    live = await make_server(ttl_toml(0.3))
    body = {"model": "fake", "prompt": "again", "max_tokens": 4}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        first = await h.post("/completions", json=body, headers=headers("old"))
        await asyncio.sleep(0.5)  # the stored outcome is past its TTL: the key is new again
        second = await h.post("/completions", json=body | {"max_tokens": 6}, headers=headers("old"))
    assert first.status_code == second.status_code == 200 and first.json()["id"] != second.json()["id"]
    assert len(live.backend().submitted) == 2
    rows = await usage_rows(live)
    # Both runs billed, each closed with its own numbers: none left open.
    assert sorted((r["status"], r["output_tokens"], r["idempotency_key"]) for r in rows) == [
        ("ok", 4, "old"), ("ok", 6, "old")]


async def test_dropped_from_the_queue_is_not_replayed(make_server) -> None:
    # With the supervisor on, the queued request would wait for the rebuilt engine and run: a
    # dead engine that stays dead (no restarts) is the outcome that never ran.
    live = await make_server(toml(step_ms=5).replace("max_running = 250", "max_running = 1")
                             .replace("max_model_len = 4096", "max_model_len = 4096\nrestart_attempts = 0"))
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        hog = asyncio.create_task(h.post("/completions", json={"model": "fake", "prompt": "l", "max_tokens": 300},
                                         headers={"Authorization": f"Bearer {KEY}"}))
        assert await async_wait_until(lambda: len(live.backend().submitted) == 1)
        body = {"model": "fake", "prompt": "quick", "max_tokens": 5}
        r = await h.post("/completions", json=body, headers=headers("late", **{"X-Request-Timeout": "0.2"}))
        assert r.status_code == 504 and "not run" in r.json()["error"]["message"]
        assert await live.node.runs.store.lookup(("t", "late")) is None
        await hog
        r = await h.post("/completions", json=body, headers=headers("late"))  # runs anew, not the 504 again
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    rows = {r["status"]: r for r in await usage_rows(live) if r["prompt_tokens"] and r["max_tokens"] == 5}
    assert rows["ok"]["idempotency_key"] == rows["deadline"]["idempotency_key"] == "late"


async def test_engine_dead_before_the_first_token_is_not_replayed(make_server) -> None:
    # With the supervisor on, the queued request would wait for the rebuilt engine and run: a
    # dead engine that stays dead (no restarts) is the outcome that never ran.
    live = await make_server(toml(step_ms=5).replace("max_running = 250", "max_running = 1")
                             .replace("max_model_len = 4096", "max_model_len = 4096\nrestart_attempts = 0"))
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        hog = asyncio.create_task(h.post("/completions", json={"model": "fake", "prompt": "l", "max_tokens": 300},
                                         headers={"Authorization": f"Bearer {KEY}"}))
        assert await async_wait_until(lambda: len(live.backend().submitted) == 1)
        queued = asyncio.create_task(h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 5},
                                            headers=headers("dead")))
        assert await async_wait_until(lambda: len(live.runtime("fake").queue) == 1)
        live.backend().kill()  # admitted and queued: it meets the dead engine when its turn comes
        r = await queued
        await hog
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert await live.node.runs.store.lookup(("t", "dead")) is None  # a retry runs anew
    rows = [row for row in await usage_rows(live) if row["max_tokens"] == 5]
    assert [(row["status"], row["output_tokens"]) for row in rows] == [("error", 0)]


async def test_expired_keys_are_purged_while_serving(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idempotency, "PURGE_EVERY_S", 0.1)
    live = await make_server(ttl_toml(0.2))
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        for k in ("p1", "p2"):
            r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2}, headers=headers(k))
            assert r.status_code == 200

    def stored() -> int:
        with sqlite3.connect(live.node.runs.store.path) as c:
            return int(c.execute("SELECT COUNT(*) FROM idempotency").fetchone()[0])

    assert await async_wait_until(lambda: stored() == 0, 10)  # gone from disk, without a restart


@pytest.mark.parametrize("value", ["-1", "-7", "1.5", "x"])
async def test_a_bad_last_event_id_is_a_400(make_server, value: str) -> None:
    live = await make_server(toml())
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2, "stream": True},
                         headers=headers("neg", **{"Last-Event-ID": value}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "Last-Event-ID"
    assert live.backend().submitted == []


@pytest.mark.parametrize("key", [None, "commit"])
async def test_the_close_is_committed_before_the_response_ends(make_server, key: str | None) -> None:
    """Read the SQLite file itself the moment the response is whole: the row is already closed
    (the writer batches for up to 100 ms, so without the commit-first rule it is still open)."""
    live = await make_server(toml())
    hs = headers(key) if key else {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        for i in range(3):
            r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3},
                             headers=hs | ({"Idempotency-Key": f"{key}{i}"} if key else {}))
            row = committed(live, r.json()["id"].removeprefix("cmpl-"))
            assert row is not None and (row["status"], row["output_tokens"]) == ("ok", 3)
            body = {"model": "fake", "prompt": "y", "max_tokens": 4, "stream": True}
            async with h.stream("POST", "/completions", json=body,
                                headers=hs | ({"Idempotency-Key": f"{key}s{i}"} if key else {})) as s:
                events = sse((await s.aread()).decode())
            assert events[-1][1] == "[DONE]"
            rid = next(p for _, p in events if p.startswith("{"))
            row = committed(live, rid.split('"id":"cmpl-', 1)[1].split('"', 1)[0])
            assert row is not None and (row["status"], row["output_tokens"]) == ("ok", 4)
