"""Batch tier on the real engine: does a large batch stay out of interactive traffic's way,
and does it take the whole engine back when interactive traffic stops?

One llmd server with SmolLM2 (same engine settings as bench/fairness.py), tenants `b`
(interactive) and `bulk` (Batch API). In order:
  1. solo: `b` sends steady streamed chats; TTFT p50/p95;
  2. reference: the engine's own batch throughput, a closed loop of max_num_seqs streams of
     the batch's request shape, no batch tier involved (engine tok/s from per-step stats);
  3. a large batch (OpenAI Batch API, /v1/completions items) starts and fills the engine;
  4. the same chats while the batch runs: TTFT p50/p95 against solo (target p95 <= 1.2x);
  5. the chats stop: the batch's engine tok/s over a window (target >= 0.9x the reference);
then the batch is cancelled. Figures go to docs/benchmarks.md ("## Batch tier").

    python bench/batch_yield.py            # ~6 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

import httpx

from bench.lib import report
from bench.lib.engines import Bench, Srv, add_server_args
from bench.lib.load import (
    AdminSampler,
    Workers,
    chat_series,
    chat_stats,
    seat_summary,
    warm_up,
)
from bench.lib.streams import new_client

SECTION = "## Batch tier"
PROMPT = "Batch item {i}. Write a long, detailed report about {topic}."
TOPICS = ["river ecology", "bridge design", "bread baking", "tide tables", "bee keeping", "glass making"]


def item_body(name: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "prompt": PROMPT.format(i=i, topic=TOPICS[i % len(TOPICS)]), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


async def engine_tps(sampler: AdminSampler, seconds: float) -> tuple[float, list[dict[str, Any]]]:
    """Tokens the engine generated per second over the next `seconds` (per-step stats)."""
    u0, t0 = time.time(), time.monotonic()
    await asyncio.sleep(seconds)
    u1, t1 = time.time(), time.monotonic()
    hist = [r for r in await sampler.history(u0) if r["t"] <= u1]
    return sum(r["generated_tokens"] for r in hist) / (u1 - u0), sampler.between(t0, t1)


async def api(client: httpx.AsyncClient, srv: Srv, method: str, path: str, **kw: Any) -> dict[str, Any]:
    r = await client.request(method, srv.url + "/v1" + path, headers=srv.headers("bulk"), **kw)
    r.raise_for_status()
    return r.json()


async def reference(client: httpx.AsyncClient, srv: Srv, sampler: AdminSampler, a: argparse.Namespace,
                    tag: str, base: int) -> float:
    """The engine's own throughput for the batch's request shape: a closed loop of max_num_seqs
    streams through the same server, no batch tier involved."""
    print(f"  reference ({tag}): closed loop of {a.max_num_seqs} streams, no batch tier", flush=True)
    ref = Workers(client, srv, "b", a.max_num_seqs, "/v1/completions",
                  lambda i: item_body(a.name, base + i, a.item_max_tokens), srv.headers("b"), stagger_s=2.0)
    ref.start()
    await asyncio.sleep(a.ramp_s)
    tps, samples = await engine_tps(sampler, a.window_s)
    await ref.stop()
    print(f"    engine {tps:.1f} tok/s; seats {seat_summary(samples)}", flush=True)
    return tps


async def submit_batch(client: httpx.AsyncClient, srv: Srv, a: argparse.Namespace) -> str:
    """Upload --items completions as a JSONL file and start a batch on it; its id."""
    lines = [json.dumps({"custom_id": f"item-{i}", "method": "POST", "url": "/v1/completions",
                         "body": item_body(a.name, i, a.item_max_tokens)}) for i in range(a.items)]
    f = await api(client, srv, "POST", "/files", files={"file": ("bulk.jsonl", "\n".join(lines).encode())},
                  data={"purpose": "batch"})
    b = await api(client, srv, "POST", "/batches", json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    print(f"  batch {b['id']}: {a.items} items", flush=True)
    return b["id"]


async def with_batch(client: httpx.AsyncClient, srv: Srv, sampler: AdminSampler,
                     a: argparse.Namespace) -> dict[str, Any]:
    """Steps 3-5: the batch alone, the chats beside it, then the batch alone again; then cancelled."""
    batch_id = await submit_batch(client, srv, a)
    await asyncio.sleep(a.ramp_s)
    alone_tps, alone_samples = await engine_tps(sampler, a.window_s)
    print(f"    batch alone, before the chats: {alone_tps:.1f} tok/s; seats {seat_summary(alone_samples)}", flush=True)
    print("  chats while the batch runs", flush=True)
    t0 = time.monotonic()
    under, _, _ = await chat_series(client, srv, a)
    during = sampler.between(t0, time.monotonic())
    under_stats = chat_stats(under, a.chat_timeout_s)
    print(f"    under batch: TTFT p50 {under_stats['p50']:.3f}s p95 {under_stats['p95']:.3f}s; "
          f"seats {seat_summary(during)}", flush=True)
    await asyncio.sleep(a.ramp_s)
    after_tps, after_samples = await engine_tps(sampler, a.window_s)
    print(f"    chats stopped: batch {after_tps:.1f} tok/s; seats {seat_summary(after_samples)}", flush=True)
    status = await api(client, srv, "GET", f"/batches/{batch_id}")
    await api(client, srv, "POST", f"/batches/{batch_id}/cancel")
    await asyncio.sleep(5.0)  # its sequences are aborted
    return {"under": under_stats, "after_tps": after_tps, "alone_tps": alone_tps,
            "during_seats": seat_summary(during), "after_seats": seat_summary(after_samples),
            "counts": status.get("request_counts"), "batch_id": batch_id,
            "preempted": during[-1]["preempted"] - during[0]["preempted"] if len(during) > 1 else math.nan}


async def run(bench: Bench) -> dict[str, Any]:
    a = bench.args
    sched = {"batch_seats_with_interactive": a.batch_seats, "interactive_quiet_s": a.quiet_s}
    server = [f'db_path = "{bench.scratch / "llmd.db"}"']
    with bench.llmd("batch", sched, {"b": {}, "bulk": {"classes": ["batch"], "default_class": "batch"}},
                    server=server) as srv:
        async with new_client() as client:
            await warm_up(client, srv, "b", a.name)
            sampler = AdminSampler(client, srv, a.name, every_s=0.5)
            sampler.start()
            print("  solo chats", flush=True)
            solo, _, _ = await chat_series(client, srv, a)
            solo_stats = chat_stats(solo, a.chat_timeout_s)
            print(f"    solo: TTFT p50 {solo_stats['p50']:.3f}s p95 {solo_stats['p95']:.3f}s", flush=True)
            ref_before = await reference(client, srv, sampler, a, "before", 100000)
            batch = await with_batch(client, srv, sampler, a)
            ref_after = await reference(client, srv, sampler, a, "after", 200000)
            await sampler.stop()
    ref_tps = (ref_before + ref_after) / 2  # either side of the batch: this shared box drifts
    return {"solo": solo_stats, "ref_tps": ref_tps, "ref_before": ref_before, "ref_after": ref_after, **batch}


def report_lines(r: dict[str, Any], a: argparse.Namespace, seconds: float, version: str) -> list[str]:
    s, u = r["solo"], r["under"]
    verdicts = [(f"chat TTFT p95 with the batch {u['p95']:.3f}s <= 1.2 x solo {s['p95']:.3f}s",
                 u["p95"] <= 1.2 * s["p95"]),
                (f"batch throughput alone {r['after_tps']:.1f} tok/s >= 0.9 x engine reference {r['ref_tps']:.1f}",
                 r["after_tps"] >= 0.9 * r["ref_tps"])]
    rows = [
        ["chat TTFT solo p50 / p95 s", f"{s['p50']:.3f} / {s['p95']:.3f}"],
        ["chat TTFT with the batch running p50 / p95 s", f"{u['p50']:.3f} / {u['p95']:.3f}"],
        ["chats ok / timeouts / errors (solo; with batch)",
         f"{s['ok']}/{s['timeouts']}/{s['errors']}; {u['ok']}/{u['timeouts']}/{u['errors']}"],
        ["batch seats while chatting", f"{r['during_seats']}, {r['preempted']} preemptions"],
        ["engine alone, closed loop (reference) tok/s",
         f"{r['ref_tps']:.1f} (mean of {r['ref_before']:.1f} before and {r['ref_after']:.1f} after the batch)"],
        ["batch alone before the chats tok/s", f"{r['alone_tps']:.1f}"],
        ["batch after the chats stopped tok/s", f"{r['after_tps']:.1f} ({r['after_seats']})"],
        ["batch request_counts at the end", f"{r['counts']} (then cancelled)"],
    ]
    return [
        SECTION, "", report.stamp(seconds, version=version), "",
        (f"One llmd server, SmolLM2 (float32, eager, max_num_seqs {a.max_num_seqs}, max_num_batched_tokens "
         f"{a.max_num_batched_tokens}, prefix caching, {a.kv_gib} GiB KV), 2-core CPU, client on the same machine. "
         f"Chats: {a.chat_requests} streamed chats, one every {a.chat_interval_s} s, max_tokens {a.chat_max_tokens}. "
         f"Batch: {a.items} /v1/completions items (max_tokens {a.item_max_tokens}, ignore_eos) through the Batch API; "
         f"`batch_seats_with_interactive = {a.batch_seats}`, `interactive_quiet_s = {a.quiet_s}` (as config.toml "
         "sets them for a CPU, where every sequence in a step lengthens it, so batch work sharing the engine at all "
         "shows in TTFT; a run with 1 seat measured p95 0.212 s against solo 0.151 s). "
         f"Reference: {a.max_num_seqs} closed-loop streams of the same shape through the same server, no batch tier, "
         "before the batch and again after it. "
         f"Throughputs are engine tokens/s from per-step stats over {a.window_s:.0f} s windows, after {a.ramp_s:.0f} s "
         "to ramp."),
        "", *report.table(["measure", "value"], rows), "", *report.verdict_lines(verdicts), "",
    ]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p)
    p.add_argument("--chat-requests", type=int, default=30)
    p.add_argument("--chat-interval-s", type=float, default=1.5)
    p.add_argument("--chat-max-tokens", type=int, default=16)
    p.add_argument("--chat-timeout-s", type=float, default=60.0)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--item-max-tokens", type=int, default=128)
    p.add_argument("--batch-seats", type=int, default=0, help="scheduling.batch_seats_with_interactive "
                   "(0, as config.toml sets it for a CPU: batch work yields the engine entirely)")
    p.add_argument("--quiet-s", type=float, default=1.0, help="scheduling.interactive_quiet_s")
    p.add_argument("--ramp-s", type=float, default=10.0)
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--docs", default=str(report.DOC))
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def main() -> int:
    a = parse_args()
    bench = Bench(a)
    t0 = time.monotonic()
    r = asyncio.run(run(bench))
    lines = report_lines(r, a, time.monotonic() - t0, bench.version)
    print("\n".join(lines))
    if not a.no_docs:
        report.write_section(Path(a.docs), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
