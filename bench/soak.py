"""A long run of many concurrent streams through `llmd serve` (fake backend, a subprocess):
every stream must complete, the server's memory must stay flat, and the inter-token latency
clients see through the gateway is reported.

C streams (default 2,000) are kept in flight for --seconds (default 600): each asks for
--tokens tokens (ignore_eos) and is followed by another as soon as it ends, on the same
kept-alive connection; at the end the ones running finish. The client reads the streams over
raw sockets (uvloop; httpx cost about as much CPU per chunk as the server, and one httpx
process fell seconds behind 2,000 streams on this shared box, which is what its ITL then
measured). The fake engine takes --step-ms per step whatever the batch (with 25% more seats
than streams, so none waits for one), so ITL above it is the gateway's and this client's
(both share the box). Its KV cache is a fixed pool, as a real engine's is: room for every seat's
stream twice over (the finished ones' blocks stay cached until evicted). Left unset, the fake
sizes it for every seat at max_model_len (1.28M blocks here) and its prefix cache keeps every
finished stream's blocks for the whole run: memory a real engine holds from its start.
The server's RSS is sampled every 5 s; its growth is the least-squares
slope after the warm-up (the first fifth).

    .venv/bin/python bench/soak.py                  # writes docs/benchmarks.md, "## Soak (bench/soak.py)"
    .venv/bin/python bench/soak.py --streams 200 --seconds 60 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report, stats
from bench.lib.hostile_clients import RssSampler, slope_mib_per_min
from bench.lib.servers import ServerProcess, start_server_process, stop

SECTION = "## Soak (bench/soak.py)"
SLOPE_BUDGET = 1.0  # MiB per minute
WARMUP_S = 120.0  # at least this long before RSS samples count
MIN_SAMPLES = 24  # RSS samples after the warm-up a slope needs (two minutes at one per 5 s)
BLOCK_TOKENS = 16  # the fake engine's default block size
PROMPT_TOKENS = 16  # at most, for "soak <i> <n>"
TOML = """
[server]
host = "127.0.0.1"
port = {port}
db_path = "{db}"
default_deadline_s = 300
max_deadline_s = 600
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
default_max_tokens = 16
[models.engine]
max_model_len = 8192
[models.fake]
step_ms = STEP
step_ms_per_seq = 0.0
max_num_seqs = SEATS
kv_blocks = BLOCKS
[models.scheduling]
max_running = SEATS
max_queue = 100000
"""


@dataclass
class Soak:
    streams: int
    seconds: float
    started: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    gaps: array = field(default_factory=lambda: array("f"))  # seconds between a stream's token chunks
    ttft: array = field(default_factory=lambda: array("f"))
    rss: list[tuple[float, float]] = field(default_factory=list)
    took: float = 0.0

    def fail(self, why: str) -> None:
        self.failed[why] = self.failed.get(why, 0) + 1

    @property
    def steady(self) -> list[tuple[float, float]]:
        """RSS samples after the warm-up: the first fifth of the run, at least WARMUP_S (the ramp
        and the first streams' connections and buffers come up in it)."""
        if not self.rss:
            return []
        t0 = self.rss[0][0]
        return [(t, m) for t, m in self.rss if t - t0 >= max(self.seconds / 5, WARMUP_S)]


def raise_fd_limit(need: int) -> None:
    """Each stream is a socket here and one in the server (which inherits this limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def _request(port: int, body: bytes) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def one_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes, out: Soak) -> bool:
    """One stream on a kept-alive connection, read chunk by chunk; False: the connection is unusable."""
    out.started += 1
    t_send = last = time.monotonic()
    first, done, errored = True, False, False
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode()
    if status != "200" or b"chunked" not in head.lower():
        out.fail(f"http {status}")
        return False  # its body is not read: a fresh connection for the next one
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        data = await reader.readexactly(size + 2)
        now = time.monotonic()
        if b'"text"' in data:
            (out.ttft if first else out.gaps).append(now - (t_send if first else last))
            first, last = False, now
        errored = errored or b'"error"' in data
        done = done or b"[DONE]" in data
    await reader.readuntil(b"\r\n")
    if errored or not done:
        out.fail("error event" if errored else "no [DONE]")
    else:
        out.completed += 1
    return True


async def worker(port: int, i: int, tokens: int, end: float, out: Soak) -> None:
    n, conn = 0, None
    while time.monotonic() < end:
        body = json.dumps({"model": "fake", "prompt": f"soak {i} {n}", "max_tokens": tokens, "ignore_eos": True,
                           "stream": True}).encode()
        n += 1
        try:
            conn = conn or await asyncio.open_connection("127.0.0.1", port)
            if not await one_stream(*conn, _request(port, body), out):
                conn[1].close()
                conn = None
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            out.fail(type(e).__name__)
            if conn is not None:
                conn[1].close()
            conn = None
    if conn is not None:
        conn[1].close()


async def soak(srv: ServerProcess, streams: int, seconds: float, tokens: int, ramp_s: float = 20.0) -> Soak:
    out = Soak(streams, seconds)
    port = int(srv.url.rsplit(":", 1)[1])
    sampler = RssSampler(srv.proc.pid, every_s=5.0).start()
    t0 = time.monotonic()
    tasks = []
    for i in range(streams):
        tasks.append(asyncio.ensure_future(worker(port, i, tokens, t0 + seconds, out)))
        if i % 50 == 49:
            await asyncio.sleep(ramp_s * 50 / streams)
    await asyncio.gather(*tasks)
    await sampler.stop()
    out.rss, out.took = sampler.samples, time.monotonic() - t0
    return out


def verdicts(s: Soak) -> list[tuple[str, bool]]:
    slope = slope_mib_per_min(s.steady)
    out = [(f"every stream completed ({s.completed}/{s.started})", s.completed == s.started and not s.failed)]
    if len(s.steady) >= MIN_SAMPLES:  # a short run is all ramp: its slope says nothing
        out.append((f"server RSS flat after the warm-up: {report.num(slope, 2)} MiB/min (< {SLOPE_BUDGET:.0f})",
                    abs(slope) < SLOPE_BUDGET))
    return out


def section(args: argparse.Namespace, s: Soak) -> list[str]:
    g = s.gaps
    rss = [m for _, m in s.rss]
    seats = args.streams + args.streams // 4
    return [SECTION, "", report.stamp(s.took), "",
            f"`llmd serve` on the fake backend (step {args.step_ms} ms whatever the batch, "
            f"{seats} seats, {kv_blocks(seats, args.tokens)} KV blocks); {args.streams} concurrent streams of "
            f"{args.tokens} tokens for {args.seconds:.0f} s, each followed by another on its connection (raw "
            "sockets, one uvloop process, on the same shared 2-core box as the server).", "",
            *report.table(["streams", "completed", "failed", "tokens/s", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms",
                           "ITL max ms", "TTFT p50 ms", "TTFT p99 ms"],
                          [[s.started, s.completed, s.failed or 0, report.num((len(g) + len(s.ttft)) / s.took, 0),
                            *(report.num(stats.pct(g, q) * 1000, 0) for q in (50, 90, 99)),
                            report.num(max(g, default=float("nan")) * 1000, 0),
                            report.num(stats.pct(s.ttft, 50) * 1000, 0), report.num(stats.pct(s.ttft, 99) * 1000, 0)]]),
            "",
            f"- server RSS: {report.num(rss[0] if rss else None)} MiB at the start, "
            f"{report.num(max(rss, default=None))} MiB peak, {report.num(rss[-1] if rss else None)} MiB at the end; "
            f"slope after the warm-up {report.num(slope_mib_per_min(s.steady), 3)} MiB/min over {len(s.steady)} "
            "samples", "",
            *report.verdict_lines(verdicts(s))]


def kv_blocks(seats: int, tokens: int) -> int:
    """The fake engine's KV pool: every seat's stream (prompt and output) fits twice over."""
    return 2 * seats * -(-(PROMPT_TOKENS + tokens) // BLOCK_TOKENS)


def config(args: argparse.Namespace) -> str:
    seats = args.streams + args.streams // 4
    return (TOML.replace("STEP", str(args.step_ms)).replace("SEATS", str(seats))
            .replace("BLOCKS", str(kv_blocks(seats, args.tokens))))


def serve(args: argparse.Namespace, tmp: Path) -> ServerProcess:
    raise_fd_limit(2 * args.streams + 1024)
    return start_server_process(config(args), tmp, ready_timeout=60)


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        srv = serve(args, Path(tmp))
        try:
            s = await soak(srv, args.streams, args.seconds, args.tokens)
        finally:
            stop(srv.proc)
    lines = section(args, s)
    print("\n".join(lines))
    if args.write:
        report.write_section(report.DOC, lines)
    return 0 if all(ok for _, ok in verdicts(s)) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=500.0, help="the fake engine's step time")
    p.add_argument("--no-write", dest="write", action="store_false")
    return p.parse_args(argv)


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(main_async(parse_args())))
