"""A stream's frames after the first go straight to the transport (llmd/gateway/frames.py):
sanic's send is used only for the header's frame and the end, the bytes are the same chunked
SSE, and a transport paused by a slow reader holds the stream without losing or reordering a frame."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
from sanic.http import Http, Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from tests.conftest import LiveServer, async_wait_until, fake_toml


def _count(monkeypatch: Any, name: str) -> list[int]:
    calls = [0]
    real = getattr(HttpProtocol, name)

    def counted(self: Any, *a: Any) -> Any:
        calls[0] += 1
        return real(self, *a)
    monkeypatch.setattr(HttpProtocol, name, counted)
    return calls


async def test_only_the_first_frame_and_the_end_go_through_sanics_send(make_server, monkeypatch) -> None:
    sends = _count(monkeypatch, "send")
    live: LiveServer = await make_server(fake_toml(step_ms=0.5))
    c = openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)
    whole = await c.completions.create(model="fake", prompt="frames", max_tokens=40)
    before = sends[0]
    chunks = [ch async for ch in await c.completions.create(model="fake", prompt="frames", max_tokens=40, stream=True,
                                                             stream_options={"include_usage": True})]
    assert sends[0] - before == 2  # the header with the first frame; the terminating chunk
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 40  # every frame after the first arrived, in order


async def test_frames_go_direct_when_sanics_methods_were_rewritten(make_server, monkeypatch) -> None:
    """TOUCHUP, on under `llmd serve`, replaces sanic's Http methods on the class at start."""
    real = Http.http1_response_chunked

    async def rewritten(self: Any, data: bytes, end_stream: bool) -> None:
        await real(self, data, end_stream)
    monkeypatch.setattr(Http, "http1_response_chunked", rewritten)
    sends = _count(monkeypatch, "send")
    live: LiveServer = await make_server(fake_toml(step_ms=0.5))
    c = openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)
    chunks = [ch async for ch in await c.completions.create(model="fake", prompt="frames", max_tokens=40, stream=True)]
    assert sends[0] == 2 and sum(1 for ch in chunks if ch.choices) == 40


def _streaming(live: LiveServer) -> Any:
    """The server's side of the one connection that is sending a response."""
    conns = [c for c in live.server.app.ctx.connections.live if c._conn_http() is not None
             and c._conn_http().stage is Stage.RESPONSE]
    assert len(conns) == 1
    return conns[0]


async def test_a_paused_transport_holds_the_frames_and_loses_none(make_server) -> None:
    """What the transport does when the client reads slower than we write: pause_writing, then
    resume_writing once its buffer drains. Frames wait between the two, and none is lost."""
    live: LiveServer = await make_server(fake_toml(step_ms=1.0))
    c = openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)
    whole = await c.completions.create(model="fake", prompt="slow reader", max_tokens=600)
    got: list[str] = []

    async def read() -> None:
        async for ch in await c.completions.create(model="fake", prompt="slow reader", max_tokens=600, stream=True):
            got.append(ch.choices[0].text)  # noqa: PERF401  # read while it grows
    reader = asyncio.create_task(read())
    try:
        assert await async_wait_until(lambda: len(got) >= 20)
        conn = _streaming(live)
        conn.pause_writing()
        await asyncio.sleep(0.2)  # what was written before the pause arrives
        held = len(got)
        await asyncio.sleep(0.4)  # 400 engine steps: none of their frames is written while paused
        assert len(got) == held < 600
        conn.resume_writing()
        await asyncio.wait_for(reader, 30)
    finally:
        reader.cancel()
    assert "".join(got) == whole.choices[0].text
