"""Goodput under overload, against what users would pick instead, in one run.

A mixed trace (bench/lib/goodput_trace.py: chat, RAG and bulk tenants, Poisson arrivals, lengths
from a fixed seed) is replayed at several multiples of the box's measured capacity against llmd
as shipped (config.toml, its filters and overload policy; the three tenants added as its demo
tenant), `vllm serve` with the same engine settings, and LiteLLM's proxy in front of that `vllm
serve` with per-key limits for each tenant's share (its documented way to keep tenants apart). Clients behave like the
OpenAI SDK (bench/lib/goodput_client.py). A request is good when it completes with TTFT and its
own p95 inter-token gap within config.toml's [slo] targets. Then a misbehaving bulk tenant (200
streams that resubmit 0.2 s after every refusal, from a process of their own with a lean client:
bench/lib/flood.py) floods while chat and RAG run their trace.

    .venv/bin/python bench/goodput.py                               # ~20 min on a 2-core CPU
    .venv/bin/python bench/goodput.py --loads 1,2 --servers llmd,vllm --no-flood --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import goodput_report, report
from bench.lib.engines import Bench, Srv, add_server_args
from bench.lib.flood import run_flood
from bench.lib.goodput_client import Outcome, call, replay
from bench.lib.goodput_trace import MIX, Request, closed_loop_bodies, trace
from bench.lib.peer_litellm import LIMITS_NOTE, litellm_proxy
from bench.lib.peer_vllm import exit_on_sigterm, vllm_serve
from bench.lib.streams import new_client

SHIPPED = Path(__file__).resolve().parent.parent / "config.toml"
DEADLINES = {"chat": 30.0, "rag": 30.0, "bulk": 120.0}  # what each tenant's client waits at most
PATH = "/v1/chat/completions"
FLOOD_LEAD_S = 5.0  # the flood runs this long before the others start


def shipped() -> dict[str, Any]:
    return tomllib.loads(SHIPPED.read_text(encoding="utf-8"))


def tenant_limits(capacity: float, scale: float, seconds_per_min: float = 60.0,
                  headroom: float = 1.2) -> dict[str, dict[str, int]]:
    """Each tenant's TPM/RPM: its demand at 1.0x capacity plus 20 %, so limits bite only in overload."""
    sample = trace(capacity, 600, 99, "m", scale)
    out: dict[str, dict[str, int]] = {}
    for t in MIX:
        mine = [r for r in sample if r.tenant == t]
        per_min = len(mine) / 600 * seconds_per_min
        toks = sum(r.max_tokens + len(r.body["messages"][0]["content"]) // 4 for r in mine) / 600 * seconds_per_min
        out[t] = {"rpm": max(1, round(per_min * headroom)), "tpm": max(1000, round(toks * headroom))}
    return out


def llmd_tenants() -> dict[str, dict[str, Any]]:
    """Each bench tenant as config.toml's demo tenant (its weight, limits and class): llmd keeps
    tenants apart by fair queueing, not by cutting each to a fixed share."""
    demo = {k: v for k, v in shipped()["tenants"][0].items() if k not in ("name", "keys")}
    return {t: dict(demo) for t in MIX}


def _model(cfg: dict[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = cfg["models"][0]
    return m


# Bench-only variants of the shipped config, each run beside it as "llmd+NAME" (never instead of it).
VARIANTS: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "itl200": ("target_itl_ms = 200 (the ITL controller)",
               lambda c: _model(c)["scheduling"].update(target_itl_ms=200)),
    "itl200m75": ("target_itl_ms = 200, target_itl_margin = 0.75",
                  lambda c: _model(c)["scheduling"].update(target_itl_ms=200, target_itl_margin=0.75)),
    "no-filters": ("no output or input filters", lambda c: _model(c).pop("filters", None)),
    "no-degrade": ("degradation steps = []", lambda c: _model(c).setdefault("degradation", {}).update(steps=[])),
    "on-time": ("max_wait_s = 1.0 (on-time admission)", lambda c: _model(c)["scheduling"].update(max_wait_s=1.0)),
    "chunk128": ("engine max_num_batched_tokens = 128",
                 lambda c: _model(c)["engine"].update(max_num_batched_tokens=128)),
    "chunk64": ("engine max_num_batched_tokens = 64",
                lambda c: _model(c)["engine"].update(max_num_batched_tokens=64)),
    "seats8": ("max_running = 8", lambda c: _model(c)["scheduling"].update(max_running=8)),
    "seats16": ("max_running = 16", lambda c: _model(c)["scheduling"].update(max_running=16)),
    "seats32": ("max_running = 32", lambda c: _model(c)["scheduling"].update(max_running=32)),
    "fifo": ("late_after_s = 0 (arrival order, no late last)",
             lambda c: _model(c)["scheduling"].update(late_after_s=0)),
    "seats4": ("max_running = 4", lambda c: _model(c)["scheduling"].update(max_running=4)),
    "seats64": ("max_running = 64 (all the engine's)", lambda c: _model(c)["scheduling"].update(max_running=64)),
    "ramp0": ("batch_ramp_s = 0 (batch work regains every seat at once after the quiet time)",
              lambda c: _model(c)["scheduling"].update(batch_ramp_s=0)),
    "hold1": ("refusal_hold_max_s = 1.0 (a hammering tenant's hold does not grow with its rate)",
              lambda c: c.setdefault("server", {}).update(refusal_hold_max_s=1.0)),
}


# -- servers ---------------------------------------------------------------------------
@contextlib.contextmanager
def vllm_server(bench: Bench) -> Iterator[Srv]:
    """`vllm serve` from its own venv with config.toml's engine settings."""
    eng = shipped()["models"][0]["engine"]
    log = bench.scratch / "vllm-server.log"
    with vllm_serve(bench.model, bench.args.name, eng, log) as url:
        yield Srv("vllm", url, {}, None, log)


@contextlib.contextmanager
def litellm_server(bench: Bench, upstream: Srv, limits: dict[str, dict[str, int]]) -> Iterator[Srv]:
    log = bench.scratch / "litellm.log"
    with litellm_proxy(upstream.url, bench.args.name, limits, log) as (url, keys):
        yield Srv("litellm", url, keys, None, log)


def headers(srv: Srv) -> dict[str, dict[str, str]]:
    return {t: srv.headers(t) for t in MIX}


# -- runs --------------------------------------------------------------------------------
async def measure_capacity(srv: Srv, name: str, seconds: float, seqs: int, seed: int, scale: float) -> float:
    """Requests/s of the mix the server completes with `seqs` streams kept in flight (a request
    still running at the end counts for the share of its tokens it got)."""
    supply = iter(closed_loop_bodies(seed, name, scale))
    done: list[float] = []
    running: list[Outcome] = []

    async def worker() -> None:
        async with new_client() as client:
            while True:
                tenant, body = next(supply)
                o = Outcome(Request(0, 0.0, tenant, body), time.monotonic())
                running.append(o)
                await call(client, srv.url + PATH, o, srv.headers(tenant), 600)
                running.remove(o)
                done.append(1.0 if o.completed else 0.0)

    tasks = [asyncio.create_task(worker()) for _ in range(seqs)]
    await asyncio.sleep(seconds)
    partial = sum(min(1.0, o.tokens / o.req.max_tokens) for o in running)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return (sum(done) + partial) / seconds


async def run_trace(srv: Srv, reqs: list[Request], drain_s: float, misbehaving: frozenset[str] = frozenset(),
                    flood: int = 0, flood_bodies: list[Request] | None = None,
                    scratch: Path | None = None) -> list[Outcome]:
    """Replay `reqs` (and keep `flood` misbehaving bulk streams going alongside, from a process of
    their own: bench/lib/flood.py); every outcome."""
    flooding: asyncio.Task[list[Outcome]] | None = None
    if flood:
        assert scratch is not None
        lasts = FLOOD_LEAD_S + max((r.at for r in reqs), default=0.0) + drain_s
        flooding = asyncio.create_task(run_flood(srv.url + PATH, srv.headers("bulk"), flood, lasts,
                                                 flood_bodies or [], scratch, DEADLINES["bulk"]))
        await asyncio.sleep(FLOOD_LEAD_S)  # the flood is established before the others arrive
    async with new_client() as client:
        out = await replay(client, srv.url + PATH, reqs, headers(srv), DEADLINES, drain_s, misbehaving)
    return out + (await flooding if flooding is not None else [])


async def warm_up(srv: Srv, a: argparse.Namespace) -> None:
    """Each RAG document once (and a chat), one at a time: every server starts with the prefix
    cache a running service has, not cold."""
    from bench.lib.goodput_trace import documents

    async with new_client() as client:
        for doc in [*documents(a.seed, a.scale), "Hello"]:
            body = {"model": a.name, "messages": [{"role": "user", "content": doc}], "max_tokens": 1}
            o = Outcome(Request(0, 0.0, "rag", body), time.monotonic())
            await call(client, srv.url + PATH, o, srv.headers("rag"), 120)


async def settle(srv: Srv, seconds: float = 3.0) -> None:
    """Let cancelled streams be aborted and the queues empty before the next run."""
    await asyncio.sleep(seconds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    eng = shipped()["models"][0]["engine"]  # vllm serve gets config.toml's engine settings
    p.set_defaults(kv_gib=eng["kv_cache_gib"], max_num_seqs=eng["max_num_seqs"],
                   max_num_batched_tokens=eng["max_num_batched_tokens"])
    p.add_argument("--loads", default="0.5,1,1.5,2", help="multiples of the measured capacity")
    p.add_argument("--seconds", type=float, default=45.0, help="arrival window of each run")
    p.add_argument("--drain-s", type=float, default=12.0, help="how long clients wait after the last arrival")
    p.add_argument("--capacity", type=float, help="requests/s of the mix (default: measured on vllm serve)")
    p.add_argument("--capacity-s", type=float, default=45.0)
    p.add_argument("--servers", default="vllm,litellm,llmd")
    p.add_argument("--flood", default="llmd",
                   help="servers (llmd+VARIANT for a variant) that also get the misbehaving flood ('' for none)")
    p.add_argument("--flood-streams", type=int, default=200)
    p.add_argument("--flood-load", type=float, default=1.0, help="the chat and RAG trace's load during the flood")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--scale", type=float, default=0.25,
                   help="every length times this (1: the issue's shape, for a GPU box; 0.25 fits a 2-core CPU)")
    p.add_argument("--variants", default="",
                   help=f"bench-only llmd variants run beside the shipped one, '+' joins two ({', '.join(VARIANTS)})")
    p.add_argument("--no-write", action="store_true")


async def server_runs(bench: Bench, srv: Srv, a: argparse.Namespace, capacity: float, loads: list[float],
                      flood: bool, rows: dict[str, Any]) -> None:
    """Every load's trace (and the flood pair when asked) against one running server."""
    await warm_up(srv, a)
    for load in loads:
        reqs = trace(capacity * load, a.seconds, a.seed, a.name, a.scale)
        t0 = time.monotonic()
        outs = await run_trace(srv, reqs, a.drain_s)
        rows[f"{srv.kind}@{load:g}"] = goodput_report.summarise(outs, a.seconds, SLO)
        print(f"  {srv.kind} at {load:g}x ({len(reqs)} requests, {time.monotonic() - t0:.0f}s): "
              f"{goodput_report.one_line(rows[f'{srv.kind}@{load:g}'])}", flush=True)
        await settle(srv)
    if flood:
        interactive = ("chat", "rag")
        reqs = trace(capacity * a.flood_load, a.seconds, a.seed, a.name, a.scale, interactive)
        bulk = list(trace(capacity * 4, 600, a.seed + 1, a.name, a.scale, ("bulk",)))
        for tag, n in (("alone", 0), ("flood", a.flood_streams)):
            outs = await run_trace(srv, reqs, a.drain_s, flood=n, flood_bodies=bulk, scratch=bench.scratch)
            rows[f"{srv.kind}@{tag}"] = goodput_report.summarise(outs, a.seconds, SLO)
            print(f"  {srv.kind} {tag}: {goodput_report.one_line(rows[f'{srv.kind}@{tag}'])}", flush=True)
            await settle(srv, 8.0)


def patch(name: str) -> Callable[[dict[str, Any]], None]:
    """One variant, or several joined by '+', applied in order."""
    unknown = [n for n in name.split("+") if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant {unknown[0]!r}: one of {', '.join(VARIANTS)}")

    def apply(cfg: dict[str, Any]) -> None:
        for n in name.split("+"):
            VARIANTS[n][1](cfg)
    return apply


SLO = (float(shipped()["slo"]["ttft_p95_s"]), float(shipped()["slo"]["itl_p95_s"]))


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(a)
    servers = [s for s in a.servers.split(",") if s]
    floods = {s for s in a.flood.split(",") if s}
    loads = [float(x) for x in a.loads.split(",") if x]
    rows: dict[str, Any] = {}
    capacity = a.capacity
    t_start = time.monotonic()
    if {"vllm", "litellm"} & set(servers) or capacity is None:
        with vllm_server(bench) as vllm:
            if capacity is None:
                capacity = await measure_capacity(vllm, a.name, a.capacity_s, a.max_num_seqs, a.seed, a.scale)
                print(f"  capacity: {capacity:.3f} requests/s of the mix", flush=True)
                if capacity <= 0:
                    sys.exit(f"nothing completed in {a.capacity_s:g}s: see {vllm.log}")
                await settle(vllm, 10.0)
            limits = tenant_limits(capacity, a.scale)
            if "vllm" in servers:
                await server_runs(bench, vllm, a, capacity, loads, "vllm" in floods, rows)
            if "litellm" in servers:
                with litellm_server(bench, vllm, limits) as lite:
                    await server_runs(bench, lite, a, capacity, loads, "litellm" in floods, rows)
    limits = tenant_limits(capacity, a.scale)
    if "llmd" in servers:
        with bench.llmd_shipped("llmd", llmd_tenants()) as srv:
            await server_runs(bench, srv, a, capacity, loads, "llmd" in floods, rows)
    for v in (v for v in a.variants.split(",") if v):
        with bench.llmd_shipped(f"llmd-{v}", llmd_tenants(), patch(v), kind=f"llmd+{v}") as srv:
            await server_runs(bench, srv, a, capacity, loads, srv.kind in floods, rows)
    variants = {v: "; ".join(VARIANTS[n][0] for n in v.split("+")) for v in a.variants.split(",") if v}
    return {"capacity": capacity, "limits": limits, "rows": rows, "loads": loads, "servers": servers,
            "variants": variants,
            "seconds": time.monotonic() - t_start, "version": bench.version, "slo": SLO,
            "litellm_note": LIMITS_NOTE if "litellm" in servers else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    a = p.parse_args()
    for v in (v for v in a.variants.split(",") if v):
        patch(v)  # an unknown name stops the bench before any server starts
    exit_on_sigterm()  # a killed bench still stops its servers (their own process groups)
    res = asyncio.run(main_async(a))
    lines = goodput_report.lines(res, a)
    print("\n".join(lines))
    if not a.no_write:
        report.write_section(report.DOC, lines)


if __name__ == "__main__":
    main()
