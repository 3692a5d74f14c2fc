"""How fast is the usage ledger? Its write rate bounds the request rate a node can bill.

(a) write rate: enqueue N open+close pairs as fast as possible (the event loop's cost per
    op is reported too), then time until flush() returns: billed rows/s (target >= 5,000).
(a2) trickle: the same pairs, one pair per event-loop turn, so the writer runs alongside and
    its batches are as small as the arrival rate makes them (mean batch size reported).
(a3) floor: one pair per transaction (flush() after each pair), N/10 pairs: the rate if every
    batch were as small as can be, i.e. the cost of a transaction.
(b) progress: L live requests, R rounds of one progress update each, every round flushed
    (no coalescing): applied progress ops/s; then the same R x L updates enqueued at once,
    which coalescing folds into L row updates.
(c) serving cost (target < 2% of throughput): requests/s through the real gateway (uvloop,
    fake backend) kept saturated by a lean client in its own process, with the ledger and
    with a no-op stand-in, alternating rounds; and the event loop's CPU time inside metering,
    timed directly, as a share of the serving process's CPU per request.

    .venv/bin/python bench/metering.py              # N=20000, L=2000, R=10
    .venv/bin/python bench/metering.py --no-write   # print only

Results are printed and written to docs/benchmarks.md, section "## Metering" (replaced;
other sections are kept). The ledger runs on a temporary SQLite file (WAL, synchronous=NORMAL).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import start_inprocess, stop_inprocess, write_section  # noqa: E402  (bench/ is on sys.path)
from llmd.metering import BATCH_WINDOW_S, Ledger, Price  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
TARGET_ROWS_S = 5000.0
PRICES = {"m": Price(0.5, 1.5)}


async def write_rate(path: Path, n: int, trickle: bool = False, each: bool = False) -> dict[str, float]:
    led = Ledger(path, "bench", PRICES)
    await led.start()
    batches = 0
    apply = led._apply

    async def counted(batch: list) -> None:
        nonlocal batches
        batches += 1
        await apply(batch)

    led._apply = counted  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for i in range(n):
        if trickle:
            await asyncio.sleep(0)
        rid = f"r{i}"
        now = time.time()
        led.open(rid, tenant=f"t{i % 8}", key_id="k", model="m", version="v", prompt_tokens=128, max_tokens=64,
                 priority_class="interactive", idempotency_key=None, t_arrival=now)
        led.close(rid, status="ok", tenant=f"t{i % 8}", key_id="k", model="m", version="v", prompt_tokens=128,
                  cached_tokens=0, output_tokens=64, t_arrival=now, t_first_token=now, t_end=now)
        if each:
            await led.flush()
    t_enq = time.perf_counter() - t0
    await led.flush()
    total = time.perf_counter() - t0
    rows = (await led.usage(group_by=[]))[0]["requests"]
    await led.stop()
    assert rows == n, (rows, n)
    return {"rows": n, "enqueue_us_per_op": t_enq / (2 * n) * 1e6, "seconds": total, "rows_per_s": n / total,
            "ops_per_s": 2 * n / total, "mean_batch": 2 * n / max(batches, 1)}


async def progress_rate(path: Path, live: int, rounds: int) -> dict[str, float]:
    led = Ledger(path, "bench", PRICES)
    await led.start()
    now = time.time()
    for i in range(live):
        led.open(f"p{i}", tenant="t", key_id="k", model="m", version="v", prompt_tokens=128, max_tokens=4096,
                 priority_class="batch", idempotency_key=None, t_arrival=now)
    await led.flush()
    t0 = time.perf_counter()
    for r in range(rounds):
        for i in range(live):
            led.progress(f"p{i}", output_tokens=r + 1, cached_tokens=0)
        await led.flush()
    applied = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in range(rounds):
        for i in range(live):
            led.progress(f"p{i}", output_tokens=rounds + r + 1, cached_tokens=0)
    queued = led.queued
    await led.flush()
    burst = time.perf_counter() - t0
    row = await led.get(f"p{live - 1}")
    await led.stop()
    assert row and row["output_tokens"] == 2 * rounds
    return {"live": live, "rounds": rounds, "ops_per_s": live * rounds / applied,
            "burst_ops": live * rounds, "burst_queued": queued, "burst_s": burst}


def _fs(path: Path) -> str:
    """The filesystem type under `path` (from /proc/mounts), for the record."""
    best, kind = "", "unknown fs"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    except OSError:
        pass
    return f"{kind} ({path})"


class _NullLedger:
    """Stands in for the ledger: what the serving path costs without metering."""

    prices: dict = {}

    def __init__(self, real: Ledger) -> None:
        self.prices = real.prices

    def open(self, *a: object, **k: object) -> None: ...
    def progress(self, *a: object, **k: object) -> None: ...
    def close(self, *a: object, **k: object) -> None: ...
    def record_request(self, *a: object, **k: object) -> None: ...


SERVE_TOML = """
[server]
db_path = "{db}"
log_level = "warning"
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 1.0
step_ms_per_seq = 0.0
max_num_seqs = 256
[models.scheduling]
reserved_seats = 0
prior_tokens_per_s = 20000.0  # the fake engine's rate: the default prior (a CPU model's) sheds the first bursts
"""


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a child process has used, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client_round(port: int, seconds: float, concurrency: int, stream_tokens: int,
                        on_start: Callable[[], None]) -> tuple[int, float]:
    """Requests completed by a load generator in its own process (so it does not share the
    server's event loop or GIL: the server alone decides the rate), and its CPU seconds.
    `on_start` runs when the client's clock starts (its connections are up by then)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", str(port), str(seconds), str(concurrency), str(stream_tokens),
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    if (await proc.stdout.readline()).strip() != b"go":
        raise RuntimeError("load client did not start")
    on_start()
    last = await proc.stdout.readline()  # the client's clock has stopped
    if await proc.wait() != 0 or len(last.split()) != 2:
        raise RuntimeError(f"load client failed ({proc.returncode})")
    done, cpu = last.decode().split()
    return int(done), float(cpu)


def client_main(port: int, seconds: float, concurrency: int, stream_tokens: int) -> int:
    """A lean keep-alive HTTP/1.1 load client (raw sockets on uvloop): a few % of the server's
    CPU per request, so one such process saturates the server's core (httpx needed about as
    much CPU per request as the server and capped the rate near 300 req/s, which left the
    server idle part of the time). stream_tokens 0: non-streaming, 16 tokens; else an SSE
    stream of that many tokens, read chunk by chunk."""
    import uvloop

    ask: dict[str, Any] = ({"max_tokens": 16} if not stream_tokens
                           else {"max_tokens": stream_tokens, "stream": True, "ignore_eos": True})
    body = json.dumps({"model": "fake", "prompt": "hello", **ask}).encode()
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        status, _, rest = head.partition(b"\r\n")
        length, chunked = None, False
        for line in rest.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if chunked:  # an SSE stream: read chunks up to the last, empty one
            parts = []
            while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
                parts.append((await reader.readexactly(size + 2))[:-2])
            await reader.readuntil(b"\r\n")
            data = b"".join(parts)
            if b"[DONE]" not in data or b'"error"' in data:
                raise SystemExit(f"stream did not end well: {data[-300:]!r}")
        elif length is None:
            raise SystemExit(f"no Content-Length in the response: {head!r}")
        else:
            data = await reader.readexactly(length)
        if b" 200 " not in status:
            raise SystemExit(f"{status.decode()}: {data.decode(errors='replace')}")

    cpu0 = [0.0]

    async def go() -> int:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
        await asyncio.gather(*(one(r, w) for r, w in conns))  # every connection warm before the clock starts
        done = 0
        print("go", flush=True)
        cpu0[0], stop = time.process_time(), time.perf_counter() + seconds

        async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await one(r, w)
                done += 1
            w.close()
        await asyncio.gather(*(worker(r, w) for r, w in conns))
        return done

    done = uvloop.run(go())
    print(done, time.process_time() - cpu0[0])
    return 0


class _TimedLedger:
    """The real ledger behind a stopwatch: the serving thread's CPU time inside its calls (its
    cost to the serving path, measured directly). CPU time, not wall time: on a busy 2-CPU box
    the thread is often descheduled mid-call, and wall time would bill that to metering. A
    clock read costs about as much as a call here, so each call's reading is corrected by the
    cost of one clock read timed right after it (the forwarding of arguments still counts)."""

    def __init__(self, real: Ledger | "_NullLedger") -> None:
        self.real, self.prices, self.seconds = real, real.prices, 0.0
        for name in ("open", "progress", "close", "record_request"):
            setattr(self, name, self._timed(getattr(real, name)))

    def _timed(self, fn: Callable[..., None]) -> Callable[..., None]:
        clock = time.thread_time

        def call(*a: Any, **k: Any) -> None:
            t0 = clock()
            fn(*a, **k)
            t1 = clock()
            self.seconds += (t1 - t0) - (clock() - t1)
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@types.coroutine
def _stopwatch(coro: Any, acc: list[float]) -> Any:
    """Drive `coro`, adding the CPU time of each of its steps to acc[0]: what a task costs the
    event loop's thread, without the time it spends waiting."""
    value, exc = None, None
    while True:
        t = time.thread_time()
        try:
            out = coro.send(value) if exc is None else coro.throw(exc)
        except StopIteration as stop:
            acc[0] += time.thread_time() - t
            return stop.value
        acc[0] += time.thread_time() - t
        try:
            value, exc = (yield out), None
        except BaseException as e:  # noqa: BLE001  (handed to the coroutine, as a task would)
            value, exc = None, e


async def serving_overhead(tmp: Path, rounds: int, seconds: float, concurrency: int,
                           stream_tokens: int = 0) -> dict[str, Any]:
    """Requests/s through the real gateway (in-process sanic on uvloop, fake backend) while a
    lean client in another process keeps it saturated, with the ledger and with a no-op
    stand-in, alternating rounds. Also the serving process's CPU per request, its utilisation
    (near 1.0 means the rate is what its core allows), the writer process's CPU per request,
    and the event-loop time spent inside metering, timed directly."""
    import statistics
    import tomllib

    from llmd.config import Config

    cfg = Config.model_validate(tomllib.loads(SERVE_TOML.format(db=tmp / "serve.db")))
    server, service, port = await start_inprocess(cfg, f"bench_metering_{stream_tokens}")
    real = service.ledger
    # Both sides run behind the same stopwatch, so the A/B compares only what the ledger does,
    # and the no-op side's reading is the stopwatch's own residue (argument forwarding).
    timed, null = _TimedLedger(real), _TimedLedger(_NullLedger(real))
    # The writer task (batching, pickling, the pipe) runs on the serving loop: time its steps.
    loop_s = [0.0]
    real._task.cancel()  # idle at start-up: waiting for its first op
    with contextlib.suppress(asyncio.CancelledError):
        await real._task
    async def writer() -> None:
        await _stopwatch(real._writer(), loop_s)
    real._task = asyncio.create_task(writer(), name="usage-ledger-writer (timed)")
    keys = ("rate", "main_cpu", "writer_cpu", "client_cpu", "busy", "done", "in_loop", "calls")
    res: dict[str, dict[str, list[float]]] = {lab: {k: [] for k in keys} for lab in ("with", "without")}
    try:
        async def run(label: str) -> None:
            led = timed if label == "with" else null
            service.ledger = led  # type: ignore[assignment]
            writer = real._proc.pid if real._proc is not None else 0
            snap: list[float] = []

            def start() -> None:
                snap.extend((time.process_time(), _cpu_of(writer), time.perf_counter(), led.seconds, loop_s[0]))
            done, client_cpu = await _client_round(port, seconds, concurrency, stream_tokens, start)
            c1, t1 = time.process_time(), time.perf_counter()
            if label == "with":
                await real.flush()  # the writer's work counts against the round that made it
            w1 = _cpu_of(writer)
            c0, w0, t0, m0, l0 = snap
            r = res[label]
            r["rate"].append(done / (t1 - t0))
            r["done"].append(done)
            r["main_cpu"].append(c1 - c0)
            r["busy"].append((c1 - c0) / (t1 - t0))
            r["writer_cpu"].append(w1 - w0)
            r["client_cpu"].append(client_cpu)
            r["calls"].append(led.seconds - m0)
            r["in_loop"].append((led.seconds - m0) + (loop_s[0] - l0))

        await run("with"), await run("without")  # warm-up, discarded
        for lab in res:
            for k in keys:
                res[lab][k].clear()
        for i in range(rounds):
            for label in (("with", "without") if i % 2 == 0 else ("without", "with")):
                await run(label)
    finally:
        service.ledger = real
        await stop_inprocess(server)
    w, wo = res["with"], res["without"]
    n_w, n_wo = sum(w["done"]), sum(wo["done"])
    ratios = [a / b for a, b in zip(w["rate"], wo["rate"])]
    main_w, main_wo = sum(w["main_cpu"]) / n_w, sum(wo["main_cpu"]) / n_wo
    return {"with": w["rate"], "without": wo["rate"], "ratios": ratios, "ratio": statistics.median(ratios),
            "ratio_mean": statistics.fmean(ratios),
            "ratio_se": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan"),
            "pooled": sum(w["rate"]) / sum(wo["rate"]), "busy_with": w["busy"], "busy_without": wo["busy"],
            "cpu_with": [c / d for c, d in zip(w["main_cpu"], w["done"])],
            "cpu_without": [c / d for c, d in zip(wo["main_cpu"], wo["done"])],
            "main_ms": main_wo * 1e3, "main_pooled": main_w / main_wo,
            "writer_ms": sum(w["writer_cpu"]) / n_w * 1e3, "in_loop_us": sum(w["in_loop"]) / n_w * 1e6,
            "calls_us": sum(w["calls"]) / n_w * 1e6, "noop_us": sum(wo["calls"]) / n_wo * 1e6,
            "in_loop_share": sum(w["in_loop"]) / sum(w["main_cpu"]),
            "net_share": (sum(w["in_loop"]) / n_w - sum(wo["calls"]) / n_wo) / main_w,
            "client_us": (sum(w["client_cpu"]) + sum(wo["client_cpu"])) / (n_w + n_wo) * 1e6,
            "rounds": rounds, "seconds": seconds, "concurrency": concurrency, "stream_tokens": stream_tokens}


def _serve_verdict(so: dict[str, Any]) -> str:
    shown = 1 - so["ratio_mean"] - 2 * so["ratio_se"]  # the least cost the A/B clearly shows
    return "PASS" if so["in_loop_share"] < 0.02 and shown < 0.02 else "FAIL"


def _serve_lines(so: dict[str, Any], verdict: str) -> list[str]:
    kind = (f"typical: SSE streams of {so['stream_tokens']} tokens" if so["stream_tokens"]
            else "worst case: non-streaming, 16 tokens")
    cost = 1 - so["pooled"]
    return [
        f"**{kind[0].upper() + kind[1:]}** (the load client used {so['client_us']:.0f} µs of CPU per request):", "",
        "| round | with ledger req/s | without req/s | ratio | serving loop busy, with / without | "
        "serving-process CPU µs/req, with / without |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {i + 1} | {w:.1f} | {wo:.1f} | {w / wo:.3f} | {bw:.2f} / {bwo:.2f} | {cw * 1e6:.0f} / {cwo * 1e6:.0f} |"
          for i, (w, wo, bw, bwo, cw, cwo) in enumerate(zip(so["with"], so["without"], so["busy_with"],
                                                            so["busy_without"], so["cpu_with"], so["cpu_without"]))],
        "",
        f"- **event-loop time inside metering**, timed directly (thread CPU time in the ledger's calls and in "
        f"its writer task's steps): {so['in_loop_us']:.1f} µs per request ({so['calls_us']:.1f} in the calls that "
        f"enqueue a request's ops, the rest batching and handing them to the writer process), "
        f"**{so['in_loop_share'] * 100:.2f}%** of the serving process's CPU per request. The stopwatch itself "
        f"reads {so['noop_us']:.1f} µs per request on the no-op stand-in (forwarding the calls' arguments): net "
        f"of that, {so['net_share'] * 100:.2f}%.",
        f"- **throughput A/B**: pooled over all rounds {cost * 100:+.2f}%; mean of round ratios "
        f"{(1 - so['ratio_mean']) * 100:+.2f}% ± {so['ratio_se'] * 100:.2f}% (standard error), median "
        f"{(1 - so['ratio']) * 100:+.2f}%, ratios {min(so['ratios']):.3f}-{max(so['ratios']):.3f}.",
        f"- serving-process CPU per request, pooled: {(so['main_pooled'] - 1) * 100:+.2f}% with the ledger "
        f"({so['main_ms'] * 1e3:.0f} µs per request without it); the writer process commits on the other core: "
        f"{so['writer_ms'] * 1e3:.0f} µs CPU per request.",
        f"- verdict: {verdict}.", "",
    ]


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--client":
        return client_main(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="open+close pairs (default 20000)")
    ap.add_argument("--live", type=int, default=2000, help="live requests for the progress test")
    ap.add_argument("--rounds", type=int, default=10, help="progress rounds")
    ap.add_argument("--serve-rounds", type=int, default=16, help="serving-overhead rounds per side")
    ap.add_argument("--serve-seconds", type=float, default=4.0, help="seconds per serving round")
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight in the serving test")
    ap.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream in the typical workload")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmd-bench-metering-") as d:
        w = asyncio.run(write_rate(Path(d) / "a.db", args.n))
        t = asyncio.run(write_rate(Path(d) / "t.db", args.n, trickle=True))
        e = asyncio.run(write_rate(Path(d) / "e.db", max(args.n // 10, 1), each=True))
        p = asyncio.run(progress_rate(Path(d) / "b.db", args.live, args.rounds))
        import uvloop  # what `llmd serve` runs on (sanic picks it when installed)

        serving = [uvloop.run(serving_overhead(Path(d) / f"s{n}", args.serve_rounds, args.serve_seconds,
                                               args.concurrency, n)) for n in (0, args.stream_tokens)]
    verdicts = [_serve_verdict(so) for so in serving]
    worst = min(w["rows_per_s"], t["rows_per_s"])  # the floor is a latency figure, not a rate
    verdict = "PASS" if worst >= TARGET_ROWS_S else "FAIL"
    load = os.getloadavg()[0]
    cmd = "python bench/metering.py" + ("" if (args.n, args.live, args.rounds) == (20000, 2000, 10)
                                        else f" --n {args.n} --live {args.live} --rounds {args.rounds}")
    lines = [
        "## Metering", "",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
        f"Command: `{cmd}`", "",
        f"Settings: usage ledger (`llmd/metering.py`; its writer process `llmd/ledger_writer.py` commits) on a "
        f"temporary SQLite file, WAL, synchronous=NORMAL, one transaction per batch (everything queued; "
        f"the window ends early at 500 ops), "
        f"one executemany per op kind, a {BATCH_WINDOW_S * 1000:.0f} ms batching window, on {_fs(Path(tempfile.gettempdir()))}; Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, load1 {load:.2f} at the end.", "",
        "| figure | all enqueued at once | trickle (one pair per loop turn) | one pair per transaction |",
        "| --- | --- | --- | --- |",
        f"| open+close pairs | {w['rows']:,} | {t['rows']:,} | {e['rows']:,} |",
        f"| first enqueue → flush() returned | {w['seconds']:.2f} s | {t['seconds']:.2f} s | {e['seconds']:.2f} s |",
        f"| billed rows/s | {w['rows_per_s']:,.0f} | {t['rows_per_s']:,.0f} | {e['rows_per_s']:,.0f} |",
        f"| ledger ops/s | {w['ops_per_s']:,.0f} | {t['ops_per_s']:,.0f} | {e['ops_per_s']:,.0f} |",
        f"| mean ops per transaction | {w['mean_batch']:.0f} | {t['mean_batch']:.1f} | {e['mean_batch']:.1f} |",
        "",
        f"Event-loop cost per enqueued op (all at once): {w['enqueue_us_per_op']:.1f} µs.", "",
        "| figure | value |", "| --- | --- |",
        f"| progress ops/s ({p['live']:,} live, {p['rounds']} rounds, each flushed) | {p['ops_per_s']:,.0f} |",
        f"| progress burst: {p['burst_ops']:,} updates enqueued at once | coalesced to {p['burst_queued']:,} "
        f"queued ops, flushed in {p['burst_s']:.2f} s |", "",
        f"- billed rows/s under load, worse of the first two {worst:,.0f} (target >= {TARGET_ROWS_S:,.0f}): "
        f"{verdict}",
        f"- one pair per transaction costs {e['seconds'] / e['rows'] * 1e3:.2f} ms end to end (flush included); "
        "that is the ledger's latency when idle, not its capacity: under load batches grow by themselves "
        "(trickle column).",
        "",
        f"Serving path: the gateway over loopback HTTP in this process, on uvloop as `llmd serve` runs it, "
        f"fake backend at 1 ms/step with up to 256 sequences; a lean keep-alive client in its own process keeps "
        f"{args.concurrency} requests in flight, so the server's loop is the bottleneck. Two workloads: the "
        "cheapest request there is (non-streaming, 16 tokens: metering's worst case, as its cost per request "
        f"is fixed) and a typical one (an SSE stream of {args.stream_tokens} tokens). Per workload "
        f"{args.serve_rounds} alternating rounds of {args.serve_seconds:.0f} s per side after a discarded "
        "warm-up; `without` swaps the ledger for a no-op stand-in behind the same stopwatch; the ledger's "
        "final flush counts against its round.", "",
        "Verdict per workload: the event loop's CPU time inside metering, timed directly, under 2% of the "
        "serving process's CPU per request (the precise figure), and the throughput A/B showing no cost "
        "above 2% (its mean cost minus two standard errors under 2%: on this shared box single rounds move "
        "by several percent, so the A/B bounds the cost rather than measures it).", "",
        *[line for so, v in zip(serving, verdicts) for line in _serve_lines(so, v)],
        "Why a writer process: the same ledger committing through aiosqlite's thread measured 13-15% here "
        "(sqlite3 drops and retakes the GIL around every statement, and each hand-off stalls the event "
        "loop); see `llmd/ledger_writer.py`.", "",
    ]
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_section(DOC, section)
        print(f"written to {DOC}", file=sys.stderr)
    return 0 if verdict == "PASS" and all(v == "PASS" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
