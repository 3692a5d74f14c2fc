"""Issue J's bench (a), balanced homes off and on, paired: the `score` placement on 3 llmd nodes
(fake engines), runs alternating between `[cluster] balanced_homes = false` (the default) and `true`, the
same workload and load for each pair. One run of each cannot tell the switch's effect from the
runs' own spread (about ±0.05 in hit rate, 2x in TTFT p90); alternating pairs can. Writes
subsection (a5) of "Cluster (J)" in docs/benchmarks.md.

  .venv/bin/python bench/cluster_homes.py [--loads 0.5,1.3] [--pairs 2] [--capacity 8.3] [--seconds 40]
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


async def pairs(loads: list[float], n: int, capacity: float, seconds: float) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="llmd-homes-") as d:
        for ld in loads:
            for i in range(n):
                for homes in (False, True):
                    r = await one_run(Path(d) / f"{ld}-{i}-{homes}", "score", ld * capacity, seconds,
                                      warmup_s=seconds / 3, homes=homes)
                    print({"load": ld, "homes": homes, "hit": r["hit"], "ttft_p90": r["ttft_p90"]}, flush=True)
                    out.append({"load": ld, "homes": homes, **r})
    return out


def cell(runs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['hit']:.2f} ({report.num(r['ttft_p90'], 2)} s)" for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="0.5,1.3", help="fractions of round robin's capacity")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=8.3, help="round robin's capacity, req/s, as (a) measured it")
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    t0 = time.monotonic()
    runs = asyncio.run(pairs(loads, args.pairs, args.capacity, args.seconds))
    rows = [[f"{ld:.0%}", cell([r for r in runs if r["load"] == ld and not r["homes"]]),
             cell([r for r in runs if r["load"] == ld and r["homes"]])] for ld in loads]
    failed = sum(int(r["failed"]) for r in runs)
    lines = ["### (a5) Balanced homes off and on, paired", "",
             report.stamp(cmd=report.command(), seconds=time.monotonic() - t0), "",
             f"Workload `pressure` as in (a); the `score` placement only; {args.pairs} pairs per load, each a run "
             "with `[cluster] balanced_homes = false` (the default) then one with `true`; round robin's capacity "
             f"{args.capacity} req/s as (a) measured it; {args.seconds:.0f} s of arrivals, the first third not "
             "counted. Each cell: hit rate (TTFT p90), one per run, in order.", "",
             *report.table(["load", "balanced homes off (the default)", "balanced homes on"], rows), "",
             f"Failed requests: {failed}."]
    print("\n".join(lines))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(a5)": lines})


if __name__ == "__main__":
    main()
