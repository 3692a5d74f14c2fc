"""Part (a), noisy neighbour: does a flooding tenant hurt another tenant's time to first token?

Tenant A keeps N long generations in flight; tenant B sends short chats at a steady rate.
B's TTFT solo, under A's flood through llmd (VTC), through llmd with target_itl_ms, with A's
flood sent as class batch, and through `llmd-vllm serve` (FCFS, no tenants).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from bench.fairness_parts import PartResult, itl_label, itl_scheduling
from bench.lib import report
from bench.lib.engines import Bench, Srv
from bench.lib.load import (
    AdminSampler,
    Workers,
    chat_series,
    chat_stats,
    long_body,
    preempted,
    seat_summary,
    seat_trace,
    warm_up,
)
from bench.lib.streams import new_client, output_tokens_between, statuses

TITLE = "(a) Noisy neighbour"
CONFIGS = ("vtc", "itl", "vllm", "batch", "shipped")
QUICK: dict[str, Any] = {"flood_inflight": 24, "chat_requests": 6, "chat_interval_s": 1.0, "buildup_s": 5.0,
                         "chat_timeout_s": 60.0, "flood_max_tokens": 64}
FLOODED = ("vtc", "itl", "batch", "shipped")  # the llmd rows held to B's solo TTFT


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("part a: noisy neighbour")
    g.add_argument("--flood-inflight", type=int, default=200, help="tenant A's streams in flight")
    g.add_argument("--flood-max-tokens", type=int, default=256)
    g.add_argument("--flood-class", default="interactive", choices=["interactive", "batch"],
                   help="tenant A's X-Priority-Class (B is always interactive)")
    g.add_argument("--buildup-s", type=float, default=15.0, help="A floods alone this long before B starts")
    g.add_argument("--chat-requests", type=int, default=40, help="tenant B's chats")
    g.add_argument("--chat-interval-s", type=float, default=1.5)
    g.add_argument("--chat-max-tokens", type=int, default=16)
    g.add_argument("--chat-timeout-s", type=float, default=60.0, help="client bound on a chat; counts as its TTFT")
    g.add_argument("--a-configs", default="vtc,itl,vllm",
                   help=f"flood configurations after B solo, comma list of: {', '.join(CONFIGS)} "
                        "(batch: llmd vtc with A's flood sent as class batch; shipped: config.toml as users run "
                        "it, its filters and ITL target, with B's solo measured on it too)")
    g.add_argument("--itl-factor", type=float, default=2.0, help="target_itl_ms = this x B's solo ITL p50")
    g.add_argument("--target-itl-ms", type=float, help="part a's target_itl_ms (default: from --itl-factor)")


async def flood_run(bench: Bench, srv: Srv, label: str, flood_class: str) -> dict[str, Any]:
    """B's chat series while A keeps its flood in flight; B's TTFT and A's throughput over B's window."""
    a = bench.args
    async with new_client() as client:
        await warm_up(client, srv, "b", a.name)
        sampler = AdminSampler(client, srv, a.name)
        sampler.start()
        flood = Workers(client, srv, "a", a.flood_inflight, "/v1/completions",
                        lambda i: long_body(a.name, i, a.flood_max_tokens), srv.headers("a", flood_class))
        flood.start()
        print(f"    flood: {a.flood_inflight} streams in flight; B starts in {a.buildup_s:.0f}s", flush=True)
        await asyncio.sleep(a.buildup_s)
        out, t0, t1 = await chat_series(client, srv, a)
        await flood.stop()
        await sampler.stop()
    row = {"config": label, **chat_stats(out, a.chat_timeout_s),
           "a_tps": output_tokens_between(flood.results, t0, t1) / (t1 - t0),
           "a_statuses": statuses(flood.results), "seats": seat_summary(sampler.between(t0, t1)),
           "window_s": t1 - t0, "seat_trace": seat_trace(sampler.samples, t0),
           "preempted": preempted(sampler.between(t0, t1))}
    print(f"    {label}: B TTFT p50 {row['p50']:.3f}s p95 {row['p95']:.3f}s (timeouts {row['timeouts']}); "
          f"A {row['a_tps']:.0f} tok/s; seats {row['seats']}; preempted {row['preempted']}", flush=True)
    return row


async def _solo(bench: Bench, srv: Srv) -> dict[str, Any]:
    a = bench.args
    async with new_client() as client:
        await warm_up(client, srv, "b", a.name)
        out, t0, t1 = await chat_series(client, srv, a)
    solo = {"config": "llmd, B solo", **chat_stats(out, a.chat_timeout_s), "a_tps": math.nan,
            "a_statuses": "-", "seats": "-", "window_s": t1 - t0, "preempted": "-"}
    print(f"    solo: B TTFT p50 {solo['p50']:.3f}s p95 {solo['p95']:.3f}s, ITL p50 {solo['itl_p50_ms']:.1f} ms",
          flush=True)
    return solo


def _verdicts(rows: dict[str, dict[str, Any]]) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for key in FLOODED:
        if (r := rows.get(key)) is None:
            continue
        solo = rows["shipped-solo" if key == "shipped" else "solo"]
        out.extend((f"{r['config']}: B TTFT {q} {r[q]:.3f}s within +1 s of solo {solo[q]:.3f}s",
                    r[q] <= solo[q] + 1.0) for q in ("p50", "p95"))
        if key == "itl":
            out.extend((f"{r['config']}: B TTFT {q} {r[q]:.3f}s within 2x of solo {solo[q]:.3f}s",
                        r[q] <= 2 * solo[q]) for q in ("p50", "p95"))
    return out


def _lines(a: argparse.Namespace, rows: dict[str, dict[str, Any]], target: float,
           verdicts: list[tuple[str, bool]]) -> list[str]:
    head = ["configuration", "B TTFT p50 s", "B TTFT p95 s", "B TTFT max s", "B ok/timeouts/errors", "B ITL p50 ms",
            "A out tok/s", "A requests", "seat limit", "preempted"]
    body = [[r["config"], f"{r['p50']:.3f}", f"{r['p95']:.3f}", f"{r['max']:.3f}",
             f"{r['ok']}/{r['timeouts']}/{r['errors']}", report.num(r["itl_p50_ms"]), report.num(r["a_tps"]),
             r["a_statuses"], r["seats"], r["preempted"]] for r in rows.values()]
    lines = [
        f"Tenant A keeps {a.flood_inflight} completions in flight (max_tokens {a.flood_max_tokens}, ignore_eos, "
        f"class {a.flood_class} unless the row says otherwise, all sent at once and each resubmitted as it ends, "
        "a refused one after its Retry-After as the OpenAI SDK waits); "
        f"after {a.buildup_s:g} s tenant B sends {a.chat_requests} chats, one every {a.chat_interval_s:g} s "
        f"(max_tokens {a.chat_max_tokens}, interactive), client timeout {a.chat_timeout_s:g} s (a timeout counts "
        f"as TTFT = timeout). target_itl_ms = {a.itl_factor:g} x B's solo ITL p50"
        + (" (overridden)" if a.target_itl_ms else "") + f" = {target:g} ms. "
        "A's throughput is over B's window (first send to last answer); 'A requests' counts A's streams by outcome "
        "(cut = still running when the flood stopped; llmd sends no response headers before a request's first "
        "token, so queued ones are 'cut before response'); 'seat limit' is llmd's seat_limit range from "
        "/admin/engines over that window, 'preempted' the scheduler's preemptions in it (a preempted sequence is "
        "aborted, re-queued and resumed later). ITL = gaps between content chunks.",
        "", *report.table(head, body), "",
    ]
    for key, r in rows.items():
        if key in FLOODED:
            lines += [f"seat_limit/running and queue depth, {r['config']} (t from B's first chat): {r['seat_trace']}",
                      ""]
    return lines + report.verdict_lines(verdicts)


async def run(bench: Bench) -> PartResult:
    a = bench.args
    rows: dict[str, dict[str, Any]] = {}
    print("part a: noisy neighbour", flush=True)
    tenants: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    with bench.llmd("a-vtc", {"fairness": "vtc"}, tenants) as srv:
        solo = rows["solo"] = await _solo(bench, srv)
        if "vtc" in a.a_configs:
            rows["vtc"] = await flood_run(bench, srv, "llmd vtc, A flooding", a.flood_class)
    target = a.target_itl_ms or max(1, round(a.itl_factor * solo["itl_p50_ms"]))
    if "itl" in a.a_configs:
        with bench.llmd("a-itl", {"fairness": "vtc", **itl_scheduling(a, target)}, tenants) as srv:
            rows["itl"] = await flood_run(bench, srv, f"llmd vtc + target_itl_ms {target:g} ({itl_label(a)}), "
                                                      "A flooding", a.flood_class)
    if "batch" in a.a_configs:
        with bench.llmd("a-batch", {"fairness": "vtc"}, tenants) as srv:
            rows["batch"] = await flood_run(bench, srv, "llmd vtc, A flooding as class batch", "batch")
    if "shipped" in a.a_configs:
        with bench.llmd_shipped("a-shipped", tenants) as srv:
            rows["shipped-solo"] = {**await _solo(bench, srv), "config": "llmd as shipped (config.toml), B solo"}
            rows["shipped"] = await flood_run(bench, srv, "llmd as shipped (config.toml), A flooding", a.flood_class)
    if "vllm" in a.a_configs:
        with bench.vllm("a-vllm") as srv:
            rows["vllm"] = await flood_run(bench, srv, "vllm serve (FCFS), A flooding", a.flood_class)
    verdicts = _verdicts(rows)
    return PartResult(TITLE, _lines(a, rows, target, verdicts), verdicts, {"rows": rows, "target_itl_ms": target})
