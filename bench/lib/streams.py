"""One streamed request as the client saw it, and the figures benches draw from many of them.

Client-side timing is what a user gets: TTFT is the time to the first chunk with content
(not the role-only first delta), ITL the gaps between a stream's later content chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx

from bench.lib import stats


@dataclass
class Stream:
    """Filled in while the request runs, so a cancelled one keeps what it got."""

    tenant: str
    t_send: float
    t_first: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival time of every content chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: int | None = None  # HTTP status
    error: str | None = None  # error code (HTTP error body or an error event in the stream)
    version: str | None = None  # the model version that served it (X-LLMD-Model-Version)
    node: str | None = None  # the cluster node that ran it (X-LLMD-Node)
    done: bool = False  # saw [DONE]
    timed_out: bool = False
    texts: list[str] | None = None  # a list here: every content chunk's text is kept in it too
    retry_after: float | None = None  # a refusal's Retry-After header, seconds

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    def gaps(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunks)]

    def tokens_per_chunk(self) -> float | None:
        if self.completion_tokens and self.chunks:
            return self.completion_tokens / len(self.chunks)
        return None

    @property
    def ok(self) -> bool:
        return self.done and not self.error


def new_client(timeout: float | None = None) -> httpx.AsyncClient:
    """A client sized for floods: thousands of concurrent streams, no read timeout by default."""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                             limits=httpx.Limits(max_connections=4000, max_keepalive_connections=400))


def _error_code(raw: bytes, status: int) -> str:
    try:
        return json.loads(raw)["error"].get("code") or str(status)
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"http_{status}"


def _take(s: Stream, obj: dict[str, Any], chat: bool) -> None:
    """Record one SSE event's usage and content chunks into `s`."""
    if "error" in obj:
        s.error = obj["error"].get("code") or "stream_error"
        return
    if obj.get("usage"):
        s.prompt_tokens = obj["usage"].get("prompt_tokens")
        s.completion_tokens = obj["usage"].get("completion_tokens")
        s.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    for ch in obj.get("choices") or []:
        text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        if text:
            now = time.monotonic()
            if s.t_first is None:
                s.t_first = now
            s.chunks.append(now)
            if s.texts is not None:
                s.texts.append(text)


async def stream(client: httpx.AsyncClient, url: str, s: Stream, body: dict[str, Any],
                 headers: dict[str, str] | None = None, timeout: float | None = None) -> Stream:
    """POST a streaming (chat) completion to `url` and record it into `s`. Never raises except
    CancelledError: a failure is data (`s.error`, `s.timed_out`)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chat = url.endswith("chat/completions")
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers or {}) as r:
                s.status = r.status_code
                s.version = r.headers.get("x-llmd-model-version")
                s.node = r.headers.get("x-llmd-node")
                if r.status_code != 200:
                    s.error = _error_code(await r.aread(), r.status_code)
                    with contextlib.suppress(TypeError, ValueError):
                        s.retry_after = float(r.headers.get("retry-after"))
                    return s
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        s.done = True
                        break
                    _take(s, json.loads(line[6:]), chat)
    except TimeoutError:
        s.timed_out = True
    except httpx.HTTPError as e:
        s.error = f"client:{type(e).__name__}"
    return s


# -- figures over many streams ------------------------------------------------------
def token_weight(results: list[Stream]) -> Callable[[Stream], float]:
    """Tokens per content chunk for a stream: exact from its usage, else the mean over finished streams."""
    ratios = [r for s in results if (r := s.tokens_per_chunk()) is not None]
    default = stats.mean(ratios) if ratios else 1.0
    return lambda s: s.tokens_per_chunk() or default


def output_tokens_between(results: list[Stream], t0: float, t1: float) -> float:
    """Output tokens the streams received in [t0, t1) (chunks weighted by tokens per chunk)."""
    w = token_weight(results)
    return sum(w(s) * sum(1 for t in s.chunks if t0 <= t < t1) for s in results)


def itl_gaps(results: list[Stream], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive content chunks of each stream, both chunks inside [t0, t1)."""
    out: list[float] = []
    for s in results:
        out += [b - a for a, b in pairwise(s.chunks) if t0 <= a and b < t1]
    return out


def statuses(results: list[Stream]) -> str:
    """Streams counted by outcome, most common first: "ok 40, cut 3, rate_limited 2"."""
    c: dict[str, int] = {}
    for s in results:
        key = "timeout" if s.timed_out else (s.error or (str(s.status) if s.status else "cut before response"))
        if s.status == 200 and s.done and not s.error:
            key = "ok"
        elif s.status == 200 and not s.done and not s.error and not s.timed_out:
            key = "cut"  # cancelled by the bench at the end of a run
        c[key] = c.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))
