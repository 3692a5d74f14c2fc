"""Hostile clients against `llmd serve` (fake backend, a subprocess): what they cost the server.

(a) slowloris: N raw sockets (default 1,000) that trickle a header, trickle a body, or send
    nothing, one byte every --drip seconds. Each must be closed by the server within its limit
    (server.header_timeout_s from its first byte; a body: + body_timeout_s), however it drips;
    the server's RSS must grow by < 50 MiB; a normal request every half second meanwhile
    must be served.
(b) stalled readers: M streams (default 256) asked for (20 logprobs a token, so their sockets'
    buffers fill) and never read, with deadline --deadline. Every engine seat must be free
    within deadline + 1 s of the last one sent; each request's record says whether its last
    events could not even leave (its writes were blocked: cut after streaming.TAIL_S).

    .venv/bin/python bench/hostile.py                 # writes docs/benchmarks.md, "## Hostile clients"
    .venv/bin/python bench/hostile.py --sockets 100 --stalled 32 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

import httpx

from bench.lib import report, stats
from bench.lib.hostile_clients import RssSampler, Staller, rss_mib, stall, trickle_many
from bench.lib.servers import ServerProcess, start_server_process, stop
from llmd.streaming import TAIL_S

SECTION = "## Hostile clients (bench/hostile.py)"
RSS_BUDGET_MIB = 50.0
SEAT_SLACK_S = 1.0
TOML = """
[server]
host = "127.0.0.1"
port = {port}
db_path = "{db}"
default_deadline_s = 60
header_timeout_s = HEADER
body_timeout_s = BODY
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 100000
default_max_tokens = 16
[models.engine]
max_model_len = 131072
[models.fake]
step_ms = 2
step_ms_per_seq = 0.0
max_num_seqs = SEATS
[models.scheduling]
max_running = SEATS
"""


@dataclass
class Slowloris:
    held: dict[str, list[float]]  # kind -> seconds each socket was held open by the server
    open_left: int  # sockets the server never closed
    answered_408: int
    rss_base: float
    rss_peak: float
    rss_after: float
    probes: list[tuple[int, float]]  # (status, seconds) of the normal requests meanwhile
    limits: dict[str, float]


@dataclass
class Stalled:
    n: int
    deadline_s: float
    peak_running: int
    freed_after_s: float | None  # after the last one was sent, until no seat was taken
    ended: int  # request records with status deadline
    blocked: int  # of them, ended by the tail cut (their writes could not leave)
    other: dict[str, int]
    over_s: list[float]  # each request's end (seat, quota, connection free) after its own deadline


def serve(args: argparse.Namespace, tmp: Path) -> ServerProcess:
    toml = (TOML.replace("HEADER", str(args.header_timeout)).replace("BODY", str(args.body_timeout))
            .replace("SEATS", str(max(args.stalled, 8))))
    return start_server_process(toml, tmp, ready_timeout=60)


async def _probe(url: str, out: list[tuple[int, float]], stop_at: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        while not stop_at.is_set():
            t0 = time.monotonic()
            try:
                r = await c.post(url + "/v1/completions", json={"model": "fake", "prompt": "probe", "max_tokens": 4})
                out.append((r.status_code, time.monotonic() - t0))
            except httpx.HTTPError:
                out.append((0, time.monotonic() - t0))
            await asyncio.sleep(0.5)


async def slowloris(srv: ServerProcess, n: int, drip_s: float, header_s: float, body_s: float) -> Slowloris:
    port = int(srv.url.rsplit(":", 1)[1])
    pid = srv.proc.pid
    base = rss_mib(pid)
    sampler = RssSampler(pid).start()
    probes: list[tuple[int, float]] = []
    done = asyncio.Event()
    probe = asyncio.ensure_future(_probe(srv.url, probes, done))
    give_up = 4 * (header_s + body_s) + 30
    clients = await trickle_many(port, n, drip_s, give_up)
    done.set()
    await probe
    await asyncio.sleep(2)
    await sampler.stop()
    held: dict[str, list[float]] = {}
    for t in clients:
        if t.held_s is not None:
            held.setdefault(t.kind, []).append(t.held_s)
    limits = {"header": header_s, "silent": header_s, "body": header_s + body_s}
    return Slowloris(held, sum(t.held_s is None for t in clients), sum(t.answer.startswith(b"HTTP/1.1 408")
                                                                        for t in clients),
                     base, sampler.peak, rss_mib(pid), probes, limits)


async def _running(c: httpx.AsyncClient, url: str) -> int:
    return int((await c.get(url + "/admin/engines")).json()["fake"]["scheduler_running"])


async def stalled(srv: ServerProcess, n: int, deadline_s: float) -> Stalled:
    body: dict[str, Any] = {"model": "fake", "max_tokens": 100000, "ignore_eos": True, "stream": True,
                            "logprobs": 20}
    port = int(srv.url.rsplit(":", 1)[1])
    lines_before = len(srv.log_lines())
    async with httpx.AsyncClient(timeout=10) as c:
        held: list[Staller] = [await stall(port, body | {"prompt": f"stall {i}"}, deadline_s) for i in range(n)]
        last_sent, peak, freed = held[-1].t_sent, 0, None
        while time.monotonic() < last_sent + deadline_s + 30:
            running = await _running(c, srv.url)
            peak = max(peak, running)
            if running == 0 and time.monotonic() > last_sent + 0.5:
                freed = time.monotonic() - last_sent
                break
            await asyncio.sleep(0.05)
    await asyncio.sleep(3)  # the records of the last ones reach the log
    recs = [_record(line) for line in srv.log_lines()[lines_before:]]
    recs = [r for r in recs if r is not None]
    for h in held:
        if h.writer is not None:
            h.writer.close()
    ended = [r for r in recs if r["status"] == "deadline"]
    other: dict[str, int] = {}
    for r in recs:
        if r["status"] != "deadline":
            other[r["status"]] = other.get(r["status"], 0) + 1
    over = [r["total_time_s"] - r["deadline_s"] for r in ended]
    return Stalled(n, deadline_s, peak, freed, len(ended), sum(o > TAIL_S * 0.8 for o in over), other, over)


_FIELD = {k: re.compile(rf'\b{k}["=:\s]+"?([A-Za-z0-9_.\-]+)') for k in ("status", "total_time_s", "deadline_s")}


def _record(line: str) -> dict[str, Any] | None:
    """A request's log line (key=value or JSON), as status and times; None for other lines."""
    if "request" not in line or "total_time_s" not in line or "/v1/completions" not in line:
        return None
    got = {k: rx.search(line) for k, rx in _FIELD.items()}
    if any(m is None for m in got.values()):
        return None
    return {"status": got["status"].group(1), "total_time_s": float(got["total_time_s"].group(1)),  # type: ignore[union-attr]
            "deadline_s": float(got["deadline_s"].group(1))}  # type: ignore[union-attr]


def verdicts(s: Slowloris, st: Stalled) -> list[tuple[str, bool]]:
    return slowloris_verdicts(s) + stalled_verdicts(st)


def slowloris_verdicts(s: Slowloris) -> list[tuple[str, bool]]:
    worst = max((max(v) - s.limits[k] for k, v in s.held.items()), default=float("inf"))
    return [
        (f"every trickling socket closed within its limit (+{SEAT_SLACK_S:.0f} s for the 0.25 s check and a "
         f"loaded box; worst {worst:+.2f} s)", s.open_left == 0 and worst <= SEAT_SLACK_S),
        (f"server RSS growth under the trickle < {RSS_BUDGET_MIB:.0f} MiB ({s.rss_peak - s.rss_base:.1f} MiB)",
         s.rss_peak - s.rss_base < RSS_BUDGET_MIB),
        ("normal requests served meanwhile", bool(s.probes) and all(code == 200 for code, _ in s.probes)),
    ]


def stalled_verdicts(st: Stalled) -> list[tuple[str, bool]]:
    return [
        (f"{st.n} stalled readers' seats free within deadline + {SEAT_SLACK_S:.0f} s of each one's arrival "
         f"(its request ended, seat, quota and connection free: worst "
         f"{report.num(max(st.over_s, default=None), 2)} s after its deadline)",
         bool(st.over_s) and max(st.over_s) <= SEAT_SLACK_S),
        (f"every stalled request ended as deadline ({st.ended}/{st.n})", st.ended == st.n),
    ]


def section(args: argparse.Namespace, s: Slowloris, st: Stalled, took: float) -> list[str]:
    rows = [[k, len(v), report.num(s.limits[k], 1), report.num(stats.median(v), 2), report.num(max(v), 2)]
            for k, v in sorted(s.held.items())]
    probe_s = [t for code, t in s.probes if code == 200]
    return [SECTION, "", report.stamp(took), "",
            f"`llmd serve` on the fake backend; header_timeout_s {args.header_timeout}, body_timeout_s "
            f"{args.body_timeout}; {args.sockets} trickling sockets (a byte every {args.drip} s), then "
            f"{args.stalled} stalled readers.", "",
            *report.table(["trickling", "sockets", "limit s", "held p50 s", "held max s"], rows), "",
            f"- answered 408 before the close: {s.answered_408}; never closed: {s.open_left}",
            f"- server RSS: {s.rss_base:.1f} MiB before, {s.rss_peak:.1f} MiB peak, {s.rss_after:.1f} MiB after",
            f"- normal requests meanwhile: {len(s.probes)}, {sum(c == 200 for c, _ in s.probes)} answered 200, "
            f"p50 {report.num(stats.median(probe_s) * 1000, 0)} ms, max "
            f"{report.num(max(probe_s, default=float('nan')) * 1000, 0)} ms",
            f"- stalled readers: peak {st.peak_running} seats taken; each request ended p50 "
            f"{report.num(stats.median(st.over_s), 2)} s, max {report.num(max(st.over_s, default=None), 2)} s after "
            f"its deadline ({st.deadline_s} s from its arrival at the server); seen from this client, every seat "
            f"was free {report.num(st.freed_after_s, 2)} s after the last request was sent (the server reads a "
            f"request later than it is sent when busy); {st.ended} ended as deadline, {st.blocked} of them with "
            f"their last events blocked (cut after {TAIL_S} s), the rest buffered by the sockets; other outcomes: "
            f"{st.other or 'none'}", "",
            *report.verdict_lines(verdicts(s, st))]


async def main_async(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        srv = serve(args, Path(tmp))
        try:
            s = await slowloris(srv, args.sockets, args.drip, args.header_timeout, args.body_timeout)
            st = await stalled(srv, args.stalled, args.deadline)
        finally:
            stop(srv.proc)
    lines = section(args, s, st, time.monotonic() - t0)
    print("\n".join(lines))
    if args.write:
        report.write_section(report.DOC, lines)
    return 0 if all(ok for _, ok in verdicts(s, st)) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sockets", type=int, default=1000)
    p.add_argument("--stalled", type=int, default=256)
    p.add_argument("--drip", type=float, default=0.5, help="seconds between a trickler's bytes")
    p.add_argument("--header-timeout", type=float, default=5.0)
    p.add_argument("--body-timeout", type=float, default=5.0)
    p.add_argument("--deadline", type=float, default=8.0, help="the stalled streams' X-Request-Timeout")
    p.add_argument("--no-write", dest="write", action="store_false")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
