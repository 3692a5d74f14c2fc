"""Refusal pacing (llmd/policy/pacing.py) and the refusal log's folding (llmd/telemetry.py).

The policy runs on an injected clock; the HTTP test drives a real server (fake backend) with
the openai SDK set to never retry, which is what a client that ignores Retry-After looks like:
a hammering tenant's refusals are held, each still a proper 429, while another tenant's
refusals are answered at once and its requests served."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from bench.lib.servers import keys_toml
from llmd import telemetry
from llmd.errors import AdmissionRefused
from llmd.lifecycle import Lifecycle
from llmd.policy.pacing import RefusalPacer
from llmd.telemetry import LineSampler, RequestRecord
from tests.conftest import fake_toml


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_tenant_under_the_free_rate_is_never_held() -> None:
    clock = Clock()
    p = RefusalPacer(clock, hold_s=1.0, free_per_s=10.0)
    for _ in range(200):  # five a second, for forty seconds: a client honouring Retry-After of 0.2 s
        assert p.refused("calm", 0.2).hold_s == 0.0
        clock.t += 0.2
    assert p.held_total == 0


def test_a_hammering_tenant_is_held_for_its_retry_after_at_most_hold_s() -> None:
    clock = Clock()
    p = RefusalPacer(clock, hold_s=1.0, free_per_s=10.0)
    holds = [p.refused("hog", 0.5).hold_s for _ in range(15)]  # fifteen at once: just over the free rate
    assert holds[:10] == [0.0] * 10 and holds[10:] == [0.5] * 5  # no longer than it was told to wait
    holds = [p.refused("hog", 5.0).hold_s for _ in range(15)]
    assert holds == [1.0] * 15  # ... and no longer than hold_s (hold_max_s is hold_s here)
    assert p.held("hog") == 20 and p.held("calm") == 0
    assert p.refused("calm", 1.0).hold_s == 0.0  # another tenant is not held for the hog's knocking
    for _ in range(20):
        p.released("hog")
    assert p.held("hog") == 0
    clock.t += 5.0  # quiet for a while: its rate has decayed, it is answered at once again
    assert p.refused("hog", 1.0).hold_s == 0.0


def _flood(hold_max_s: float, streams: int = 200, gap_s: float = 0.2, seconds: float = 120.0) -> tuple[float, float]:
    """`streams` clients that resubmit `gap_s` after each refusal is answered, Retry-After ignored:
    (refusals per second, the mean hold) over the last half of `seconds`."""
    import heapq

    clock = Clock()
    p = RefusalPacer(clock, hold_s=1.0, free_per_s=10.0, hold_max_s=hold_max_s)
    knocks = [(100.0 + i * 0.001, i) for i in range(streams)]
    counted, held = 0, 0.0
    while knocks[0][0] < 100.0 + seconds:
        t, i = heapq.heappop(knocks)
        clock.t = t
        hold = p.refused("hog", 1.0).hold_s
        p.released("hog")  # (the holds' count is not what this measures)
        if t >= 100.0 + seconds / 2:
            counted, held = counted + 1, held + hold
        heapq.heappush(knocks, (t + hold + gap_s, i))
    return counted / (seconds / 2), held / counted


def test_the_hold_grows_with_the_knocking_up_to_hold_max_s() -> None:
    fixed_rate, fixed_hold = _flood(hold_max_s=1.0)
    grown_rate, grown_hold = _flood(hold_max_s=10.0)
    assert fixed_hold == 1.0 and 150 < fixed_rate < 175  # one try per 1.2 s per stream
    # hold_s·(k−1) with k = rate/free_per_s settles near 4 s a try: about a quarter of the refusals
    assert 3.0 < grown_hold < 5.5 and grown_rate < 0.3 * fixed_rate
    assert 9.0 < _flood(hold_max_s=10.0, streams=2000)[1] <= 10.0  # never past hold_max_s


def test_a_hammering_tenant_is_demoted_once_and_for_demote_s_after_it_stops() -> None:
    clock = Clock()
    p = RefusalPacer(clock, hold_s=1.0, free_per_s=10.0, demote_s=30.0)
    paces = [p.refused("hog", 1.0) for _ in range(20)]
    assert [x.demote for x in paces] == [False] * 10 + [True] + [False] * 9  # the running ones: once
    assert p.hammering("hog") and not p.hammering("calm")
    clock.t += 29.0
    assert p.hammering("hog")
    clock.t += 1.5
    assert not p.hammering("hog")  # calm for demote_s: its new requests are interactive again
    assert sum(p.refused("hog", 1.0).demote for _ in range(12)) == 1  # and demoted anew if it restarts
    never = RefusalPacer(clock, hold_s=1.0, demote_s=0.0)
    assert not any(never.refused("hog", 1.0).demote for _ in range(50)) and not never.hammering("hog")


def test_holds_are_bounded_per_tenant_and_off_when_hold_s_is_zero() -> None:
    clock = Clock()
    p = RefusalPacer(clock, hold_s=1.0, free_per_s=1.0, max_held=5)
    holds = [p.refused("hog", 1.0).hold_s for _ in range(20)]
    assert sum(h > 0 for h in holds) == 5  # the rest are answered at once: no pile of held connections
    off = RefusalPacer(clock, hold_s=0.0)
    assert all(off.refused("hog", 1.0).hold_s == 0.0 for _ in range(100))


def test_line_sampler_folds_a_keys_lines_into_one_a_second() -> None:
    clock = Clock()
    s = LineSampler(1.0, clock)
    assert s.take(("hog", "c")) == 0
    assert [s.take(("hog", "c")) for _ in range(5)] == [None] * 5
    assert s.take(("calm", "c")) == 0  # keys are apart
    clock.t += 1.0
    assert s.take(("hog", "c")) == 5  # the next line says how many were folded into it


class _Ledger:
    def __init__(self) -> None:
        self.prices: dict[str, Any] = {}

    def close(self, *a: Any, **kw: Any) -> None: ...

    def record_request(self, d: dict[str, Any]) -> None: ...


class _Settler:
    def settle(self, *a: Any) -> None: ...

    def refused(self, tenant: str) -> None: ...


async def test_refusals_log_one_line_a_second_but_every_one_reaches_the_sinks(monkeypatch) -> None:
    lines: list[dict[str, Any]] = []
    monkeypatch.setattr(telemetry.log, "info", lambda event, **kw: lines.append(kw))
    seen: list[dict[str, Any]] = []
    lc = Lifecycle(_Ledger(), _Settler(), seen.append)  # type: ignore[arg-type]
    clock = Clock()
    lc.refusal_lines = LineSampler(1.0, clock)
    refused = AdmissionRefused("concurrency", 429, "busy", "rate_limit_error", "concurrency_limit_exceeded", {})
    for i in range(12):
        clock.t += 0.25 if i == 11 else 0.0
        with pytest.raises(AdmissionRefused):
            async with lc.request(RequestRecord(request_id=f"r{i}", endpoint="/v1/completions", tenant="hog")):
                raise refused
    with pytest.raises(AdmissionRefused):
        async with lc.request(RequestRecord(request_id="other", endpoint="/v1/completions", tenant="calm")):
            raise refused
    assert len(seen) == 13  # metrics and the request log see every refusal
    assert [(d["tenant"], d.get("folded", 0)) for d in lines] == [("hog", 0), ("calm", 0)]
    clock.t += 1.0
    with pytest.raises(AdmissionRefused):
        async with lc.request(RequestRecord(request_id="r12", endpoint="/v1/completions", tenant="hog")):
            raise refused
    assert lines[-1]["tenant"] == "hog" and lines[-1]["folded"] == 11


HOLD_TOML = keys_toml({"hog": "k-hog", "calm": "k-calm"}, max_concurrent=1)


def _client(live: Any, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key=key, max_retries=0)  # ignores Retry-After


async def _metric(live: Any, tenant: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(live.url + "/metrics")).text
    line = [ln for ln in text.splitlines() if ln.startswith(f'llmd:refusals_held_total{{tenant="{tenant}"}}')]
    return float(line[0].split()[-1]) if line else 0.0


async def test_a_tenant_that_ignores_retry_after_is_held_and_others_are_not(make_server) -> None:
    live = await make_server(fake_toml(step_ms=20.0).replace("[server]\n", "[server]\nrefusal_hold_s = 0.5\n")
                             + HOLD_TOML)
    hog, calm = _client(live, "k-hog"), _client(live, "k-calm")
    seat = await hog.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=2000, stream=True)
    await seat.__anext__()  # the hog's one seat is taken

    async def knock() -> openai.RateLimitError:
        with pytest.raises(openai.RateLimitError) as e:
            await hog.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
        return e.value

    refusals = await asyncio.gather(*(knock() for _ in range(30)))
    assert all(r.code == "concurrency_limit_exceeded" and r.response.headers["retry-after"] == "1"
               for r in refusals)  # held or not, each is the same proper 429
    assert 15 <= await _metric(live, "hog") <= 20  # the first ~10 were free, the rest held
    assert live.node.pacer.held("hog") == 0  # every hold was released once answered
    # The calm tenant is served, and its own refusal is not held for the hog's knocking.
    done = await calm.chat.completions.create(model="fake", messages=[{"role": "user", "content": "y"}],
                                              max_tokens=4)
    assert done.choices[0].finish_reason == "length"
    await seat.close()
    assert await _metric(live, "calm") == 0.0


async def test_a_hammering_tenants_running_streams_yield_to_another_tenant_and_still_finish(
        make_server, records) -> None:
    toml = (fake_toml(max_running=2, step_ms=10.0).replace("[server]\n", "[server]\nrefusal_hold_s = 0.2\n")
            .replace("[models.scheduling]\n", "[models.scheduling]\nbatch_seats_with_interactive = 0\n"))
    live = await make_server(toml + keys_toml({"hog": "k-hog", "calm": "k-calm"}, max_concurrent=2))
    hog, calm = _client(live, "k-hog"), _client(live, "k-calm")
    streams = [await hog.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"s{i}"}],
                                                 max_tokens=200, stream=True) for i in range(2)]
    for s in streams:
        await s.__anext__()

    async def knock() -> None:
        with pytest.raises(openai.RateLimitError):
            await hog.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])

    await asyncio.gather(*(knock() for _ in range(20)))
    core = live.runtime().scheduler.core
    assert core.class_running.get("interactive") == 0  # demoted where they run (or queue, having yielded)
    assert core.class_running.get("batch", 0) + core.queue.depth("batch") == 2
    done = await calm.chat.completions.create(model="fake", messages=[{"role": "user", "content": "y"}],
                                              max_tokens=4)
    assert done.choices[0].finish_reason == "length"  # served at once: the hog's seats yielded
    texts = ["".join([c.choices[0].delta.content or "" async for c in s if c.choices]) for s in streams]
    assert all(texts)
    hog_records = [r for r in records if r["tenant"] == "hog" and r["status"] == "ok"]
    assert len(hog_records) == 2 and all("preempted" in (r["marks"] or "") for r in hog_records)
    assert all(r["output_tokens"] == 200 for r in hog_records)  # resumed and finished whole
    raw = await hog.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "z"}], max_tokens=2)
    assert raw.headers["x-llmd-degraded"].startswith("priority_class=batch")  # still demoted: new ones too
