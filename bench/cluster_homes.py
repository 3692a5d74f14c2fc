"""Issue J's bench (a), balanced homes off and on, in rounds: the `score` placement on 3 llmd nodes
(fake engines), each round a run with `[cluster] balanced_homes = false`, one with
`true` and one of `single` (one node with the three's cache, prefill and seats: the reference of
the 90 % target), the same workload and load. One run of each cannot tell the switch's effect from
the runs' own spread (±0.1 in hit rate at 70-100 %, 2x in TTFT p90); rounds give each its mean
and range. `--hot-rounds` adds off/on rounds of the hot-prefix run (half the traffic on one
system prompt, 70 %): its queue balance. Writes subsection (a5) of "Cluster (J)" in
docs/benchmarks.md.

  .venv/bin/python bench/cluster_homes.py [--loads 0.7,1.0,1.3] [--rounds 3] [--hot-rounds 2]
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
from bench.lib import report, stats
from bench.lib.cluster import INTRO, SECTION

CONFIGS: tuple[tuple[str, str, bool | None], ...] = (("off", "score", False), ("on", "score", True),
                                                    ("single", "single", None))


async def rounds(loads: list[float], n: int, hot_n: int, capacity: float, seconds: float) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="llmd-homes-") as d:
        plan: list[tuple[float, int, tuple[str, str, bool | None], float | None]]
        plan = [(ld, i, cfg, None) for ld in loads for i in range(n) for cfg in CONFIGS]
        plan += [(0.7, i, cfg, 0.5) for i in range(hot_n) for cfg in CONFIGS[:2]]
        for ld, i, (name, placement, homes), hot in plan:
            r = await one_run(Path(d) / f"{ld}-{i}-{name}-{hot}", placement, ld * capacity, seconds, hot=hot,
                              warmup_s=seconds / 3, homes=homes)
            row = {"load": ld, "config": name, "hot": hot is not None, **r}
            print({k: row[k] for k in ("load", "config", "hot", "hit", "ttft_p90", "queue_max_over_mean")}, flush=True)
            out.append(row)
    return out


def summary(runs: list[dict[str, Any]], key: str, digits: int = 2) -> str:
    """Mean (min-max) of `key` over the runs, then each run's value in order."""
    xs = [float(r[key]) for r in runs if r[key] is not None]
    if not xs:
        return "-"
    each = ", ".join(f"{x:.{digits}f}" for x in xs)
    return f"{stats.mean(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f}; {each})"


def mean(runs: list[dict[str, Any]], key: str) -> float:
    xs = [float(r[key]) for r in runs if r[key] is not None]
    return stats.mean(xs) if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="0.7,1.0,1.3", help="fractions of round robin's capacity")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot-rounds", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=8.3, help="round robin's capacity, req/s, as (a) measured it")
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    t0 = time.monotonic()
    runs = asyncio.run(rounds(loads, args.rounds, args.hot_rounds, args.capacity, args.seconds))
    lines = report_lines(runs, args, time.monotonic() - t0)
    print("\n".join(lines))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(a5)": lines})


def report_lines(runs: list[dict[str, Any]], args: argparse.Namespace, took_s: float) -> list[str]:
    plain = [r for r in runs if not r["hot"]]
    rows, verdicts = [], []
    for ld in sorted({r["load"] for r in plain}):
        by = {name: [r for r in plain if r["load"] == ld and r["config"] == name] for name, _, _ in CONFIGS}
        single = mean(by["single"], "hit")
        ratio = {name: mean(by[name], "hit") / single if single else 0.0 for name in ("off", "on")}
        rows.append([f"{ld:.0%}", *(summary(by[name], "hit") for name, _, _ in CONFIGS),
                     f"{ratio['off']:.0%} / {ratio['on']:.0%}",
                     " / ".join(report.num(mean(by[name], "ttft_p90"), 2) for name, _, _ in CONFIGS)])
        verdicts += [(f"{ld:.0%}: mean hit rate >= 90 % of single's, balanced homes {name} ({ratio[name]:.0%})",
                      ratio[name] >= 0.9) for name in ("off", "on")]
    hot = [r for r in runs if r["hot"]]
    lines = ["### (a5) Balanced homes off and on, in rounds with single", "",
             report.stamp(cmd=report.command(), seconds=took_s), "",
             f"Workload `pressure` as in (a); {args.rounds} rounds per load, each a run of the `score` placement with "
             "`[cluster] balanced_homes = false` (`off`), one with `true` (`on`, the default since the congestion "
             "gate) and one of `single` "
             f"(one node with the three's cache, prefill and seats); round robin's capacity {args.capacity} req/s as "
             f"(a) measured it; {args.seconds:.0f} s of arrivals, the first third not counted. Hit rate cells: mean "
             "(min-max; each run in order).", "",
             *report.table(["load", "off: hit rate", "on: hit rate", "single: hit rate", "off / on over single",
                            "TTFT p90 s, mean: off / on / single"], rows), ""]
    if hot:
        hrows = [[name, summary([r for r in hot if r["config"] == name], "queue_max_over_mean"),
                  summary([r for r in hot if r["config"] == name], "hit")] for name in ("off", "on")]
        lines += [f"Hot prefix (half the traffic on one system prompt) at 70 %, {args.hot_rounds} rounds:", "",
                  *report.table(["balanced homes", "queue max/mean", "hit rate"], hrows), ""]
        verdicts += [(f"hot prefix, balanced homes {name}: every run's queue max/mean <= 1.5",
                      all((r["queue_max_over_mean"] or 0) <= 1.5 for r in hot if r["config"] == name))
                     for name in ("off", "on")]
    failed = sum(int(r["failed"]) for r in runs)
    return [*lines, f"Failed requests: {failed}.", "", *report.verdict_lines(verdicts)]


if __name__ == "__main__":
    main()
