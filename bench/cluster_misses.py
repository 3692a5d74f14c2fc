"""Where bench (a)'s prefix misses come from, request by request: one run of one placement at one
rate (the same chats as bench/cluster.py's runs of that seed), each counted request sorted into
a system-prompt miss (its system prompt not cached where it ran) or a history miss (the system
prompt cached, the chat's earlier turns not), and each history miss into "moved" (the previous
turn ran on another node) or "evicted" (it ran on the same node, whose cache dropped it since).
It also prints which nodes ran each system prompt. Diagnostic: nothing is written to the docs.

  .venv/bin/python bench/cluster_misses.py --rate 3.15 [--placement score|round_robin|single]
      [--seconds 120] [--save rows.json] [--cluster-extra 'homes_bind = "congested"'] [--hot 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench import cluster as bench_a
from bench.lib import stats
from bench.lib.cluster import Workload, start_nodes, stop_nodes
from bench.lib.streams import Stream

HISTORY_MISS = 200  # uncached tokens past the system prompt that make a turn a history miss (a turn adds ~120)


async def run(placement: str, rate: float, seconds: float, cluster_extra: str, seed: int = 1,
              hot: float | None = None) -> list[dict[str, Any]]:
    """One run as bench (a)'s `one_run` makes it; a row per request."""
    kv_blocks, wl_kw = bench_a._workload("pressure")
    n, scale = (1, 3) if placement == "single" else (3, 1)
    with tempfile.TemporaryDirectory() as tmp:
        nodes = await asyncio.to_thread(start_nodes, Path(tmp), n, "score" if placement == "single" else placement,
                                        5.0, kv_blocks * scale, bench_a.PREFILL_TPS * scale, seqs=32 * scale,
                                        cluster_extra=cluster_extra)
        log: list[tuple[dict[str, Any], Stream]] = []
        try:
            await bench_a.chats(nodes, Workload(seed=seed, hot=hot, **wl_kw), rate / 5.5, seconds, seed, log)
        finally:
            await asyncio.to_thread(stop_nodes, nodes)
    t0 = log[0][1].t_send if log else 0.0
    return [{"chat": body["messages"][1]["content"], "t": s.t_send - t0,
             "system": int(body["messages"][0]["content"].split(".")[0].split()[-1]),
             "turn": sum(m["role"] == "user" for m in body["messages"]), "node": s.node, "prompt": s.prompt_tokens,
             "cached": s.cached_tokens, "ttft": s.ttft, "ok": s.ok} for body, s in log]


def system_tokens(rows: list[dict[str, Any]]) -> int:
    """The system prompt's share of a prompt, in cached tokens: the most any first turn found."""
    return max((r["cached"] or 0) for r in rows if r["turn"] == 1) if rows else 0


def summary(rows: list[dict[str, Any]], warmup_s: float) -> list[str]:
    by_chat: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by_chat[r["chat"]][r["turn"]] = r
    counted = [r for r in rows if r["ok"] and r["t"] >= warmup_s]
    if not counted:
        return ["no requests counted"]
    floor = system_tokens(rows) - 64  # within a summary block of the whole system prompt
    system = [r for r in counted if r["cached"] < floor]
    history = [r for r in counted
               if r["cached"] >= floor and r["turn"] > 1 and r["prompt"] - r["cached"] > HISTORY_MISS]
    moved = [r for r in history if by_chat[r["chat"]][r["turn"] - 1]["node"] != r["node"]]
    gaps = [r["t"] - by_chat[r["chat"]][r["turn"] - 1]["t"] for r in history if r not in moved]
    ttfts = [r["ttft"] for r in counted if r["ttft"] is not None]
    nodes: dict[int, Counter[str]] = defaultdict(Counter)
    for r in counted:
        nodes[r["system"]][r["node"]] += 1
    hit = sum(r["cached"] for r in counted) / sum(r["prompt"] for r in counted)
    return [f"requests {len(counted)}, hit rate {hit:.3f}, TTFT p50 {stats.pct(ttfts, 50):.3f} s, "
            f"p90 {stats.pct(ttfts, 90):.3f} s",
            f"system-prompt misses {len(system)} ({sum(r['turn'] == 1 for r in system)} of them first turns)",
            f"history misses {len(history)}: moved {len(moved)}, evicted {len(history) - len(moved)}"
            + (f" ({min(gaps):.1f}-{max(gaps):.1f} s after the previous turn was sent)" if gaps else ""),
            "nodes by system prompt: " + "; ".join(f"{k}: " + ", ".join(f"{n} {c}" for n, c in sorted(v.items()))
                                                   for k, v in sorted(nodes.items()))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, required=True, help="requests per second (bench (a): load x 4.5)")
    ap.add_argument("--placement", choices=("score", "round_robin", "single"), default="score")
    ap.add_argument("--seconds", type=float, default=bench_a.SECONDS)
    ap.add_argument("--cluster-extra", default="", help="more [cluster] lines for every node")
    ap.add_argument("--save", type=Path, help="write the rows here (JSON)")
    ap.add_argument("--hot", type=float, help="this share of the chats on one system prompt (bench (a)'s hot run: 0.5)")
    a = ap.parse_args()
    rows = asyncio.run(run(a.placement, a.rate, a.seconds, a.cluster_extra, hot=a.hot))
    if a.save:
        a.save.write_text(json.dumps(rows))
    print(f"{a.placement} at {a.rate} req/s, {a.seconds:.0f} s, the first third not counted")
    print("\n".join(summary(rows, a.seconds / 3)))


if __name__ == "__main__":
    main()
