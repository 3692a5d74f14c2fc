"""Issue J's bench (a), its hot-prefix figure across loads: one system prompt with half the
traffic, at 70 %, 100 % and 130 % of round robin's capacity, on 3 llmd nodes (fake engines),
one run per seed of chats at each load.

Where the nodes' queues average a few hundredths of a request (70-130 % on (a)'s workload: the
fake engines prefill every waiting prompt in the next step), max/mean over them swings between
runs of the same code and seed; past about 1.6x the nodes hold queues and the ratio says whether
the hot prompt's nodes are overloaded. The figures: docs/benchmarks.md (a3), (a18), (a19).
Writes subsection (a3) of "Cluster (J)" in docs/benchmarks.md.

  .venv/bin/python bench/cluster_hot.py [--capacity 4.5] [--seconds 120] [--seeds 1,2,3] [--loads 0.7,1.0,1.3]
      [--save FILE] [--from FILE,...]   (runs to JSON, not the docs; the docs from saved runs)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.cluster import HOT_SEEDS, one_run
from bench.lib import report
from bench.lib.cluster import INTRO, SECTION

LOADS = (0.7, 1.0, 1.3)


async def sweep(capacity: float, seconds: float, seeds: tuple[int, ...],
                loads: tuple[float, ...] = LOADS) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="llmd-hot-") as d:
        for seed in seeds:
            for ld in loads:
                r = await one_run(Path(d) / f"s{seed}", "score", ld * capacity, seconds, hot=0.5, seed=seed,
                                  warmup_s=seconds / 3)
                out.append({"load": ld, "seed": seed, **r})
                print(f"seed {seed} load {ld:.0%}: max/mean {r['queue_max_over_mean']}, queues {r['queues']}; "
                      f"in the node {r['inside_max_over_mean']}, {r['inside']}; per node {r['per_node']}", flush=True)
    return out


def lines_of(runs: list[dict[str, Any]], capacity: float, seconds: float, took_s: float,
             stamp: str | None = None) -> list[str]:
    rows = [[f"{r['load']:.0%}", str(r["seed"]), f"{r['ok']}/{r['requests']}", f"{r['hit']:.2f}",
             report.num(r["ttft_p90"], 3), _per_node(r["queues"]),
             report.num(sum(r["queues"].values()) / max(1, len(r["queues"])), 2),
             report.num(r["queue_max_over_mean"], 2), _per_node(r.get("inside", {})),
             report.num(r.get("inside_max_over_mean"), 2),
             ", ".join(f"{k} {n} ({h})" for k, (n, h) in sorted(r.get("per_node", {}).items()))]
            for r in sorted(runs, key=lambda r: (r["load"], r["seed"]))]
    failed = sum(int(r["failed"]) for r in runs)
    verdicts = []
    for ld in sorted({r["load"] for r in runs}):
        at = [r for r in runs if r["load"] == ld]
        ratios = [r["queue_max_over_mean"] or 0.0 for r in at]
        verdicts.append((f"{ld:.0%}: max queue <= 1.5x mean in every run, requests waiting (worst "
                         f"{max(ratios):.2f} of {len(ratios)})", max(ratios) <= 1.5))
        inside = [r.get("inside_max_over_mean") or 0.0 for r in at]
        verdicts.append((f"{ld:.0%}: max <= 1.5x mean in every run, requests in the node (worst "
                         f"{max(inside):.2f} of {len(inside)})", max(inside) <= 1.5))
    return ["### (a3) One hot prefix across loads", "",
            stamp or report.stamp(cmd=report.command(), seconds=took_s), "",
            f"Workload `pressure` as in (a), but half the chats on one system prompt; our placement (`score`); "
            f"round robin's capacity {capacity} req/s as (a) gives it; {seconds:.0f} s of arrivals, the first "
            "third not counted; one run per seed of chats (the seeds of (a)'s hot runs) at each load; queues: "
            "each node's requests waiting (llmd's queue and the engine's), sampled every 0.25 s, averaged over "
            "the counted window; in the node: the same samples' requests waiting or running (a node's load "
            "while its seats are free, which is when nothing waits); requests per node: sent in the counted "
            "window (of them on the hot prompt).", "",
            *report.table(["load", "seed", "ok", "hit rate", "TTFT p90 s", "mean queue per node", "nodes' mean",
                           "max/mean", "in the node, mean per node", "max/mean (in the node)",
                           "requests per node (hot)"], rows), "",
            *report.verdict_lines([(f"no failures ({failed})", failed == 0), *verdicts])]


def _per_node(means: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(means.items())) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=float, default=4.5, help="round robin's capacity, req/s, as (a) gives it")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--seeds", default=",".join(map(str, HOT_SEEDS)), help="seeds of chats, comma-separated")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)), help="fractions of --capacity, comma-separated")
    ap.add_argument("--save", type=Path, help="write the runs to this JSON file, not to the docs")
    ap.add_argument("--from", dest="saved", help="comma-separated --save files: write (a3) from them")
    args = ap.parse_args()
    if args.saved:
        parts = [json.loads(Path(f).read_text()) for f in args.saved.split(",")]
        runs = [r for p in parts for r in p["runs"]]
        stamp = "; ".join(p["stamp"] for p in parts)
        lines = lines_of(runs, parts[0]["capacity"], parts[0]["seconds"], 0.0, stamp=stamp)
    else:
        t0 = time.monotonic()
        seeds = tuple(int(s) for s in args.seeds.split(","))
        runs = asyncio.run(sweep(args.capacity, args.seconds, seeds, tuple(float(x) for x in args.loads.split(","))))
        took = time.monotonic() - t0
        lines = lines_of(runs, args.capacity, args.seconds, took)
        if args.save:
            args.save.write_text(json.dumps({"runs": runs, "capacity": args.capacity, "seconds": args.seconds,
                                             "stamp": report.stamp(cmd=report.command(), seconds=took)}))
            print("\n".join(lines))
            print(f"saved to {args.save}")
            return
    print("\n".join(lines))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(a3)": lines})


if __name__ == "__main__":
    main()
