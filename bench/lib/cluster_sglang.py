"""Bench (s) of bench/cluster.py: llmd's routing against SGLang's router (`cache_aware` and
`round_robin`) in front of the same llmd nodes, on the same chats, from light load to past
capacity; what it measures and how it reads.

Issue N's target: at every load llmd's prefix hit rate >= each SGLang policy's, and its TTFT p90
<= 0.8x each one's. Hit rates are the nodes' own (each response's `cached_tokens` over its
prompt tokens), so the routers are compared on the caches they leave behind, not on their own
guesses of them."""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib import report
from bench.lib.peer_sglang import PACKAGES

TITLE = "(s) Routing against SGLang's router, llmd's own routing off behind it"
LOADS = (0.3, 0.6, 0.9, 1.2)
# Arrivals per run: 16 runs (4 loads x 4 routers) fit the 20 minutes a bench gets on this box
# with nodes started afresh for each run (about 10 s) and no drain waited for (`cut`).
SECONDS = 50.0
# llmd's routing, then SGLang's router (bench/lib/peer_sglang.py): both its packages' cache_aware,
# and round robin (a floor) from the maintained one.
WHO = ("llmd", "sglang-router:cache_aware", "smg:cache_aware", "smg:round_robin")
HIT_TARGET, TTFT_TARGET = 1.0, 0.8  # llmd's hit rate >= 1x each peer's; its TTFT p90 <= 0.8x each peer's


def label(who: str) -> str:
    if who == "llmd":
        return "llmd"
    package, _, policy = who.partition(":")
    return f"{PACKAGES[package].replace('==', ' ')} {policy}"


WARM_REQUESTS = 40  # the warm-up's least number of requests: caches warm by requests, not seconds


def warmup_s(seconds: float, rate: float) -> float:
    """A third of the run, or long enough for WARM_REQUESTS at this rate if that is longer: at low
    rates a third of a short run left the caches cold, and every router's TTFT p90 was one cold
    prefill, a measure of the run's length rather than of routing (a service runs warm)."""
    return max(seconds / 3, WARM_REQUESTS / rate) if rate > 0 else seconds / 3


def describe(data: dict[str, Any]) -> list[str]:
    return [" ".join([
        f"Workload `{data['workload']}` as in (a) (multi-turn chats on Zipf-popular shared system prompts),",
        "3 llmd nodes with fake engines as in (a). Loads are fractions of (a)'s round-robin capacity,",
        f"{data['capacity']:.2f} req/s. `llmd`: the nodes route (the shipped `[cluster]` defaults), each",
        "request entering at its drawn node as a plain load balancer would send it; the others: SGLang's",
        "router (PyPI `sglang-router` 0.3.2, the last release under that name, and `smg` 1.13.0, the same",
        "router under its maintained name; each with its defaults but the addresses) in front of the same",
        "nodes started afresh with `[cluster] routing = \"local\"` (each node runs what it receives),",
        "every request sent to the router. Every run of a load sends the same chats at the same times",
        "(drawn before it starts);",
        f"{data['seconds'] * 2 / 3:.0f} s of counted arrivals per run after a warm-up that is not counted",
        f"(a third of {data['seconds']:.0f} s, or {WARM_REQUESTS} requests' worth if longer), no",
        "turn started after the arrivals end. Hit rate: the nodes' cached prompt tokens over prompt tokens",
        "(each response's usage); TTFT from the client, through the router where there is one."])]


def medians(runs: list[dict[str, Any]]) -> dict[tuple[float, str], dict[str, Any]]:
    """Per (load, router): its runs' median hit rate and TTFT p90, and how many runs. A router's
    figures move between runs of the same code by more than the differences the verdicts weigh,
    so repeated rounds are read by their medians."""
    out: dict[tuple[float, str], dict[str, Any]] = {}
    for key in dict.fromkeys((r["load"], r["who"]) for r in runs):
        mine = [r for r in runs if (r["load"], r["who"]) == key]
        p90s = [r["ttft_p90"] for r in mine if r["ttft_p90"] is not None]
        out[key] = {"hit": statistics.median(r["hit"] for r in mine),
                    "ttft_p90": statistics.median(p90s) if p90s else None, "n": len(mine)}
    return out


def joined(saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Several calls' (s) data as one (`--s-from`): their runs together, rounds numbered on."""
    out, runs, base = dict(saves[0]), [], 0
    for save in saves:
        rounds = max((r.get("round", 1) for r in save["runs"]), default=0)
        runs += [{**r, "round": base + r.get("round", 1)} for r in save["runs"]]
        base += rounds
    out["runs"] = runs
    return out


def report_s(data: dict[str, Any]) -> list[str]:
    """The table of every run and the issue's verdicts, load by load (on the medians of repeated
    rounds: `--s-rounds`, or several calls' `--save` files joined by `--s-from`)."""
    runs = data["runs"]
    by = medians(runs)
    loads = sorted({r["load"] for r in runs})
    rows = [[f"{r['load']:.0%}", label(r["who"]), str(r.get("round", 1)), f"{r['rate']:.2f}",
             f"{r['ok']}/{r['requests']}", f"{r['hit']:.2f}", report.num(r["ttft_p50"], 3),
             report.num(r["ttft_p90"], 3)]
            for ld in loads for who in WHO for r in runs if (r["load"], r["who"]) == (ld, who)]
    head = ["load", "router", "round", "req/s", "ok", "hit rate", "TTFT p50 s", "TTFT p90 s"]
    lines = [*describe(data), "", *report.table(head, rows), ""]
    verdicts = []
    for ld in loads:
        ours = by.get((ld, "llmd"))
        peers = [by[(ld, w)] for w in WHO[1:] if (ld, w) in by]
        if ours is None or not peers:
            continue
        n = min([ours["n"], *(p["n"] for p in peers)])
        best_hit = max(p["hit"] for p in peers)
        p90s = [p["ttft_p90"] for p in peers if p["ttft_p90"] is not None]
        best_p90 = min(p90s) if p90s else None
        hit_ok = ours["hit"] >= HIT_TARGET * best_hit
        ttft_ok = ours["ttft_p90"] is not None and best_p90 is not None and ours["ttft_p90"] <= TTFT_TARGET * best_p90
        ratio = ours["ttft_p90"] / best_p90 if ours["ttft_p90"] is not None and best_p90 else None
        at = f"{ld:.0%}" + (f" (medians of {n} or more runs)" if n > 1 else "")
        verdicts += [(f"{at}: llmd's hit rate >= SGLang's best ({ours['hit']:.2f} vs {best_hit:.2f})", hit_ok),
                     (f"{at}: llmd's TTFT p90 <= {TTFT_TARGET}x SGLang's best ({report.num(ours['ttft_p90'], 3)}"
                      f" vs {report.num(best_p90, 3)} s: {report.num(ratio, 2)}x)", ttft_ok)]
    failed = sum(int(r["failed"]) for r in runs)
    verdicts.append((f"no request failed in any run ({failed})", failed == 0))
    return lines + report.verdict_lines(verdicts)
