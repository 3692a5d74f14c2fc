"""Issue J's bench (a), its hot-prefix figure across loads: one system prompt with half the
traffic, at 70 %, 100 % and 130 % of round robin's capacity, on 3 llmd nodes (fake engines).

At 70 % the nodes' queues average ~0.1-0.2 requests, so max/mean over them swings between runs
(1.4 and 1.85 in two runs of the same code); at 100 % and 130 % the queues hold about a request
or more and the ratio says whether the hot prompt's nodes are overloaded. Writes subsection (a3)
of "Cluster (J)" in docs/benchmarks.md.

  .venv/bin/python bench/cluster_hot.py [--capacity 8.3] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.cluster import one_run
from bench.lib import report
from bench.lib.cluster import INTRO, SECTION

LOADS = (0.7, 1.0, 1.3)


async def sweep(capacity: float, seconds: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="llmd-hot-") as d:
        return [{"load": ld, **await one_run(Path(d), "score", ld * capacity, seconds, hot=0.5, warmup_s=seconds / 3)}
                for ld in LOADS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=float, default=8.3, help="round robin's capacity, req/s, as (a) measured it")
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    t0 = time.monotonic()
    runs = asyncio.run(sweep(args.capacity, args.seconds))
    rows = [[f"{r['load']:.0%}", f"{r['ok']}/{r['requests']}", f"{r['hit']:.2f}", report.num(r["ttft_p90"], 3),
             ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["queues"].items())),
             report.num(r["queue_max_over_mean"], 2)] for r in runs]
    worst = max((r["queue_max_over_mean"] or 0.0) for r in runs)
    failed = sum(int(r["failed"]) for r in runs)
    lines = ["### (a3) One hot prefix across loads", "",
             report.stamp(cmd=report.command(), seconds=time.monotonic() - t0), "",
             f"Workload `pressure` as in (a), but half the chats on one system prompt; our placement (`score`); "
             f"round robin's capacity {args.capacity} req/s as (a) measured it; {args.seconds:.0f} s of arrivals, "
             "the first third not counted; queues: each node's requests waiting (llmd's queue and the engine's), "
             "sampled every 0.25 s, averaged over the counted window.", "",
             *report.table(["load", "ok", "hit rate", "TTFT p90 s", "mean queue per node", "max/mean"], rows), "",
             *report.verdict_lines([(f"no failures ({failed}), max queue <= 1.5x mean at every load (worst "
                                     f"{worst:.2f})", failed == 0 and worst <= 1.5)])]
    print("\n".join(lines))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(a3)": lines})


if __name__ == "__main__":
    main()
