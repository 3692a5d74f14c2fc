"""The dashboard's cost on the shipped config.toml (the real engine on SmolLM2), as throughput:
one llmd serves a steady closed-loop load while, in alternate rounds (off, on, on, off, ...: drift
on a shared box favours neither side), 5 viewers poll /dashboard/api/overview every 2 s with the
`since` cursor, as the page does (its cost panel included: a 24-h GPU-cost summary at most every
30 s). Reported: median output tokens/s with and without viewers, the spread of the rounds
without (the box's own noise, which a < 1 % effect sits inside), and the server process's CPU per
second in each."""

from __future__ import annotations

import asyncio
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

from bench.lib import report, stats
from bench.lib.cputime import cpu_seconds
from bench.lib.servers import dump_toml, start_server_process, stop
from bench.lib.streams import Stream, new_client, stream
from llmd.auth import hash_key

SHIPPED = Path(__file__).resolve().parent.parent.parent / "config.toml"
VIEWER_KEY = "sk-bench-dashboard-viewer"
DEMO_KEY = "sk-llmd-demo-change-me"  # config.toml's demo tenant
VIEWERS, POLL_S = 5, 2.0


def shipped_toml() -> str:
    """config.toml as shipped, plus a dashboard key for the viewers, on a free port and a scratch db."""
    data: dict[str, Any] = tomllib.loads(SHIPPED.read_text())
    data["auth"]["dashboard_keys"] = [hash_key(VIEWER_KEY)]
    data["server"]["port"] = 65535  # placeholders: start_server_process fills {port} and {db}
    data["server"]["db_path"] = "@DB@"
    text = dump_toml(data).replace("{", "{{").replace("}", "}}")
    return text.replace("port = 65535", "port = {port}").replace("@DB@", "{db}")


async def _load(url: str, model: str, concurrency: int, until: float, tokens: list[int]) -> None:
    client = new_client(timeout=120)
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a short story about a river."}],
            "max_tokens": 64, "temperature": 0}

    start = time.monotonic()

    async def worker() -> None:
        while time.monotonic() < until:
            s = Stream("demo", time.monotonic())
            await stream(client, url + "/v1/chat/completions", s, body, headers={"Authorization": f"Bearer {DEMO_KEY}"})
            per_chunk = s.tokens_per_chunk() or 1.0  # tokens streamed inside the round, whole requests or not
            tokens.append(round(per_chunk * sum(1 for t in s.chunks if start <= t < until)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()


async def _viewer(url: str, until: float, lat: list[float], offset: float) -> None:
    await asyncio.sleep(offset)
    since: Any = None
    async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {VIEWER_KEY}"}) as h:
        while time.monotonic() < until:
            t = time.monotonic()
            r = await h.get(url + "/dashboard/api/overview", params={} if since is None else {"since": since})
            r.raise_for_status()
            lat.append(time.monotonic() - t)
            since = r.json().get("now", since)
            await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - t)))


async def _rounds(url: str, pid: int, model: str, n: int, round_s: float, concurrency: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    lat: list[float] = []
    await _load(url, model, concurrency, time.monotonic() + 15, [])  # warm-up
    for mode in (["off", "on", "on", "off"] * n)[:n]:
        tokens: list[int] = []
        until = time.monotonic() + round_s
        c0, t0 = cpu_seconds(pid), time.monotonic()
        jobs = [_load(url, model, concurrency, until, tokens)]
        if mode == "on":
            jobs += [_viewer(url, until, lat, i * POLL_S / VIEWERS) for i in range(VIEWERS)]
        await asyncio.gather(*jobs)
        out[mode].append(sum(tokens) / round_s)
        cpu[mode].append((cpu_seconds(pid) - c0) / (time.monotonic() - t0))
        print(f"  {mode}: {out[mode][-1]:.1f} out tok/s, server CPU {cpu[mode][-1]:.2f} s/s", flush=True)
    return {"out": out, "cpu": cpu, "lat": lat}


def measure_shipped(tmp: Path, rounds: int, round_s: float, concurrency: int) -> dict[str, Any]:
    srv = start_server_process(shipped_toml(), tmp, ready_timeout=600)
    try:
        model = tomllib.loads(SHIPPED.read_text())["models"][0]["name"]
        return asyncio.run(_rounds(srv.url, srv.proc.pid, model, rounds, round_s, concurrency))
    finally:
        stop(srv.proc)


def shipped_lines(r: dict[str, Any], rounds: int, round_s: float, concurrency: int) -> list[str]:
    off, on = stats.median(r["out"]["off"]), stats.median(r["out"]["on"])
    lo, hi = min(r["out"]["off"]), max(r["out"]["off"])
    lat = r["lat"]
    rows = [["without viewers", f"{off:.1f}", f"{lo:.1f}-{hi:.1f}", f"{stats.median(r['cpu']['off']):.2f}", "-"],
            ["5 viewers every 2 s", f"{on:.1f}", f"{min(r['out']['on']):.1f}-{max(r['out']['on']):.1f}",
             f"{stats.median(r['cpu']['on']):.2f}",
             f"{stats.pct(lat, 50) * 1e3:.1f} / {stats.pct(lat, 95) * 1e3:.1f}" if lat else "-"]]
    return [f"config.toml as shipped (the real engine, SmolLM2 on this CPU), {concurrency} concurrent streamed chat "
            f"completions of 64 tokens; {rounds} rounds of {round_s:.0f} s alternating without and with 5 viewers "
            "polling the overview every 2 s (as the page does, its 24-h cost panel included).", "",
            *report.table(["rounds", "median out tok/s", "range", "server CPU s/s", "poll p50 / p95 ms"], rows), "",
            f"With viewers / without: **{on / off:.3f}** (the rounds without viewers alone span "
            f"{(hi - lo) / off:.1%} of their median: the box's noise; the CPU share above is the precise figure)."]
