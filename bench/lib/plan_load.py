"""The load the planner's end-to-end check puts on llmd: the request mix as a Trace, capacity
(closed loop: the throughput at which a queue only grows), and one open-loop load point.

The mix: two tenants (60/40), a quarter of each tenant's requests batch class, prompts
lognormal (mean 192 tokens, CV 0.5), outputs lognormal (mean 64, CV 0.4), half the requests
starting with one of 4 shared 96-token system prompts. Poisson arrivals.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.lib.cputime import cpu_seconds
from bench.lib.e2e_stats import Measured, summarise
from bench.lib.engines import Srv
from bench.lib.load import AdminSampler, seat_summary
from bench.lib.replayer import Sent, clients, prompt_ids, prose, replay, send_one
from llmd.plan.sim.trace import CLASSES, Trace

MIX = {"workload": "constant", "prompt": "lognormal:192:0.5:1024", "output": "lognormal:64:0.4:160",
       "tenants": "a:0.6:0.25,b:0.4:0.25", "prefixes": "4:96:1.0:0.5"}


def mix_trace(rate: float, duration: float, seed: int) -> Trace:
    """The mix at `rate` req/s for `duration` s: the workload generator's (llmd plan sim's
    own) when it is there, else the same mix drawn here."""
    try:
        from llmd.plan.sim.workload import generate
        from llmd.plan.sim.workload_spec import parse_workload  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return _fallback_trace(rate, duration, seed)
    return generate(parse_workload({**MIX, "rate": rate, "duration": duration, "seed": seed}))  # type: ignore[no-any-return,unused-ignore]


def _lognormal(rng: np.random.Generator, mean: float, cv: float, cap: int, n: int) -> np.ndarray:
    sigma = math.sqrt(math.log1p(cv * cv))
    x = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)
    return np.clip(np.rint(x), 1, cap).astype(np.int32)


def _fallback_trace(rate: float, duration: float, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, int(rate * duration * 1.5) + 16))
    t = t[t < duration]
    n = len(t)
    group = np.where(rng.random(n) < 0.5, rng.integers(0, 4, n), -1).astype(np.int32)
    prompt = _lognormal(rng, 192, 0.5, 1024, n)
    return Trace(t=t, tenant=(rng.random(n) >= 0.6).astype(np.int32), klass=(rng.random(n) < 0.25).astype(np.int8),
                 prompt_tokens=np.where(group >= 0, np.maximum(prompt, 97), prompt).astype(np.int32),
                 output_tokens=_lognormal(rng, 64, 0.4, 160, n), prefix=group,
                 prefix_tokens=np.where(group >= 0, 96, 0).astype(np.int32), tenants=("a", "b"))


@dataclass
class Capacity:
    """Closed loop at `concurrency` streams: what the server sustained."""

    req_s: float  # the mix's requests per second (output tok/s over its mean output length)
    tok_s: float  # output tokens per second delivered
    completed: int
    concurrency: int
    seconds: float
    seats: str  # the scheduler's seat limit over the window (/admin/engines)
    queued_max: int
    tokens_per_chunk: float = 0.0  # output tokens per streamed chunk (> 1: llmd held text back and sent it together)
    refused: int = 0  # requests answered with an error (llmd sheds a long overload)

    def describe(self) -> str:
        return (f"{self.req_s:.2f} req/s ({self.tok_s:.1f} output tok/s), {self.completed} completed in "
                f"{self.seconds:.0f} s at {self.concurrency} streams; seat limit {self.seats}, queue up to "
                f"{self.queued_max}; {self.tokens_per_chunk:.2f} tokens per chunk, {self.refused} refused")


async def capacity(srv: Srv, model: str, trace: Trace, concurrency: int, seconds: float,
                   warmup_s: float, sent: list[Sent] | None = None,
                   steps: list[list[float]] | None = None) -> Capacity:
    """Keep `concurrency` of the trace's requests in flight (the next one as one ends) for
    `seconds`; throughput counted after `warmup_s`. With more streams than seats the scheduler
    queues the rest: the engine runs as full as llmd lets it, the definition of capacity.
    `sent` gets every request, `steps` the engine's own steps (`_steps`)."""
    ids = prompt_ids(trace, seed=11, corpus=prose())
    by_tenant = clients(srv.url + "/v1", srv.keys, 600.0)
    order = itertools.count()
    out: list[Sent] = sent if sent is not None else []  # every request, for a caller that keeps them
    t0, unix0 = time.monotonic(), time.time()
    stop = t0 + seconds

    async def worker() -> None:
        while time.monotonic() < stop:
            i = next(order) % len(trace)
            tenant = trace.tenants[int(trace.tenant[i])]
            s = Sent(i, tenant, CLASSES[int(trace.klass[i])], time.monotonic())
            out.append(s)
            await send_one(by_tenant[tenant], model, ids[i], int(trace.output_tokens[i]), s)
            if s.status != "ok":
                await asyncio.sleep(0.5)  # refused (llmd sheds a long overload): do not spin

    async with httpx.AsyncClient(timeout=30) as h:
        sampler = AdminSampler(h, srv, model)
        sampler.start()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sampler.stop()
        if steps is not None and srv.kind == "llmd":  # the engine's own steps, for the caller to keep
            steps += _steps(await sampler.history(unix0), unix0)
    for c in by_tenant.values():
        await c.close()
    lo, hi = t0 + warmup_s, stop
    tokens = sum(n for s in out for at, n in zip(s.chunks, s.tokens, strict=True) if lo <= at < hi)
    tok_s = tokens / (hi - lo)
    window = sampler.between(lo, hi)
    return Capacity(tok_s / float(np.mean(trace.output_tokens)), tok_s,
                    sum(1 for s in out if s.status == "ok" and s.t_end and lo <= s.t_end < hi), concurrency,
                    hi - lo, seat_summary(window), max((sum(x["queued"].values()) for x in window), default=0),
                    sum(s.output_tokens for s in out) / max(1, sum(len(s.chunks) for s in out)),
                    sum(1 for s in out if s.status not in ("ok", "sent")))


@dataclass
class Point:
    """One open-loop load point as measured."""

    engine: str  # real | fake
    load: float  # fraction of capacity
    rate: float  # req/s
    seed: int
    measured: Measured
    client_cpu: float  # the client's CPU seconds per second of the run (1.0: a whole core)
    server_cpu: float  # llmd's process (not its engine core process) likewise
    extra: dict[str, Any] = field(default_factory=dict)


async def load_point(srv: Srv, pid: int, model: str, engine: str, load: float, rate: float, trace: Trace,
                     seed: int, warmup_s: float, drain_s: float) -> tuple[Point, list[Sent], float]:
    """Replay `trace` open loop and summarise it; requests still running `drain_s` after the last
    arrival are cut (counted by status, left out of the percentiles)."""
    cpu0, srv0, w0, unix0 = time.process_time(), cpu_seconds(pid), time.monotonic(), time.time()
    async with httpx.AsyncClient(timeout=30) as h:
        sampler = AdminSampler(h, srv, model, every_s=0.5)  # the seats over time, for looking into a figure
        sampler.start()
        sent, t0 = await replay(srv.url + "/v1", model, trace, srv.keys, seed=seed, drain_s=drain_s)
        await sampler.stop()
        steps = await sampler.history(unix0) if srv.kind == "llmd" else []  # the engine's own steps
    wall = time.monotonic() - w0
    m = summarise(sent, t0, warmup_s, trace.duration)
    seats = [{"t": round(x["t"] - t0, 3), "limit": x["seat_limit"], "running": x.get("class_running", {}),
              "queued": x["queued"], "itl": x.get("itl_controller")} for x in sampler.samples]
    server = {"seats": seats, "steps": _steps(steps, unix0 + (t0 - w0)),
              "requests": await ledger_timings(srv.db, unix0, len(sent)) if srv.db else {}}
    return Point(engine, load, rate, seed, m, (time.process_time() - cpu0) / wall,
                 (cpu_seconds(pid) - srv0) / wall, server), sent, t0


def _steps(history: list[dict[str, Any]], t0_unix: float) -> list[list[float]]:
    """[t from the replay's start, running, prefill tokens, duration] of each engine step."""
    return [[round(r["t"] - t0_unix, 4), r["running"], r.get("prefill_tokens", 0), round(r.get("duration", 0.0), 5)]
            for r in history]


async def ledger_timings(db: Path, since_unix: float, expect: int, wait_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """llmd's own account of each replayed request since `since_unix` (its `requests` table, keyed
    by the replay's X-Request-ID): time queued (arrival to dispatch), prefill (dispatch to the
    engine's first token), TTFT as llmd sent it, and events. The client's TTFT minus these splits
    a gap into HTTP, queue, engine and delivery. Rows are written behind the responses: waits up
    to `wait_s` for `expect` of them."""
    sql = ("SELECT client_request_id, ts, queue_s, prefill_s, ttft_s, total_s, cached_tokens, preemptions, marks "
           "FROM requests WHERE ts >= ? AND client_request_id LIKE 'replay-%'")
    rows: list[tuple[Any, ...]] = []
    for _ in range(int(wait_s / 0.25) + 1):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            rows = c.execute(sql, (since_unix,)).fetchall()
        if len(rows) >= expect:
            break
        await asyncio.sleep(0.25)
    keys = ("ts", "queue_s", "prefill_s", "ttft_s", "total_s", "cached", "preemptions", "marks")
    return {r[0].removeprefix("replay-"): dict(zip(keys, r[1:], strict=True)) for r in rows}


def dump(path: Path, sent: list[Sent], t0: float) -> None:
    """Every request of a run as the client saw it (times from t0), for looking into a figure."""
    rows = [{"i": s.i, "tenant": s.tenant, "class": s.klass, "status": s.status, "sched": round(s.t_sched - t0, 4),
             "late": round(s.t_send - s.t_sched, 4), "ttft": s.ttft, "e2e": s.e2e, "prompt": s.prompt_tokens,
             "tokens": s.output_tokens, "chunks": len(s.chunks), "max_gap": max(s.gaps(), default=None),
             "at": [round(c - t0, 4) for c in s.chunks], "n": list(s.tokens)} for s in sent]
    path.write_text(json.dumps(rows) + "\n")


def undump(rows: list[dict[str, Any]]) -> list[Sent]:
    """The requests `dump` wrote (its rows, parsed), times from the run's t0 (0 here; chunk
    times to 0.1 ms), so the measured figures can be summarised again from what the client saw."""
    out = []
    for r in rows:
        s = Sent(r["i"], r["tenant"], r["class"], r["sched"], r["sched"] + r["late"], list(r["at"]), list(r["n"]),
                 prompt_tokens=r["prompt"], status=r["status"])
        if r["ttft"] is not None and s.chunks:
            s.t_send = s.chunks[0] - r["ttft"]  # the TTFT as measured, not as rounded
        s.t_end = None if r["e2e"] is None else s.t_send + r["e2e"]
        out.append(s)
    return out
