"""What the dashboard costs the node serving it (issue K: < 1 % of serving throughput with five
viewers polling every 2 s).

`llmd serve` (fake backend) runs in its own process and its CPU is read from /proc, so the
figures are the server's alone, not this load generator's:

1. CPU per served request: a fixed-concurrency load of chat completions (openai SDK).
2. CPU per dashboard poll: the page's own requests, `GET /dashboard/api/overview?since=<last>`
   (what every poll after a viewer's first one asks), timed on the idle node: a poll reads live
   gauges and the ring's cached points, so traffic changes what it returns, not what it does.
   A viewer's first poll also gets up to 10 minutes of points: their JSON is timed on a full ring
   in this process (the server's ring fills only as time passes).
3. The share: 5 viewers x one poll per 2 s x CPU per poll, of one core (the event loop's: the
   node's serving capacity); equivalently, requests the node could not serve / its peak.

Run: .venv/bin/python bench/dashboard.py [--requests 600] [--polls 300] [--shipped-rounds 6] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report
from bench.lib.cputime import cpu_seconds
from bench.lib.dashboard_ab import measure_shipped, shipped_lines
from bench.lib.servers import keys_toml, start_server_process, stop
from llmd.dashboard.ring import INTERVAL_S, KEEP, Ring

VIEWER, TENANT = "sk-llmd-bench-viewer", "sk-llmd-bench-tenant"
TOML = """
[server]
host = "127.0.0.1"
port = {port}
db_path = "{db}"
log_level = "warning"
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 1
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 2.0
""" + keys_toml({"t": TENANT}, dashboard=VIEWER)
VIEWERS, POLL_S = 5, 2.0


async def load(base: str, n: int, concurrency: int) -> None:
    async with openai.AsyncOpenAI(base_url=base, api_key=TENANT, max_retries=0) as client:
        left = iter(range(n))

        async def worker() -> None:
            for _ in left:
                await client.chat.completions.create(model="fake", max_tokens=16,
                                                     messages=[{"role": "user", "content": "hello there"}])

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def polls(url: str, n: int, incremental: bool) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {VIEWER}"}, timeout=30) as c:
        since = None
        for _ in range(n):
            r = await c.get("/dashboard/api/overview", params={"since": since} if since is not None else None)
            r.raise_for_status()
            if incremental:
                since = r.json()["now"]


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    base = url + "/v1"
    await load(base, 100, 8)  # warm: the ring has points, the tables rows
    c0 = cpu_seconds(pid)
    t0 = time.monotonic()
    await load(base, args.requests, 8)
    wall = time.monotonic() - t0
    per_request = (cpu_seconds(pid) - c0) / args.requests
    out = {"per_request": per_request, "rps": args.requests / wall}
    for name, incremental in (("poll_idle", True), ("poll_first", False)):
        c0 = cpu_seconds(pid)
        await polls(url, args.polls, incremental)
        out[name] = (cpu_seconds(pid) - c0) / args.polls
    out["full_ring_json"], out["observe"] = full_ring_json()
    return out


def full_ring_json() -> tuple[float, float]:
    """CPU seconds to serialise a full ring's points (KEEP intervals, two tenants, one model), and
    to account one finished request in it (the serving path's share, whoever watches)."""
    now = [1e9]
    gauges = {"fake": {"queue": {"interactive": 3, "batch": 1}, "running": 8, "seat_limit": 16, "kv_usage": 0.4,
                       "prefix_queries": 0, "prefix_hits": 0, "preemptions": 0}}
    ring = Ring(lambda: now[0], lambda: gauges)
    observe = 0.0
    for i in range(KEEP):
        for t in ("a", "b"):
            rec = {"model": "fake", "tenant": t, "status": "ok", "ttft_s": 0.01 * (i % 7 + 1), "cost": 1e-5,
                   "itl_samples": [0.004] * 16, "output_tokens": 16, "prompt_tokens": 9, "ts": now[0]}
            c0 = time.process_time()
            ring.observe(rec)
            observe += time.process_time() - c0
        now[0] += INTERVAL_S
        ring.tick()
    n = 50
    c0 = time.process_time()
    for _ in range(n):
        json.dumps(ring.since(None))
    return (time.process_time() - c0) / n, observe / (2 * KEEP)


def report_lines(m: dict[str, float], args: argparse.Namespace) -> tuple[list[str], bool]:
    rate = VIEWERS / POLL_S
    share = {k: rate * m[k] for k in ("poll_idle", "poll_first", "full_ring_json")}
    ok = share["poll_idle"] < 0.01
    return [
        "## Dashboard: what polling it costs",
        "",
        f"{report.stamp(cmd=report.command())} `llmd serve` on the",
        "fake backend in its own process, its CPU read from /proc (the load generator's is not counted).",
        f"{VIEWERS} viewers polling every {POLL_S:.0f} s make {rate:.1f} polls/s; a node's serving capacity is",
        "its event loop's one core, so the share of that core the polls take is the share of peak",
        "throughput they cost. A viewer's first poll carries up to 10 minutes of chart points; every",
        "later one only the points after its last (`?since=`), and the points and latency tables are",
        "built once per 2-s interval however many viewers ask.",
        "",
        *report.table(["measure", "server CPU", f"x {rate:.1f}/s = share of one core"], [
            ["one chat completion (16 tokens, 8 concurrent)", f"{m['per_request'] * 1e3:.2f} ms",
             f"({m['rps']:.0f} req/s in this run)"],
            ["one poll (`since`), idle node", f"{m['poll_idle'] * 1e3:.2f} ms", f"{share['poll_idle']:.2%}"],
            ["one poll without `since` (every point this run kept)", f"{m['poll_first'] * 1e3:.2f} ms",
             f"{share['poll_first']:.2%}"],
            [f"+ a full ring's {KEEP} points as JSON (a viewer's first poll after 10 min)",
             f"{m['full_ring_json'] * 1e3:.2f} ms", "once per viewer, not per poll"],
        ]),
        "",
        f"Each finished request also feeds the ring (`Dashboard.observe`, beside the Prometheus metrics), "
        f"watched or not: {m['observe'] * 1e6:.1f} us of CPU each (16 ITL samples; in this process), "
        f"{m['observe'] / m['per_request']:.2%} of a request's server CPU above, and inside it.",
        "",
        f"Verdict (5 viewers every 2 s under 1 % of serving throughput): {report.verdict(ok)}.",
    ], ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--polls", type=int, default=300)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--shipped-rounds", type=int, default=6, help="0: skip the shipped config's A/B")
    ap.add_argument("--round-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        srv = start_server_process(TOML, Path(tmp))
        try:
            m = asyncio.run(measure(srv.url, srv.proc.pid, args))
        finally:
            stop(srv.proc)
    lines, ok = report_lines(m, args)
    if args.shipped_rounds:
        with tempfile.TemporaryDirectory() as tmp:
            ab = measure_shipped(Path(tmp), args.shipped_rounds, args.round_s, args.concurrency)
        lines += ["", "### The shipped config, as throughput", "",
                  *shipped_lines(ab, args.shipped_rounds, args.round_s, args.concurrency)]
    print("\n".join(lines))
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
