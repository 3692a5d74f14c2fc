"""Issue J's bench (a), its ceiling: how far above round robin any prefix router can get, from
the offline oracle over a grid of chat workloads on 3 and 8 nodes (no llmd processes; a few
minutes of one core). Writes subsection (a2) of "Cluster (J)" in docs/benchmarks.md.

  .venv/bin/python bench/cluster_ceiling.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report
from bench.lib.cluster import INTRO, SECTION
from bench.lib.prefix_ceiling import __doc__ as WHY
from bench.lib.prefix_ceiling import table


def main() -> None:
    t0 = time.monotonic()
    rows = table()
    took = (time.monotonic() - t0) / 60
    why = " ".join(WHY.split("\n\n")[1].split()) if WHY else ""
    lines = ["### (a2) The ceiling: the best any prefix router gets over round robin", "",
             report.stamp(cmd=report.command(), took=f"took {took:.1f} min"), "", why, "",
             "Hit rates (cached prompt tokens over prompt tokens) of the same chats through LRU caches, "
             "no nodes, no load limits: `rr` each request to a random node, `affinity` each system prompt "
             "owned by one node, `single` one LRU as large as all the nodes' caches together; loads as "
             "fractions of round robin's capacity, as in (a).", "", *rows]
    print("\n".join(lines))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(a2)": lines})


if __name__ == "__main__":
    main()
