"""Clients that behave like the OpenAI SDK, and what counts as goodput.

A refused or failed attempt (408, 409, 429, 5xx, a broken connection before any token) is retried
as the SDK does: at most `max_retries` more times, after the server's Retry-After (or
retry-after-ms) when it gives one of at most 60 s, else after an exponential backoff with jitter,
never past the request's deadline. A misbehaving client ignores all that and resubmits after a
fixed pause, for ever until its deadline. TTFT is counted from the first attempt: that is what
the user waited.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from bench.lib import stats
from bench.lib.goodput_trace import Request
from bench.lib.streams import Stream, stream

RETRYABLE = {408, 409, 429}


@dataclass
class Outcome:
    """One trace request end to end, across its attempts."""

    req: Request
    t0: float
    last: Stream | None = None
    attempts: int = 0
    refusals: int = 0  # attempts answered 429/503 (the server said no, now)
    codes: list[str] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.last is None or self.last.t_first is None else self.last.t_first - self.t0

    @property
    def itl_p95(self) -> float:
        gaps = self.last.gaps() if self.last else []
        return stats.pct(gaps, 95) if gaps else 0.0

    @property
    def completed(self) -> bool:
        return self.last is not None and self.last.ok

    @property
    def tokens(self) -> int:
        s = self.last
        return (s.completion_tokens or len(s.chunks)) if s else 0

    def good(self, ttft_s: float, itl_s: float) -> bool:
        """Completed, with its first token within ttft_s and its own p95 gap within itl_s."""
        t = self.ttft
        return self.completed and t is not None and t <= ttft_s and self.itl_p95 <= itl_s


def _retryable(s: Stream) -> bool:
    if s.t_first is not None:
        return False  # text reached the user: the SDK does not retry a stream
    if s.status is None:
        return bool(s.error and s.error.startswith("client:"))
    return s.status in RETRYABLE or s.status >= 500


def _sdk_wait(s: Stream, retry: int) -> float:
    if s.retry_after is not None and 0 < s.retry_after <= 60:
        return s.retry_after
    return min(0.5 * 2 ** retry, 8.0) * (1 - 0.25 * random.random())


async def call(client: httpx.AsyncClient, url: str, out: Outcome, headers: dict[str, str], deadline_s: float,
               max_retries: int = 2, resubmit_after: float | None = None) -> Outcome:
    """Run `out.req` to the end as a client would, recording into `out` as it goes (so a cancelled
    one keeps what it got); `resubmit_after` set: the misbehaving kind."""
    req, end = out.req, out.t0 + deadline_s
    while True:
        s = Stream(req.tenant, time.monotonic())
        out.attempts += 1
        out.last = await stream(client, url, s, req.body, headers, timeout=max(0.1, end - time.monotonic()))
        if s.status in (429, 503):
            out.refusals += 1
        if s.error:
            out.codes.append(s.error)
        if s.ok or s.timed_out or not _retryable(s):
            return out
        if resubmit_after is not None:
            wait = resubmit_after
        elif out.attempts > max_retries:
            return out
        else:
            wait = _sdk_wait(s, out.attempts - 1)
        if time.monotonic() + wait >= end:
            return out
        await asyncio.sleep(wait)


async def replay(client: httpx.AsyncClient, url: str, reqs: list[Request], headers: dict[str, dict[str, str]],
                 deadlines: dict[str, float], drain_s: float, misbehaving: frozenset[str] = frozenset(),
                 ) -> list[Outcome]:
    """Send every request at its arrival time; wait for them at most `drain_s` after the last arrival,
    then cancel the rest (their clients gave up; what they got is kept)."""
    t_start = time.monotonic()
    outcomes: list[Outcome] = []

    async def one(r: Request) -> None:
        await asyncio.sleep(max(0.0, t_start + r.at - time.monotonic()))
        o = Outcome(r, time.monotonic())
        outcomes.append(o)
        await call(client, url, o, headers[r.tenant], deadlines[r.tenant],
                   resubmit_after=0.2 if r.tenant in misbehaving else None)

    tasks = [asyncio.create_task(one(r)) for r in reqs]
    last = max((r.at for r in reqs), default=0.0)
    await asyncio.wait(tasks, timeout=max(0.0, t_start + last + drain_s - time.monotonic()))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes
