"""What does committing a request's usage before its response ends cost?

`RequestLife.finish` (llmd/lifecycle.py) waits until the ledger's writer process has committed
the request's close before the final event (`[DONE]`) or the body leaves, so a client that got a
whole response is billed even if the server dies the next moment (bench/crash.py shows it).
Without it the close is only queued, committed within the ledger's 100 ms batching window.

Measured through the real gateway (in-process sanic on uvloop, fake backend at 1 ms/step, the
real SQLite ledger) with the lean keep-alive client of bench/metering.py in its own process,
alternating rounds with the commit waited for (`on`) and not (`off`,
`Lifecycle.commit_first = False`): one request at a time (latency: the wait itself), and 256
in flight (throughput: concurrent requests share one commit), non-streaming 16 tokens and SSE
streams of 128 tokens.

    .venv/bin/python bench/commit_first.py            # writes docs/benchmarks.md
    .venv/bin/python bench/commit_first.py --rounds 2 --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import lean_client, report, stats
from bench.lib.servers import quiet_logs, start_inprocess
from bench.metering import SERVE_TOML

WORKLOADS = (("one at a time, non-streaming 16 tokens", 1, 0), ("256 in flight, non-streaming 16 tokens", 256, 0),
             ("256 in flight, SSE streams of 128 tokens", 256, 128))


async def measure(tmp: Path, rounds: int, seconds: float) -> list[dict[str, Any]]:
    from llmd.config import Config

    quiet_logs()
    out = []
    for i, (label, concurrency, tokens) in enumerate(WORKLOADS):
        cfg = Config.model_validate(tomllib.loads(SERVE_TOML.format(db=tmp / f"c{i}.db")))
        live = await start_inprocess(cfg, f"bench_commit_first_{i}")
        rates: dict[bool, list[float]] = {True: [], False: []}
        try:
            for r in range(rounds + 1):  # the first pair warms up, discarded
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    live.node.lifecycle.commit_first = on
                    t: list[float] = []
                    done, _ = await lean_client.client_round(live.port, seconds, concurrency, tokens,
                                                             lambda t=t: t.append(time.perf_counter()))
                    rate = done / (time.perf_counter() - t[0])
                    if r:
                        rates[on].append(rate)
        finally:
            live.node.lifecycle.commit_first = True
            await live.stop()
        ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
        out.append({"label": label, "concurrency": concurrency, "on": stats.mean(rates[True]),
                    "off": stats.mean(rates[False]), "ratio": stats.mean(ratios), "se": stats.stderr(ratios)})
    return out


def report_lines(args: argparse.Namespace, res: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in res:
        lat = (f"{1e3 / r['on']:.2f} / {1e3 / r['off']:.2f} ms (+{(1e3 / r['on'] - 1e3 / r['off']):.2f} ms)"
               if r["concurrency"] == 1 else "")
        rows.append([r["label"], f"{r['on']:.1f}", f"{r['off']:.1f}",
                     f"{(r['ratio'] - 1) * 100:+.1f}% ± {r['se'] * 100:.1f}%", lat])
    return [
        "## Metering: usage committed before the response ends", "", report.stamp(), "",
        (f"Settings: `RequestLife.finish` waits for the ledger's commit of the request's close before `[DONE]` or "
         f"the body is sent (`on`, what llmd does) or not (`off`); the gateway in-process on uvloop, fake backend at "
         f"1 ms/step, the real SQLite ledger (WAL, synchronous=NORMAL, its writer process); the lean keep-alive "
         f"client of bench/metering.py; {args.rounds} alternating rounds of {args.seconds:.0f} s per side after a "
         "discarded warm-up pair."), "",
        *report.table(["workload", "on req/s", "off req/s", "throughput on vs off (mean ± s.e.)",
                       "latency per request, on / off"], rows), "",
        (f"- Load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; the box is shared, "
         "so compare `on` with `off` of the same rows, not these rates with other sections."),
        ("- One request at a time pays a whole commit round trip (the batching window ends at once when a close "
         "is waited for); with many in flight, requests finishing together share one commit, so throughput "
         "moves by about the noise of this shared box."), "",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    import uvloop  # what `llmd serve` runs on

    with tempfile.TemporaryDirectory(prefix="llmd-bench-commit-") as d:
        res = uvloop.run(measure(Path(d), args.rounds, args.seconds))
    lines = report_lines(args, res)
    print("\n".join(lines))
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
