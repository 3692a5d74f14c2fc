"""Load shapes and request bodies for the real-engine benches, and the /admin/engines sampler.

Closed loop (`Workers`): a fixed number of streams in flight, each resubmitted as it ends,
the shape of a saturating tenant. Open loop (`open_loop`): requests sent on a schedule
whatever happens to the others, the shape of independent users.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.lib import stats
from bench.lib.engines import Srv
from bench.lib.streams import Stream, itl_gaps, statuses, stream

# Prompts: each request's text differs (its number), so prefix caching cannot serve one from another.
CHAT_PROMPT = "Write a short poem about the sea and the wind. ({i})"
LONG_PROMPT = "Request {i}. Tell me a very long story about a traveller who crosses {place}."
PLACES = ["the mountains", "the desert", "the ocean", "a forest", "the city", "the ice", "a river", "the plains"]
# About 100 tokens (SmolLM2 tokenizer); each request puts a unique line before it.
MEDIUM_TEXT = (
    "Summarise the following notes for a colleague who missed the meeting. The team reviewed the "
    "quarterly roadmap, agreed to move the storage migration to the next sprint, asked for a load "
    "test of the new gateway before launch, and discussed hiring two engineers for the platform "
    "group. Open questions remain about the budget for the second data centre, the on-call rota "
    "during the holidays, and who owns the billing dashboards. Write the summary as a list."
)
Body = Callable[[int], dict[str, Any]]


def chat_body(name: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "messages": [{"role": "user", "content": CHAT_PROMPT.format(i=i)}],
            "max_tokens": max_tokens, "temperature": 0.0}


def long_body(name: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "prompt": LONG_PROMPT.format(i=i, place=PLACES[i % len(PLACES)]),
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}


def medium_body(name: str, tenant: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "prompt": f"Ticket {tenant}-{i}.\n{MEDIUM_TEXT}", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Workers:
    """Closed loop: `n` workers each keep one streamed request in flight, resubmitting as it ends;
    a refused one after its Retry-After (at most 60 s), as the OpenAI SDK waits, else 0.5 s."""

    def __init__(self, client: httpx.AsyncClient, srv: Srv, tenant: str, n: int, path: str,
                 body: Body, headers: dict[str, str], stagger_s: float = 0.0) -> None:
        self.client, self.srv, self.tenant, self.n, self.path = client, srv, tenant, n, path
        self.body, self.headers, self.stagger_s = body, headers, stagger_s
        self.results: list[Stream] = []
        self._count = 0
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(w)) for w in range(self.n)]

    async def _work(self, w: int) -> None:
        if self.stagger_s:
            await asyncio.sleep(self.stagger_s * w / self.n)
        while True:
            i = self._count
            self._count += 1
            s = Stream(self.tenant, time.monotonic())
            self.results.append(s)
            await stream(self.client, self.srv.url + self.path, s, self.body(i), self.headers)
            if not s.done:
                await asyncio.sleep(min(s.retry_after or 0.5, 60.0))  # refused or failed: do not spin

    async def stop(self) -> None:
        await cancel_all(self._tasks)


async def open_loop(client: httpx.AsyncClient, srv: Srv, tenant: str, times: list[float], t0: float, path: str,
                    body: Body, headers: dict[str, str], timeout: float | None,
                    out: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
    """Send request i at t0 + times[i] regardless of the others (results land in `out`)."""
    for i, at in enumerate(times):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        s = Stream(tenant, time.monotonic())
        out.append(s)
        tasks.append(asyncio.create_task(stream(client, srv.url + path, s, body(i), headers, timeout)))


async def warm_up(client: httpx.AsyncClient, srv: Srv, tenant: str, name: str) -> None:
    """A few requests so the first measured ones do not pay for cold start."""
    for i in range(2):
        await stream(client, srv.url + "/v1/chat/completions", Stream(tenant, time.monotonic()),
                     chat_body(name, 900 + i, 8), srv.headers(tenant), 120)
    await asyncio.gather(*[stream(client, srv.url + "/v1/completions", Stream(tenant, time.monotonic()),
                                  long_body(name, 950 + i, 16), srv.headers(tenant), 120) for i in range(8)])


# -- steady chats (bench/fairness.py part a, bench/batch_yield.py) ----------------------
async def chat_series(client: httpx.AsyncClient, srv: Srv, a: argparse.Namespace) -> tuple[list[Stream], float, float]:
    """Tenant "b"'s steady interactive chats (--chat-requests, one every --chat-interval-s);
    returns them and the window (first send, last end)."""
    out: list[Stream] = []
    tasks: list[asyncio.Task[Stream]] = []
    t0 = time.monotonic()
    times = [i * a.chat_interval_s for i in range(a.chat_requests)]
    await open_loop(client, srv, "b", times, t0, "/v1/chat/completions",
                    lambda i: chat_body(a.name, i, a.chat_max_tokens), srv.headers("b", "interactive"),
                    a.chat_timeout_s, out, tasks)
    await asyncio.gather(*tasks)
    return out, t0, time.monotonic()


def chat_stats(out: list[Stream], timeout: float) -> dict[str, Any]:
    """TTFT figures of a chat series; a chat that timed out counts as TTFT = timeout."""
    ttfts = [s.ttft if s.ttft is not None and not s.timed_out else timeout
             for s in out if s.ttft is not None or s.timed_out]
    return {"n": len(out), "ok": sum(1 for s in out if s.ok), "timeouts": sum(s.timed_out for s in out),
            "errors": sum(1 for s in out if s.error), "p50": stats.pct(ttfts, 50), "p95": stats.pct(ttfts, 95),
            "max": max(ttfts) if ttfts else math.nan, "itl_p50_ms": stats.pct(itl_gaps(out, 0, math.inf), 50) * 1000,
            "statuses": statuses(out)}


# -- what llmd's scheduler did --------------------------------------------------------
class AdminSampler:
    """Polls llmd's /admin/engines once a second (seat limit, running, queue, fairness counters)."""

    def __init__(self, client: httpx.AsyncClient, srv: Srv, model: str, every_s: float = 1.0) -> None:
        self.client, self.srv, self.model, self.every_s = client, srv, model, every_s
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.srv.admin_key}"}

    def start(self) -> None:
        if self.srv.kind == "llmd":
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                r = await self.client.get(self.srv.url + "/admin/engines", headers=self._headers())
                self.samples.append({"t": time.monotonic(), **r.json()[self.model]})
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task:
            await cancel_all([self._task])

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [x for x in self.samples if t0 <= x["t"] <= t1]

    async def history(self, since_unix: float) -> list[dict[str, Any]]:
        """Per-step engine records after `since_unix` (wall clock), from /admin/engines?since=."""
        r = await self.client.get(self.srv.url + f"/admin/engines?since={since_unix}", headers=self._headers())
        return r.json()[self.model]["history"]


def preempted(samples: list[dict[str, Any]]) -> str:
    """Preemptions llmd's scheduler made while `samples` were taken (from /admin/engines)."""
    return str(samples[-1]["preempted"] - samples[0]["preempted"]) if len(samples) > 1 else "-"


def seat_summary(samples: list[dict[str, Any]]) -> str:
    """"min-max (mean running N)" of the seat limit over `samples`."""
    if not samples:
        return "-"
    lim = [x["seat_limit"] for x in samples]
    run = [x["scheduler_running"] for x in samples]
    return f"{min(lim)}-{max(lim)} (mean running {stats.mean(run):.0f})"


def seat_trace(samples: list[dict[str, Any]], t0: float, points: int = 40) -> str:
    """'t:seat_limit/running queued' every few samples, t relative to t0 (negative = before the window)."""
    step = max(1, len(samples) // points)
    return ", ".join(f"{x['t'] - t0:.0f}s:{x['seat_limit']}/{x['scheduler_running']} q{sum(x['queued'].values())}"
                     for x in samples[::step])
