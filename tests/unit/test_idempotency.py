"""Idempotency-Key and Last-Event-ID over HTTP with the fake backend and a real SQLite ledger."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

from llmd.auth import hash_key
from tests.conftest import LiveServer, async_wait_until

KEY = "sk-llmd-idem"
TOML = f"""
[server]
default_deadline_s = 30
resume_grace_s = {{grace}}
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = {{step_ms}}
step_ms_per_seq = 0.0
max_num_seqs = 64
[models.scheduling]
max_running = 250
reserved_seats = 0
[[tenants]]
name = "t"
keys = ["{hash_key(KEY)}"]
tokens_per_minute = {{tpm}}
"""


def toml(grace: float = 2.0, step_ms: float = 2.0, tpm: int = 10_000_000) -> str:
    return TOML.format(grace=grace, step_ms=step_ms, tpm=tpm)


def headers(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "Idempotency-Key": key} | extra


async def usage_rows(live: LiveServer) -> list[dict]:
    await live.node.ledger.flush()
    return await live.node.ledger.rows("t", 1000, None)


def sse(text: str) -> list[tuple[int, str]]:
    out, eid = [], None
    for line in text.splitlines():
        if line.startswith("id: "):
            eid = int(line[4:])
        elif line.startswith("data: "):
            out.append((eid, line[6:]))
    return out


async def test_200_concurrent_retries_make_one_generation_and_one_row(make_server) -> None:
    live = await make_server(toml(step_ms=5))
    body = {"model": "fake", "prompt": "hello", "max_tokens": 40}
    async with httpx.AsyncClient(base_url=live.base, timeout=60, limits=httpx.Limits(max_connections=250)) as h:
        rs = await asyncio.gather(*[h.post("/completions", json=body, headers=headers("k1")) for _ in range(200)])
        assert {r.status_code for r in rs} == {200}
        assert len({r.json()["choices"][0]["text"] for r in rs}) == 1
        assert len({r.json()["id"] for r in rs}) == 1
        # The same for a stream: every reader gets the same events.
        sbody = body | {"stream": True}
        ss = await asyncio.gather(*[h.post("/completions", json=sbody, headers=headers("k2")) for _ in range(200)])
        assert {r.status_code for r in ss} == {200}
        assert len({r.text for r in ss}) == 1 and sse(ss[0].text)[-1][1] == "[DONE]"
    assert len(live.backend().submitted) == 2
    rows = await usage_rows(live)
    assert sorted(r["idempotency_key"] for r in rows) == ["k1", "k2"]
    assert all(r["status"] == "ok" and r["output_tokens"] == 40 for r in rows)


async def test_retry_after_finish_replays_without_generating(make_server) -> None:
    live = await make_server(toml())
    c = openai.AsyncOpenAI(base_url=live.base, api_key=KEY, max_retries=0)
    first = await c.completions.create(model="fake", prompt="hi", max_tokens=9, extra_headers={"Idempotency-Key": "r"})
    again = await c.completions.create(model="fake", prompt="hi", max_tokens=9, extra_headers={"Idempotency-Key": "r"})
    assert again.model_dump() == first.model_dump()
    stream1 = [c.model_dump() async for c in await c.completions.create(
        model="fake", prompt="hi", max_tokens=9, stream=True, extra_headers={"Idempotency-Key": "s"})]
    stream2 = [c.model_dump() async for c in await c.completions.create(
        model="fake", prompt="hi", max_tokens=9, stream=True, extra_headers={"Idempotency-Key": "s"})]
    assert stream1 == stream2 and len(stream1) >= 9
    assert len(live.backend().submitted) == 2
    assert len(await usage_rows(live)) == 2


async def test_same_key_different_body_is_409(make_server) -> None:
    live = await make_server(toml(step_ms=10))
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        running = asyncio.create_task(h.post("/completions", json={"model": "fake", "prompt": "a", "max_tokens": 50},
                                             headers=headers("x")))
        assert await async_wait_until(lambda: len(live.backend().submitted) == 1)
        r = await h.post("/completions", json={"model": "fake", "prompt": "b", "max_tokens": 50}, headers=headers("x"))
        assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"
        assert (await running).status_code == 200
        r = await h.post("/completions", json={"model": "fake", "prompt": "b", "max_tokens": 50}, headers=headers("x"))
        assert r.status_code == 409  # and after it finished, from the stored outcome


async def test_last_event_id_resumes_with_exactly_the_missing_events(make_server) -> None:
    live = await make_server(toml(step_ms=10))
    body = {"model": "fake", "prompt": "story", "max_tokens": 60, "stream": True}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        full = sse((await h.post("/completions", json=body, headers=headers("reference"))).text)
        got: list[tuple[int, str]] = []
        async with h.stream("POST", "/completions", json=body, headers=headers("resume")) as r:
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    eid = int(line[4:])
                elif line.startswith("data: "):
                    got.append((eid, line[6:]))
                    if len(got) == 7:
                        break  # the connection drops here
        await asyncio.sleep(0.1)
        rest = sse((await h.post("/completions", json=body,
                                 headers=headers("resume", **{"Last-Event-ID": str(got[-1][0])}))).text)
    ids = [i for i, _ in got + rest]
    assert ids == list(range(len(ids)))  # no gap, no duplicate
    texts = [json.loads(p)["choices"][0]["text"] for _, p in got + rest if p != "[DONE]"]
    assert texts == [json.loads(p)["choices"][0]["text"] for _, p in full if p != "[DONE]"]
    assert len(live.backend().submitted) == 2  # the reconnect did not start a new generation
    rows = await usage_rows(live)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)


async def test_abandoned_run_is_cancelled_after_the_grace_and_the_key_freed(make_server) -> None:
    live = await make_server(toml(grace=0.3, step_ms=10))
    be = live.backend()
    body = {"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        async with h.stream("POST", "/completions", json=body, headers=headers("gone")) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        assert await async_wait_until(lambda: len(be.aborted) == 1, 5)
        rows = await usage_rows(live)
        assert rows[0]["status"] == "cancelled" and 0 < rows[0]["output_tokens"] < 1000
        # A cancelled run is not replayed: the retry runs for real, and is billed as a new request.
        r = await h.post("/completions", json=body | {"max_tokens": 5}, headers=headers("gone"))
        assert r.status_code == 200 and len(be.submitted) == 2
    rows = await usage_rows(live)
    assert sorted((r["status"], r["idempotency_key"]) for r in rows) == [("cancelled", "gone"), ("ok", "gone")]


async def test_refused_request_does_not_burn_the_key(make_server) -> None:
    live = await make_server(toml(tpm=600))
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 1000},
                         headers=headers("q"))
        assert r.status_code == 429
        # Nothing ran under "q", so nothing is kept: the same key works for the corrected request.
        r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 5}, headers=headers("q"))
        assert r.status_code == 200
    rows = await usage_rows(live)
    assert sorted(r["status"] for r in rows) == ["ok", "shed"]
