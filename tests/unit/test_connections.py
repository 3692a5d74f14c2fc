"""Slow and greedy clients over raw sockets: a header or body trickled byte by byte is cut off
by a total-time limit (sanic's own timeout restarts with every byte), the connection count is
capped (idle keep-alive connections are reclaimed first), and a client that stops reading an
SSE stream loses it at its deadline: its engine seat, quota and connection are freed."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx

from tests.conftest import LiveServer, async_wait_until, fake_toml

LIMITS = """
[server]
default_deadline_s = 30
header_timeout_s = 0.5
body_timeout_s = 0.5
body_min_rate = 1000000
max_connections = {cap}
"""
BODY = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2}).encode()


def toml(cap: int = 64, step_ms: float = 2.0, max_running: int = 8) -> str:
    base = fake_toml(max_running=max_running, step_ms=step_ms).replace("[server]\ndefault_deadline_s = 30\n", "")
    return LIMITS.format(cap=cap) + base


def request(body: bytes = BODY, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def connect(live: LiveServer, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", live.port))
    return await asyncio.open_connection(sock=sock)


async def trickle_until_closed(live: LiveServer, first: bytes, drip: bytes, limit_s: float = 20.0) -> bytes:
    """Send `first`, then `drip` one byte every 50 ms until the server closes (or `limit_s` passes,
    far beyond every limit configured here); what the server answered."""
    reader, writer = await connect(live)
    writer.write(first)
    got = b""
    end = time.monotonic() + limit_s
    i = 0
    try:
        while time.monotonic() < end:
            with_data = asyncio.ensure_future(reader.read(4096))
            done, _ = await asyncio.wait({with_data}, timeout=0.05)
            if done:
                chunk = with_data.result()
                got += chunk
                if not chunk:
                    return got
                continue
            with_data.cancel()
            writer.write(drip[i % len(drip):i % len(drip) + 1])
            i += 1
            await writer.drain()
    except (ConnectionError, OSError):
        return got + b"<reset>"
    finally:
        writer.close()
    raise AssertionError(f"the server kept a trickling connection open for {limit_s}s (got {got!r})")


async def test_a_trickled_header_is_cut_off(make_server) -> None:
    live = await make_server(toml())
    got = await trickle_until_closed(live, b"POST /v1/completions HTTP/1.1\r\n", b"X-Slow: aaaaaaaa\r\n")
    assert got.startswith(b"HTTP/1.1 408") or got == b"<reset>", got
    assert live.node and _guard(live).cut >= 1


async def test_a_trickled_body_is_cut_off(make_server) -> None:
    live = await make_server(toml())
    head = request(b"x" * 10_000)[: -10_000]
    got = await trickle_until_closed(live, head, b"{")
    assert got.startswith(b"HTTP/1.1 408") or got == b"<reset>", got


async def test_a_silent_connection_is_cut_off(make_server) -> None:
    live = await make_server(toml())
    reader, writer = await connect(live)
    try:
        got = await asyncio.wait_for(reader.read(), 20)  # until the server closes it
    finally:
        writer.close()
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got


async def test_kept_alive_connections_are_not_cut_between_requests(make_server) -> None:
    """Idle time between requests is not a slow request (its first byte starts the clock)."""
    live = await make_server(toml())
    reader, writer = await connect(live)
    for _ in range(2):
        writer.write(request())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        await asyncio.sleep(1.5)  # three header timeouts
    writer.close()
    assert _guard(live).cut == 0


async def test_connections_over_the_cap_get_503_and_idle_ones_are_reclaimed(make_server) -> None:
    live = await make_server(toml(cap=3))
    held = [await connect(live) for _ in range(3)]  # each half-way through a header: not idle
    for _, w in held:
        w.write(b"POST /v1/completions HTTP/1.1\r\n")
    await async_wait_until(lambda: len(_guard(live).live) == 3)
    reader, writer = await connect(live)
    got = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got, got
    assert _guard(live).refused == 1
    for _, w in held:
        w.close()
    await async_wait_until(lambda: not _guard(live).live, timeout=20)
    # Three kept-alive clients fill the cap; a fourth is served by closing an idle one.
    clients = [httpx.AsyncClient(base_url=live.base, timeout=10) for _ in range(4)]
    try:
        for c in clients:
            r = await c.post("/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        for c in clients:
            await c.aclose()
    assert _guard(live).reclaimed >= 1 and _guard(live).refused == 1
    async with httpx.AsyncClient(base_url=live.url) as h:
        text = (await h.get("/metrics")).text
    assert "llmd:connections_refused_total 1.0" in text and "llmd:connections_open " in text


async def test_a_stalled_sse_reader_frees_its_seat_and_its_request_at_the_deadline(make_server, records) -> None:
    """A client that opens a long stream and never reads: once the socket's buffers are full the
    stream's writes block; at its deadline the engine request is aborted, and its last events
    cannot leave either, so the connection is dropped and the request ends (quota settled)."""
    live = await make_server(toml(step_ms=1.0, max_running=8))
    # 8 choices with 20 logprobs a token: about 5 KB a step, so the socket buffers (MBs on loopback) fill.
    body = json.dumps({"model": "fake", "prompt": "stall " * 50, "max_tokens": 4000, "ignore_eos": True,
                       "stream": True, "logprobs": 20, "n": 8}).encode()
    _reader, writer = await connect(live, rcvbuf=4096)
    writer.write(request(body, "X-Request-Timeout: 3\r\n"))
    try:
        assert await async_wait_until(lambda: live.backend().stats.running == 1 or bool(live.backend()._live), 10)
        assert await async_wait_until(lambda: any(r.get("status") == "deadline" for r in records), timeout=20)
        assert not live.backend()._live and not live.runtime().scheduler.running
        rec = next(r for r in records if r.get("status") == "deadline")
        assert 0 < rec["output_tokens"] < 8 * 4000
        assert await async_wait_until(lambda: not _guard(live).live, timeout=10)  # its connection is gone
    finally:
        writer.close()


async def test_many_concurrent_streams_all_complete_and_leave_nothing_behind(make_server) -> None:
    """The soak (tests/reliability/test_soak.py: 2,000 streams for ten minutes) in small: 200 at once."""
    live = await make_server(fake_toml(max_running=200).replace("max_num_seqs = 8", "max_num_seqs = 200"))
    body = {"model": "fake", "prompt": "soak", "max_tokens": 20, "ignore_eos": True, "stream": True}

    async def one(c: httpx.AsyncClient) -> bool:
        async with c.stream("POST", "/completions", json=body) as r:
            text = (await r.aread()).decode()
        return r.status_code == 200 and text.count('"text"') >= 20 and text.endswith("data: [DONE]\n\n")

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=live.base, limits=limits, timeout=60) as c:
        done = await asyncio.gather(*(one(c) for _ in range(200)))
    assert all(done)
    assert not live.runtime().scheduler.running and not live.backend()._live
    assert await async_wait_until(lambda: not _guard(live).live, timeout=10)  # the client closed them all


def _guard(live: LiveServer):  # type: ignore[no-untyped-def]
    return live.server.app.ctx.connections
