"""Part (c), ITL target: does AIMD on target_itl_ms find a seat limit as good as hand tuning?

p95 ITL at saturation unconstrained, then AIMD (target_itl_ms) against a static max_running
sweep (largest first): AIMD should meet the target with about the throughput of the best
hand-tuned value that meets it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from itertools import pairwise
from typing import Any

from bench.fairness_parts import PartResult, itl_label, itl_scheduling
from bench.lib import report, stats
from bench.lib.engines import Bench, Srv
from bench.lib.load import (
    AdminSampler,
    Workers,
    long_body,
    preempted,
    seat_summary,
    seat_trace,
    warm_up,
)
from bench.lib.streams import itl_gaps, new_client, output_tokens_between, statuses

TITLE = "(c) ITL target: AIMD vs hand-tuned max_running"
QUICK: dict[str, Any] = {"itl_concurrency": 24, "itl_window_s": 8.0, "itl_warmup_s": 5.0, "aimd_warmup_s": 10.0,
                         "sweep": "8,16", "itl_max_tokens": 64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("part c: ITL target")
    g.add_argument("--itl-concurrency", type=int, default=64)
    g.add_argument("--itl-max-tokens", type=int, default=128, help="mean max_tokens (uniform +-25%%)")
    g.add_argument("--itl-window-s", type=float, default=20.0)
    g.add_argument("--itl-warmup-s", type=float, default=10.0)
    g.add_argument("--aimd-warmup-s", type=float, default=60.0)
    g.add_argument("--itl-target-factor", type=float, default=0.6, help="target = this x unconstrained p95 ITL")
    g.add_argument("--itl-target-ms", type=float, help="part c's target (default: from --itl-target-factor)")
    g.add_argument("--sweep", default="8,16,24,32", help="static max_running values (run largest first)")
    g.add_argument("--full-sweep", action="store_true",
                   help="run every value, not only down to the first that meets the target")


async def itl_run(bench: Bench, srv: Srv, label: str, warmup_s: float) -> dict[str, Any]:
    """A closed loop at --itl-concurrency; client ITL and engine step figures over one window after warm-up."""
    a = bench.args
    rng = random.Random(a.seed)
    lo, hi = int(a.itl_max_tokens * 0.75), int(a.itl_max_tokens * 1.25)  # varied lengths keep the streams out of step
    lengths = [rng.randint(lo, hi) for _ in range(100000)]
    async with new_client() as client:
        await warm_up(client, srv, "a", a.name)
        sampler = AdminSampler(client, srv, a.name)
        sampler.start()
        w = Workers(client, srv, "a", a.itl_concurrency, "/v1/completions",
                    lambda i: long_body(a.name, i, lengths[i % len(lengths)]), srv.headers("a"), stagger_s=2.0)
        w.start()
        await asyncio.sleep(warmup_s)
        t0, u0 = time.monotonic(), time.time()
        await asyncio.sleep(a.itl_window_s)
        t1, u1 = time.monotonic(), time.time()
        hist = await sampler.history(u0)
        await w.stop()
        await sampler.stop()
    gaps = itl_gaps(w.results, t0, t1)
    steps = [r for r in hist if r["t"] <= u1]
    step_gaps = [b["t"] - x["t"] for x, b in pairwise(steps) if b["generated_tokens"] > 0]
    ratios = [r for s in w.results if (r := s.tokens_per_chunk()) is not None]
    row = {"config": label, "p50": stats.pct(gaps, 50) * 1000, "p95": stats.pct(gaps, 95) * 1000,
           "step_p95": stats.pct(step_gaps, 95) * 1000, "tps": output_tokens_between(w.results, t0, t1) / (t1 - t0),
           "engine_tps": sum(r["generated_tokens"] for r in steps) / (u1 - u0),
           "tok_per_chunk": stats.mean(ratios),
           "seats": seat_summary(sampler.between(t0, t1)), "statuses": statuses(w.results),
           "seat_trace": seat_trace(sampler.samples, t0), "preempted": preempted(sampler.between(t0, t1))}
    print(f"    {label}: ITL p50 {row['p50']:.0f} ms p95 {row['p95']:.0f} ms "
          f"(engine step p95 {row['step_p95']:.0f} ms); {row['tps']:.0f} tok/s; seats {row['seats']}; "
          f"preempted {row['preempted']}", flush=True)
    return row


async def _sweep(bench: Bench, target: float) -> list[dict[str, Any]]:
    """Static max_running, largest first, stopping at the first that meets the target unless --full-sweep."""
    a = bench.args
    tenants: dict[str, dict[str, Any]] = {"a": {}}
    out: list[dict[str, Any]] = []
    for k in sorted({int(x) for x in a.sweep.split(",") if x.strip()}, reverse=True):
        with bench.llmd(f"c-mr{k}", {"fairness": "vtc", "max_running": k}, tenants) as srv:
            row = await itl_run(bench, srv, f"max_running {k}", a.itl_warmup_s)
        out.append(row)
        if row["p95"] <= target and not a.full_sweep:
            print(f"    max_running {k} meets the target: smaller values give less throughput; sweep stops", flush=True)
            break
    return out


def _lines(a: argparse.Namespace, rows: list[dict[str, Any]], best: dict[str, Any] | None, target: float,
           aimd: dict[str, Any], verdicts: list[tuple[str, bool]]) -> list[str]:
    head = ["configuration", "ITL p50 ms", "ITL p95 ms", "engine step p95 ms", "out tok/s", "engine tok/s",
            "tokens/chunk", "seat limit (mean running)", "preempted", "requests"]
    body = [[r["config"] + (" (hand-tuned best)" if r is best else ""), f"{r['p50']:.0f}", f"{r['p95']:.0f}",
             f"{r['step_p95']:.0f}", report.num(r["tps"]), report.num(r["engine_tps"]),
             report.num(r["tok_per_chunk"], 2), r["seats"], r["preempted"], r["statuses"]] for r in rows]
    return [
        f"{a.itl_concurrency} closed-loop completion streams (max_tokens uniform in "
        f"{int(a.itl_max_tokens * 0.75)}-{int(a.itl_max_tokens * 1.25)}, ignore_eos), one tenant. ITL is measured "
        f"client-side: gaps between consecutive content chunks of a stream (the first chunk's TTFT excluded), "
        f"over a {a.itl_window_s:g} s window after {a.itl_warmup_s:g} s of warm-up ({a.aimd_warmup_s:g} s for the "
        f"target_itl_ms run, {itl_label(a)}, whose seats must first come down while the initial streams run out). "
        "'engine step p95' is the p95 "
        "interval between engine steps and 'engine tok/s' the tokens the engine generated in the window, both from "
        "/admin/engines?since= (for reference; 'out tok/s' is counted by the client). Target = "
        + (f"{target:g} ms (given)" if a.itl_target_ms
           else f"{a.itl_target_factor:g} x unconstrained p95 = {target:g} ms")
        + f". Sweep of static max_running (no target) over {a.sweep}, largest first"
        + ("" if a.full_sweep else ", stopping at the first value whose p95 meets the target (throughput and ITL "
           "both grow with max_running, so that one is the best hand-tuned setting)") + ".",
        "", *report.table(head, body), "",
        (f"target_itl_ms seat_limit/running and queue depth over time (t from the start of the measured window): "
         f"{aimd['seat_trace']}"), "", *report.verdict_lines(verdicts),
    ]


async def run(bench: Bench) -> PartResult:
    a = bench.args
    print("part c: ITL target, AIMD vs hand-tuned max_running", flush=True)
    tenants: dict[str, dict[str, Any]] = {"a": {}}
    with bench.llmd("c-free", {"fairness": "vtc"}, tenants) as srv:
        free = await itl_run(bench, srv, "unconstrained", a.itl_warmup_s)
    target = a.itl_target_ms or max(1, round(a.itl_target_factor * free["p95"]))
    with bench.llmd("c-aimd", {"fairness": "vtc", **itl_scheduling(a, target)}, tenants) as srv:
        aimd = await itl_run(bench, srv, f"target_itl_ms {target:g} ({itl_label(a)})", a.aimd_warmup_s)
    sweep = await _sweep(bench, target)
    meeting = [r for r in sweep if r["p95"] <= target]
    best = max(meeting, key=lambda r: r["tps"]) if meeting else None
    verdicts = [(f"{itl_label(a)} p95 ITL {aimd['p95']:.0f} ms <= target {target:g} ms", aimd["p95"] <= target)]
    if best:
        verdicts.append(((f"{itl_label(a)} throughput {aimd['tps']:.0f} tok/s >= 0.9 x hand-tuned best "
                          f"({best['config']}: "
                         f"{best['tps']:.0f} tok/s)"), aimd["tps"] >= 0.9 * best["tps"]))
    else:
        verdicts.append(("no max_running in the sweep met the target (nothing to compare against)", False))
    rows = [free, aimd, *sweep]
    return PartResult(TITLE, _lines(a, rows, best, target, aimd, verdicts), verdicts,
                      {"rows": rows, "target_itl_ms": target})
