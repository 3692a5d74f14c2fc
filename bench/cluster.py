"""Issue J's cluster figures, on llmd processes with fake engines (a prefix cache, a prefill cost
per uncached token): routing beside round robin, failover, a quota across nodes.

  (a) routing: 3 nodes, multi-turn chats on a few long Zipf-popular system prompts, each
      request entering at a random node; load swept from light to past round robin's capacity,
      our placement and round robin in the same run; prefix hit rate beside a single shared
      cache's (the same prompts through one LRU of the three nodes' size); TTFT p90 at 70 %;
      then one hot prefix with half the traffic: queues stay even, nothing fails (runs of their
      own, one per seed of chats, 120 s of arrivals: `--hot-seconds`). `--homes on|off` overrides the shipped
      `[cluster] balanced_homes` (its variants are filed by hand, beside (a)).
      The workload is where a prefix router matters (`pressure`, bench/lib/cluster.py): the
      system prompts and live chats overflow one node's KV cache but fit the three's, so round
      robin thrashes every cache while each prompt can have a home. Where one node's cache
      already holds the popular prompts (`light`, the first workload) round robin hits 0.6 and
      no router can triple it. Even under pressure the ratio has a ceiling near 3 on 3 nodes:
      with LRU caches round robin's random node holds about C/W of a working set W, the owner
      of a prompt min(1, 3C/W) of it (the offline oracle, bench/lib/prefix_oracle.py, prints
      both for each load, from the same kind of chats through LRUs without nodes).
  (b) failover: kill -9 of a node running >= 30 streams (bench/cluster_faults.py).
  (d) one tenant's tokens per minute across 3 nodes.
  (h) chats on one hot system prompt entering the nodes in turn: later turns on their history's
      node, and (a)'s 70 % beside the code before (`--baseline CHECKOUT`, `--rounds`).
  (s) llmd's routing against SGLang's router (`cache_aware`, `round_robin`) in front of the same
      nodes with their routing off, on (a)'s chats from 30 % to past capacity (`--s-loads`);
      `--s-rounds N` repeats each load, and `--s-from` joins several calls' `--save` files, the
      verdicts then on the medians.
Gossip bandwidth and detection times (c): bench/cluster_gossip.py.

  .venv/bin/python bench/cluster.py [--parts a,d] [--seconds 120] [--workload pressure|light]
  # (a) split into runs of a few minutes: measure the capacity once, pass it to the others, merge
  .venv/bin/python bench/cluster.py --parts a --loads 0.3,0.5 --no-hot --save a1.json
  .venv/bin/python bench/cluster.py --parts a --loads 0.7,1.0 --capacity C --save a2.json
  .venv/bin/python bench/cluster.py --merge a1.json,a2.json
  .venv/bin/python bench/cluster.py --parts h --capacity 4.5 --baseline ../before --rounds 2
  .venv/bin/python bench/cluster.py --parts s --capacity 4.5
  # (s) at light load, three rounds in three calls of under 20 minutes each, then read together
  .venv/bin/python bench/cluster.py --parts s --capacity 4.5 --s-loads 0.3,0.6 --s-rounds 1 --save s1.json
  .venv/bin/python bench/cluster.py --parts s --s-from s1.json,s2.json,s3.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import cluster_sglang, peer_sglang, report, stats
from bench.lib.cluster import INTRO, SECTION, WORKLOADS, Node, Session, Workload, start_nodes, stop_nodes
from bench.lib.peer_sglang import sglang_router
from bench.lib.prefix_oracle import chat_trace, prompt_ids, routed_hit_rates, shared_cache_hit_rate
from bench.lib.streams import Stream, new_client, statuses, stream

LOADS = (0.3, 0.5, 0.7, 1.0, 1.3)
SECONDS = 120.0  # arrivals per run: a chat of 4-7 turns lasts about 20-30 s, so 40 s runs were mostly
# ramp-up and drain; 120 s, the first 40 not counted, measures the steady state
PREFILL_TPS = 3000.0
KV_BLOCKS = 900
THINK_S = 3.0  # a user reads the answer before the next turn


async def chats(nodes: list[Node], wl: Workload, sessions_per_s: float, seconds: float,
                seed: int, log: list[tuple[dict[str, Any], Stream]], in_turn: bool = False,
                later: list[tuple[float, bool]] | None = None, via: str | None = None,
                cut: bool = False) -> None:
    """Chat sessions arriving as a Poisson process, drawn before the run (`Workload.sessions`:
    every run of a seed sends the same chats, whatever the placement); each sends its turns one
    after another (THINK_S of reading between), every turn to its drawn node, as a load
    balancer would (`in_turn`: to the nodes in turn, request by request, as a round-robin
    balancer would). Sessions start at their drawn times, not after sleeps that a busy client
    overshoots. `later` gets, for each turn after a chat's first, (its send time, whether it ran
    on the node its previous turn ran on: where its history is cached). `via`: every turn to
    this URL (a router in front of the nodes), whatever its drawn node; `cut`: no turn starts
    after the arrivals' `seconds` (the drain after them is never measured, so not waited for)."""
    client = new_client(timeout=300)
    sent = iter(range(10**9))

    async def session(plan: Session) -> None:
        prev: str | None = None
        for question, ingress in zip(plan.questions, plan.ingress, strict=True):
            if cut and time.monotonic() >= t0 + seconds:
                return
            body = wl.next_turn(plan.chat, question)
            s = Stream("a", time.monotonic(), texts=[])
            log.append((body, s))
            url = via or (nodes[next(sent) % len(nodes)] if in_turn else nodes[ingress]).srv.url
            await stream(client, url + "/v1/chat/completions", s, body)
            if not s.ok:
                return
            if later is not None and prev is not None:
                later.append((s.t_send, s.node == prev))
            prev = s.node
            wl.answered(plan.chat, "".join(s.texts or []))
            await asyncio.sleep(THINK_S)

    tasks: list[asyncio.Task[None]] = []
    t0 = time.monotonic()
    for plan in wl.sessions(sessions_per_s, seconds, len(nodes), seed):
        await asyncio.sleep(max(0.0, t0 + plan.at - time.monotonic()))
        tasks.append(asyncio.create_task(session(plan)))
    await asyncio.gather(*tasks)
    await client.aclose()


async def sample_queues(nodes: list[Node], stop: asyncio.Event, out: dict[str, list[tuple[float, int]]],
                        gossip: dict[str, list[tuple[float, int, int]]] | None = None,
                        bound: list[bool] | None = None,
                        inside: dict[str, list[tuple[float, int]]] | None = None) -> None:
    """Each node's requests waiting (llmd's queue and the engine's), every 0.25 s, stamped with
    time.monotonic() (a run counts the samples of its measured window only); the gossip
    bytes it has sent and received so far; whether its balanced homes bind; its requests in
    the node (waiting and running: the load a hot prompt would pile on it while seats are free)."""
    async with httpx.AsyncClient(timeout=5) as h:
        while not stop.is_set():
            for n in nodes:
                with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
                    st = (await h.get(n.srv.url + "/admin/cluster")).json()
                    now, queued = time.monotonic(), int(st["self"]["queued"])
                    out.setdefault(n.name, []).append((now, queued))
                    if inside is not None:
                        running = sum(int(v["running"]) for v in st["self"]["versions"])
                        inside.setdefault(n.name, []).append((now, queued + running))
                    if bound is not None:
                        bound.append(bool(st["homes"].get("bound")))
                    if gossip is not None:
                        g = st["gossip"]
                        gossip.setdefault(n.name, []).append((time.monotonic(), g["sent_bytes"], g["recv_bytes"]))
            await asyncio.sleep(0.25)


async def part_c(tmp: Path, seconds: float) -> list[str]:
    """What real nodes' states cost on the wire: 3 nodes serving the chat workload at half of
    round robin's capacity (their load, prefix deltas and tenants' counts all changing)."""
    nodes = await asyncio.to_thread(start_nodes, tmp / "gossip", 3, "score", 5.0, KV_BLOCKS, PREFILL_TPS)
    log: list[tuple[dict[str, Any], Stream]] = []
    queues: dict[str, list[tuple[float, int]]] = {}
    gossip: dict[str, list[tuple[float, int, int]]] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_queues(nodes, stop, queues, gossip))
    try:
        await chats(nodes, Workload(seed=3), 8.0 / 5.5, seconds, 3, log)
    finally:
        stop.set()
        await sampler
        await asyncio.to_thread(stop_nodes, nodes)
    rows, worst = [], 0.0
    for name, xs in sorted(gossip.items()):
        (t0, s0, r0), (t1, s1, r1) = xs[0], xs[-1]
        sent, recv = (s1 - s0) / (t1 - t0), (r1 - r0) / (t1 - t0)
        worst = max(worst, sent, recv)
        rows.append([name, f"{sent:.0f}", f"{recv:.0f}"])
    ok = sum(1 for _, s in log if s.ok)
    lines = [f"3 nodes serving {ok} chat turns at 8 req/s for {seconds:.0f} s (states with real loads, prefix "
             "deltas and tenants' counts; the admin views this bench polls every 0.25 s are HTTP, not gossip).", ""]
    lines += report.table(["node", "gossip sent B/s", "gossip received B/s"], rows)
    lines += ["", *report.verdict_lines([(f"3 nodes under load: the busiest node's max(sent, received) <= 2 KB/s "
                                          f"({worst:.0f} B/s)", worst <= 2048)])]
    return lines


def mean_prompt_tokens(wl: Workload, n: int = 200) -> float:
    """The workload's mean prompt, in the fake engine's tokens (16-word answers assumed)."""
    bodies = []
    for _ in range(n // 4):
        chat = wl.new_chat()
        for _ in range(chat.turns):
            bodies.append(wl.next_turn(chat))
            wl.answered(chat, " ".join(["alpha"] * 16))
    ids = prompt_ids(bodies)
    return sum(map(len, ids)) / len(ids)


# The hot-prefix run's arrivals: in 40 s runs its nodes' mean queues are under one request and
# their max/mean reads which node a few bursts hit (1.2-2.3x over runs of either routing, (a5));
# 120 s runs of the default read 1.11-1.24 ((a7)).
HOT_SECONDS = 120.0
# Its chats, one run each: which prompts hash to which homes, and so which node carries what,
# is the seed's; three runs of one build read max/mean 1.18-1.80 at 70 % ((a16)).
HOT_SEEDS = (1, 2, 3)


async def one_run(tmp: Path, placement: str, req_per_s: float, seconds: float, hot: float | None = None,
                  seed: int = 1, warmup_s: float = 0.0, workload: str = "pressure",
                  homes: bool | None = None, root: Path | None = None, in_turn: bool = False,
                  peer: str | None = None, cut: bool = False) -> dict[str, Any]:
    """One run; `root`: the nodes run that checkout's llmd (a baseline); `in_turn`: the requests
    enter the nodes in turn (`chats`); `peer`: SGLang's router with that policy in front of the
    nodes, their own routing off (`routing = "local"`), every request sent to it; `cut`: see `chats`."""
    # "single": one node with the three nodes' KV cache, prefill rate and seats together: the
    # single shared cache the issue compares with, measured (running sequences pin its KV too)
    n, scale = (1, 3) if placement == "single" else (3, 1)
    kv_blocks, wl_kw = _workload(workload)
    turns = wl_kw.get("turns", (4, 7))
    extra = ("" if homes is None else f"balanced_homes = {str(homes).lower()}\n") + (
        'routing = "local"' if peer else "")
    where = tmp / f"{peer or placement}-{req_per_s:.1f}-{hot}-{time.monotonic():.0f}"
    nodes = await asyncio.to_thread(start_nodes, where, n, "score" if placement == "single" else placement, 5.0,
                                    kv_blocks * scale, PREFILL_TPS * scale, seqs=32 * scale, cluster_extra=extra,
                                    root=root)
    log: list[tuple[dict[str, Any], Stream]] = []
    later: list[tuple[float, bool]] = []
    queues: dict[str, list[tuple[float, int]]] = {}
    bound: list[bool] = []
    inside: dict[str, list[tuple[float, int]]] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_queues(nodes, stop, queues, bound=bound, inside=inside))
    try:
        wl = Workload(seed=seed, hot=hot, **wl_kw)
        async with _front(nodes, peer, where) as via:
            # a chat of t turns sends t requests: sessions per second from requests per second
            await chats(nodes, wl, req_per_s / (sum(turns) / 2), seconds, seed, log, in_turn, later, via, cut)
    finally:
        stop.set()
        await sampler
        await asyncio.to_thread(stop_nodes, nodes)
    t_warm = log[0][1].t_send + warmup_s if log else 0.0  # the caches warm up first: not measured
    done = [(b, s) for b, s in log if s.ok]
    done.sort(key=lambda bs: bs[1].t_first or bs[1].t_send)  # the order the caches saw them
    ok = [s for _, s in done if s.t_send >= t_warm]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    prompt = sum(s.prompt_tokens or 0 for s in ok)
    cached = sum(s.cached_tokens or 0 for s in ok)
    t_end = log[0][1].t_send + seconds if log else 0.0  # the last session starts before this
    means = window_means(queues, t_warm, t_end)
    in_node = window_means(inside, t_warm, t_end)
    window = [s for _, s in log if t_warm <= s.t_send < t_end]
    per_node: dict[str, list[int]] = {}  # node: [requests, of them on the first system prompt (the hot one)]
    for b, s in log:
        if t_warm <= s.t_send < t_end and s.node:
            c = per_node.setdefault(s.node, [0, 0])
            c[0] += 1
            c[1] += b["messages"][0]["content"] == wl.systems[0]
    halves = [[s.ttft for s in window if s.ttft is not None and (s.t_send >= (t_warm + t_end) / 2) == late]
              for late in (False, True)]
    return {"placement": f"sglang {peer}" if peer else placement, "rate": req_per_s, "requests": len(log),
            "ok": len(done),
            "failed": len(log) - len(done), "errors": statuses([s for _, s in log if not s.ok]),
            "hit": cached / prompt if prompt else 0.0,
            "oracle": shared_cache_hit_rate(prompt_ids(b for b, _ in done), 3 * kv_blocks,
                                            counted=[s.t_send >= t_warm for _, s in done]),
            "ttft_p50": stats.pct(ttfts, 50) if ttfts else None, "ttft_p90": stats.pct(ttfts, 90) if ttfts else None,
            "queue_max_over_mean": _max_over_mean(means), "queues": means,
            "inside_max_over_mean": _max_over_mean(in_node), "inside": in_node,
            "homes_bound": sum(bound) / len(bound) if bound else 0.0, "per_node": per_node,
            # steady state: the requests sent per second while sessions still start, and TTFT p50
            # in each half of that window (a queue that keeps growing: the second far over the first)
            "sent_per_s": len(window) / (t_end - t_warm) if t_end > t_warm else None,
            "later": len([1 for t, _ in later if t_warm <= t < t_end]),
            "later_on_history": sum(same for t, same in later if t_warm <= t < t_end),
            "ttft_p50_halves": [stats.pct(h, 50) if h else None for h in halves]}


@contextlib.asynccontextmanager
async def _front(nodes: list[Node], peer: str | None, where: Path) -> AsyncIterator[str | None]:
    """SGLang's router with policy `peer` in front of `nodes` (its URL), or None without a peer."""
    if peer is None:
        yield None
        return
    cm = sglang_router([n.srv.url for n in nodes], peer, where / "router.log")
    url = await asyncio.to_thread(cm.__enter__)
    try:
        yield url
    finally:
        await asyncio.to_thread(cm.__exit__, None, None, None)


def _max_over_mean(means: dict[str, float]) -> float | None:
    """The busiest node's mean over the nodes' mean; None where nothing was sampled or all are 0."""
    m = stats.mean(means.values()) if means else 0.0
    return max(means.values()) / m if m > 0 else None


def window_means(samples: dict[str, list[tuple[float, int]]], t0: float, t1: float) -> dict[str, float]:
    """Each node's mean queue over the samples taken in [t0, t1): the window whose hit rate and
    TTFT a run reports. The cold caches' warm-up (every prompt a miss) and the drain after the
    last session starts are left out, as they are from those figures."""
    kept = {k: [q for t, q in v if t0 <= t < t1] for k, v in samples.items()}
    return {k: stats.mean(v) for k, v in kept.items() if v}


def _workload(name: str) -> tuple[int, dict[str, Any]]:
    """A named workload's KV blocks per node and its Workload arguments (bench/lib/cluster.py)."""
    kw = dict(WORKLOADS[name])
    return int(kw.pop("kv_blocks")), kw


GROWTH = 1.5  # a queue that grows: TTFT p50 in the second half of a run's window over the first's
LADDER_TOP = 3.0  # the ladder stops here (x the no-cache rate) if no rung grew


async def measure_capacity(tmp: Path, seconds: float, workload: str, bare: float) -> tuple[float, list[dict[str, Any]]]:
    """Round robin's capacity, measured: the highest rate on a ladder (from 0.8x `bare`, the rate
    the nodes' prefill serves with no cache, in steps of 0.1x) at which its queue does not keep
    growing over a run (TTFT p50 in the second half of the window under GROWTH x the first's,
    nothing failed). A formula (`bare` over round robin's miss rate) read 8.3 req/s where 5.8
    already grew TTFT p50 from 1.8 s to 4.9 s within a 120 s run: it left out the decode steps
    and the longer prompts of a chat's later turns. Returns (capacity, the ladder's runs)."""
    ladder: list[dict[str, Any]] = []
    stable_rates: list[float] = []
    rate = 0.8 * bare
    while rate <= LADDER_TOP * bare:  # a cluster that never queues (a broken bench) ends the ladder too
        r = await one_run(tmp, "round_robin", rate, seconds, warmup_s=seconds / 3, workload=workload)
        ladder.append(r)
        first, second = r["ttft_p50_halves"]
        stable = not r["failed"] and first is not None and second is not None and second <= GROWTH * first
        print(f"ladder: round robin at {rate:.2f} req/s, TTFT p50 {first} -> {second} s: "
              f"{'stable' if stable else 'growing'}", flush=True)
        if not stable:
            break
        stable_rates.append(rate)
        rate += 0.1 * bare
    return (stable_rates[-1] if stable_rates else ladder[0]["rate"]), ladder


async def part_a(tmp: Path, seconds: float, loads: tuple[float, ...] = LOADS, workload: str = "pressure",
                 capacity: float | None = None, hot: bool = True, homes: bool | None = None,
                 hot_seconds: float = HOT_SECONDS) -> dict[str, Any]:
    """The runs of (a) as data (`report_a` writes them; `--save`/`--merge` join split runs);
    `homes`: every node with `[cluster] balanced_homes` set so (None: the shipped default)."""
    kv_blocks, wl_kw = _workload(workload)
    mean_p = mean_prompt_tokens(Workload(seed=99, **wl_kw))
    bare = 3 * PREFILL_TPS / mean_p  # what the nodes' prefill serves with no cache at all, req/s
    ladder: list[dict[str, Any]] = []
    if capacity is None:
        capacity, ladder = await measure_capacity(tmp, seconds, workload, bare)
    print(f"mean prompt {mean_p:.0f} tokens; round robin's capacity {capacity:.1f} req/s", flush=True)
    runs = []
    for load in loads:
        tr = chat_trace(Workload(seed=5, **wl_kw), load * capacity / 5.5, max(seconds, 60.0), seed=5,
                        think_s=THINK_S)
        offline = routed_hit_rates(tr, kv_blocks, warm_s=max(seconds, 60.0) / 3)
        for placement in ("round_robin", "score", "single"):
            r = await one_run(tmp, placement, load * capacity, seconds, warmup_s=seconds / 3, workload=workload,
                              homes=homes)
            r["load"], r["offline"] = load, offline
            print(r, flush=True)
            runs.append(r)
    hot_runs = []
    for seed in HOT_SEEDS if hot else ():
        r = await one_run(tmp, "score", 0.7 * capacity, hot_seconds, hot=0.5, seed=seed, warmup_s=hot_seconds / 3,
                          workload=workload, homes=homes)
        r["seconds"], r["seed"] = hot_seconds, seed
        print("hot", r, flush=True)
        hot_runs.append(r)
    return {"workload": workload, "kv_blocks": kv_blocks, "mean_p": mean_p, "capacity": capacity,
            "seconds": seconds, "runs": runs, "hot": hot_runs, "ladder": ladder}


async def part_s(tmp: Path, seconds: float, loads: tuple[float, ...], capacity: float,
                 workload: str = "pressure", rounds: int = 1) -> dict[str, Any]:
    """(s) as data: at each load llmd's routing, then SGLang's router with each policy in front of
    nodes that route nothing, the same chats each time, `rounds` times over (bench/lib/cluster_sglang.py
    reports it, on the medians)."""
    for package in peer_sglang.PACKAGES:  # installed before the first run, not inside one
        await asyncio.to_thread(peer_sglang.ensure, package)
    runs = []
    for rnd, load in ((rnd, load) for rnd in range(1, rounds + 1) for load in loads):
        warm = cluster_sglang.warmup_s(seconds, load * capacity)
        for who in cluster_sglang.WHO:
            r = await one_run(tmp, "score", load * capacity, warm + seconds * 2 / 3, warmup_s=warm,
                              workload=workload, peer=None if who == "llmd" else who, cut=True)
            r.update(load=load, who=who, round=rnd)
            print("s", {k: r[k] for k in ("load", "who", "ok", "requests", "hit", "ttft_p50", "ttft_p90")},
                  flush=True)
            runs.append(r)
    return {"workload": workload, "capacity": capacity, "seconds": seconds, "runs": runs,
            "packages": list(peer_sglang.PACKAGES.values())}


def merge_a(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Split runs of one workload as one: their load levels together, the last hot-prefix runs."""
    if len({(p["workload"], round(p["capacity"], 3)) for p in parts}) != 1:
        raise SystemExit("--merge: the parts differ in workload or capacity (pass --capacity to every part)")
    out = dict(parts[0])
    out["runs"] = sorted((r for p in parts for r in p["runs"]), key=lambda r: r["load"])
    out["hot"] = next((p["hot"] for p in reversed(parts) if p["hot"]), None)
    out["ladder"] = next((p["ladder"] for p in parts if p.get("ladder")), [])
    out["commands"] = [c for p in parts for c in p["commands"]]
    out["minutes"] = sum(p["minutes"] for p in parts)
    return out


def report_a(data: dict[str, Any]) -> list[str]:
    runs, hot, loads = data["runs"], data["hot"], sorted({r["load"] for r in data["runs"]})
    rows = [[f"{r['load']:.0%}", r["placement"], f"{r['rate']:.1f}", f"{r['ok']}/{r['requests']}",
             f"{r['hit']:.2f}", f"{r['oracle']:.2f}", report.num(r["ttft_p50"], 3), report.num(r["ttft_p90"], 3),
             report.num(r["queue_max_over_mean"], 2), _growth(r)] for r in runs]
    by = {(r["load"], r["placement"]): r for r in runs}
    hits = [(by[(ld, "score")]["hit"], by[(ld, "round_robin")]["hit"], by[(ld, "score")]["oracle"],
             by[(ld, "single")]["hit"]) for ld in loads]
    hit_x = min(a / b if b else float("inf") for a, b, _, _ in hits)
    of_oracle = min(a / o if o else 0.0 for a, _, o, _ in hits)
    of_single = min(a / one if one else 0.0 for a, _, _, one in hits)
    at70 = min(loads, key=lambda x: abs(x - 0.7))
    t70 = by[(at70, "score")]["ttft_p90"], by[(at70, "round_robin")]["ttft_p90"]
    ttft_ok = t70[0] is not None and t70[1] is not None and t70[0] <= t70[1] / 3
    lines = [*describe_a(data), ""]
    scored = [by[(ld, "score")] for ld in loads]
    if any("homes_bound" in r for r in scored):
        lines += ["Balanced homes bound (`score`; the share of 0.25 s samples, over the nodes, with homes bound: "
                  "always unless `homes_bind = \"congested\"`; "
                  "docs/cluster.md \"Balanced homes\"): " + ", ".join(f"{r['load']:.0%} {r.get('homes_bound', 0):.0%}"
                                                                    for r in scored) + ".", ""]
    lines += report.table(["load", "placement", "req/s", "ok", "hit rate", "shared cache", "TTFT p50 s",
                           "TTFT p90 s", "queue max/mean", "TTFT p50 growth"], rows)
    off = [[f"{ld:.0%}", *(f"{by[(ld, 'score')]['offline'][k]:.2f}" for k in ("round_robin", "affinity", "single"))]
           for ld in loads]
    lines += ["", "The offline oracle (`bench/lib/prefix_oracle.py`: the same kind of chats, no nodes, LRUs of the "
              "same sizes with no KV pinned by running sequences; `affinity`: each system prompt owned by one "
              "node):", "", *report.table(["load", "round robin", "affinity", "single cache"], off), ""]
    verdicts = [
        (f"prefix hit rate >= 3x round robin's at every load (worst {hit_x:.1f}x)", hit_x >= 3),
        (f"prefix hit rate >= 90 % of a single shared cache's, measured: one node with the three's cache, "
         f"prefill and seats (worst {of_single:.0%})", of_single >= 0.9),
        (f"prefix hit rate >= 90 % of the shared-cache bound: the same prompts through one LRU, no KV pinned by "
         f"running sequences (worst {of_oracle:.0%})", of_oracle >= 0.9),
        (f"TTFT p90 at {at70:.0%} load <= 1/3 of round robin's ({report.num(t70[0], 3)} vs "
         f"{report.num(t70[1], 3)} s)", ttft_ok)]
    hots = [hot] if isinstance(hot, dict) else list(hot or [])  # a save from before the seeds: one run
    if hots:
        rows = [[str(h.get("seed", 1)), f"{h['ok']}/{h['requests']}", f"{h['hit']:.2f}",
                 ", ".join(f"{k} {v:.2f}" for k, v in sorted(h["queues"].items())),
                 report.num(h["queue_max_over_mean"], 2), f"{h.get('homes_bound', 0):.0%}",
                 ", ".join(f"{k} {n} ({hot_n})" for k, (n, hot_n) in sorted(h["per_node"].items()))
                 if "per_node" in h else "-"] for h in hots]
        ratios = [h["queue_max_over_mean"] or 0.0 for h in hots]
        lines += [f"Hot prefix (half the traffic on one system prompt) at 70 %, {hots[0].get('seconds', 40):.0f} s "
                  "of arrivals, one run per seed of chats; queues: each node's requests waiting, sampled every "
                  "0.25 s and averaged over the counted window (from the end of the first third to the last "
                  "chat's start):", "",
                  *report.table(["seed", "ok", "hit rate", "mean queue per node", "max/mean", "homes bound",
                                 "requests per node in the window (on the hot prompt)"], rows),
                  "", *_floor(by, at70), ""]
        failed = sum(int(h["failed"]) for h in hots)
        verdicts.append((f"a hot prefix with half the traffic: no failures ({failed}), max queue <= 1.5x mean in "
                         f"every run (worst {max(ratios):.2f}, mean {sum(ratios) / len(ratios):.2f})",
                         failed == 0 and max(ratios) <= 1.5))
    return lines + report.verdict_lines(verdicts)


def _floor(by: dict[tuple[float, str], dict[str, Any]], load: float) -> list[str]:
    """The same max/mean without a hot prompt, from the sweep's runs at the hot runs' load: what
    the ratio reads on queues this short when no prompt dominates (round robin: no affinity)."""
    got = [(p, by[(load, p)]) for p in ("score", "round_robin") if (load, p) in by]
    if not got:
        return []
    return ["Without a hot prompt (the sweep's runs above at " + f"{load:.0%}" + "): " + "; ".join(
        f"{p} max/mean {report.num(r['queue_max_over_mean'], 2)} on mean queues "
        + ", ".join(f"{v:.2f}" for _, v in sorted(r.get("queues", {}).items())) for p, r in got)
        + ". A ratio over queues of a tenth of a request reads which node a few bursts hit."]


def _growth(r: dict[str, Any]) -> str:
    """TTFT p50 in the second half of the run's window over the first half's (a growing queue)."""
    first, second = r.get("ttft_p50_halves") or (None, None)
    return f"{second / first:.2f}x" if first and second is not None else "-"


def describe_a(data: dict[str, Any]) -> list[str]:
    wl = WORKLOADS[data["workload"]]
    return [" ".join([
        f"Workload `{data['workload']}`: {wl['n_systems']} system prompts of {wl['system_words']} words,",
        f"Zipf s = {wl['zipf_s']}; chats of 4-7 turns. Fake engines: prefill {PREFILL_TPS:.0f} uncached",
        f"tokens/s per node, {data['kv_blocks']} blocks of 16 tokens of KV each; mean prompt",
        f"{data['mean_p']:.0f} tokens; round robin's capacity {data['capacity']:.2f} req/s, {capacity_note(data)};",
        f"{data['seconds']:.0f} s of arrivals per run, the first third warming the caches and not counted;",
        "`queue max/mean`: the busiest node's mean queue (requests waiting, sampled every 0.25 s in the",
        "counted window, up to the last chat's start) over the nodes' mean;",
        "`TTFT p50 growth`: its p50 in the second half of the counted window over the first half's (a queue",
        "that keeps growing reads well over 1). Every run of a load sends the same chats (drawn before it",
        "starts), each request entering at its drawn node. `single`: one node with the three nodes' KV",
        "cache, prefill rate and seats together (the single shared cache, measured); `shared cache`: the",
        "hit rate of the same prompts through one LRU of the three caches' size (a bound: it ignores the KV",
        "that running sequences pin, which past capacity evicts cached prefixes on every node). On 3 nodes",
        "with LRU caches the ratio to round robin has a ceiling near 3: round robin's node holds about C/W",
        "of a working set W, a prompt's owner min(1, 3C/W) of it; the offline oracle below shows how near",
        "this workload comes."])]


def capacity_note(data: dict[str, Any]) -> str:
    ladder = data.get("ladder") or []
    if not ladder:
        return "given (`--capacity`, from the ladder of an earlier run)"
    rungs = ", ".join(f"{r['rate']:.2f} req/s {_growth(r)}" for r in ladder)
    return (f"measured: the highest rate of a ladder of round robin runs whose TTFT p50 grew under {GROWTH}x "
            f"over the run ({rungs})")


QUOTA_KEY = "sk-bench-cluster-quota"


async def part_d(tmp: Path, seconds: float, quota: int = 6000) -> list[str]:
    """One tenant, tokens_per_minute = quota, sending as fast as it is let to all 3 nodes in turn."""
    from llmd.auth import hash_key

    tenants = f'[[tenants]]\nname = "t"\nkeys = ["{hash_key(QUOTA_KEY)}"]\ntokens_per_minute = {quota}\n'
    nodes = await asyncio.to_thread(start_nodes, tmp / "quota", 3, "score", 5.0, KV_BLOCKS, PREFILL_TPS, tenants)
    served: list[tuple[float, int]] = []
    refused = 0
    t0 = time.monotonic()
    turn = iter(range(10**9))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal refused
        while time.monotonic() - t0 < seconds:
            node = nodes[next(turn) % len(nodes)]
            s = Stream("t", time.monotonic())
            await stream(client, node.srv.url + "/v1/chat/completions", s,
                         {"model": "fake", "messages": [{"role": "user", "content": "tell me more " * 10}],
                          "max_tokens": 100}, headers={"Authorization": f"Bearer {QUOTA_KEY}"})
            if s.ok:
                served.append((time.monotonic() - t0, (s.prompt_tokens or 0) + (s.completion_tokens or 0)))
            else:
                refused += 1
                await asyncio.sleep(min(s.retry_after or 0.2, 1.0))

    try:
        client = new_client(timeout=120)
        await asyncio.gather(*(worker(client) for _ in range(6)))
        await client.aclose()
    finally:
        await asyncio.to_thread(stop_nodes, nodes)
    total = sum(n for _, n in served)
    allowance = quota + quota * seconds / 60  # a full bucket at the start, then its refill
    steady = sum(n for t, n in served if t >= 30) / ((seconds - 30) / 60)
    ratio = total / allowance
    lines = [f"Tenant quota {quota} tokens/min; 6 clients sending in turn to 3 nodes for {seconds:.0f} s; "
             f"{len(served)} served, {refused} refused (429).", "",
             f"Served {total} tokens against a single bucket's allowance of {allowance:.0f} (full at start plus "
             f"{seconds:.0f} s of refill): **{ratio:.2f}x**; after the first 30 s {steady:.0f} tokens/min "
             f"= {steady / quota:.2f}x the quota.", ""]
    lines += report.verdict_lines([(f"served <= 1.1x the tenant's quota across 3 nodes ({ratio:.2f}x)", ratio <= 1.1)])
    return lines


H_SECONDS = 120.0  # arrivals per (h) run, the first third not counted
H_TITLE = "(h) Chats on one hot system prompt entering the nodes in turn, beside the code before"


async def part_h(tmp: Path, seconds: float, capacity: float, baseline: Path | None, rounds: int,
                 save: Path | None = None, kinds: tuple[str, ...] = ("chats", "70 %"),
                 before_first: bool = False) -> dict[str, Any]:
    """(h) as data: chats of 2-5 turns all on one hot system prompt (split over several homes),
    every request entering the nodes in turn, at 70 % of round robin's capacity; then (a)'s
    workload at 70 %, each request at its drawn node. Each in `rounds` rounds of this code and,
    with `baseline` (a checkout of the code before), of that code, alternating in the same run.
    `save`: the runs so far are written there after each one (`--h-from` reports them)."""
    codes: list[tuple[str, Path | None]] = [("this", None)] + ([("before", baseline)] if baseline else [])
    if before_first:  # the order of each pair swapped: an order effect shows apart from the code's
        codes.reverse()
    runs: list[dict[str, Any]] = []
    out = {"capacity": capacity, "seconds": seconds, "runs": runs,
           "baseline": _commit_of(baseline) if baseline else None, "command": report.command()}
    for rnd in range(rounds):
        for kind, workload, in_turn in (k for k in (("chats", "chats", True), ("70 %", "pressure", False))
                                        if k[0] in kinds):
            for code, root in codes:
                r = await one_run(tmp, "score", 0.7 * capacity, seconds, seed=1 + (rnd if in_turn else 0),
                                  warmup_s=seconds / 3, workload=workload, root=root, in_turn=in_turn)
                r.update(code=code, kind=kind, round=rnd + 1)
                print("h", {k: r[k] for k in ("code", "kind", "round", "ok", "requests", "hit", "ttft_p90",
                                              "later", "later_on_history")}, flush=True)
                runs.append(r)
                if save is not None:
                    await asyncio.to_thread(save.write_text, json.dumps(out))
    return out


def _commit_of(root: Path) -> str:
    """The short commit a checkout is at."""
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       check=False)
    return r.stdout.strip() or str(root)


def merge_h(saves: list[dict[str, Any]]) -> dict[str, Any]:
    """(h)'s saves of one capacity and baseline as one: each later save's rounds numbered after
    the earlier saves' rounds of the same workload."""
    out = {**saves[0], "runs": [], "commands": [s["command"] for s in saves]}
    for save in saves:
        last: dict[str, int] = {}
        for r in out["runs"]:
            last[r["kind"]] = max(last.get(r["kind"], 0), r["round"])
        base = dict(last)
        out["runs"] += [{**r, "round": r["round"] + base.get(r["kind"], 0)} for r in save["runs"]]
    return out


def report_h(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    rows = [[r["kind"], r["code"], str(r["round"]), f"{r['ok']}/{r['requests']}",
             f"{r['later_on_history']}/{r['later']}" if r["kind"] == "chats" else "-",
             f"{r['hit']:.2f}", report.num(r["ttft_p50"], 3), report.num(r["ttft_p90"], 3)] for r in runs]

    def mean(kind: str, code: str, key: str) -> float | None:
        xs = [r[key] for r in runs if r["kind"] == kind and r["code"] == code and r[key] is not None]
        return sum(xs) / len(xs) if xs else None

    ours = [r for r in runs if r["kind"] == "chats" and r["code"] == "this"]
    worst = min((r["later_on_history"] / r["later"] if r["later"] else 0.0 for r in ours), default=0.0)
    lines = [" ".join([
        f"3 nodes, fake engines as in (a) (prefill {PREFILL_TPS:.0f} tokens/s, 400 blocks of 16 tokens each).",
        "`chats`: every chat (2-5 turns) on one system prompt of 1500 words, each request entering the next",
        f"node in turn (a round-robin balancer), at 70 % of round robin's capacity ({data['capacity']:.2f} req/s);",
        "`70 %`: (a)'s workload at 70 %, each request at its drawn node. `later on history`: turns after a",
        "chat's first that ran on the node its previous turn ran on (where its history is cached).",
        f"{data['seconds']:.0f} s of arrivals per run, the first third not counted; `before`: the code at",
        f"{data.get('baseline') or '-'} (a checkout passed as `--baseline`), run alternately in the same run."]), "",
        *report.table(["workload", "code", "round", "ok", "later on history", "hit rate", "TTFT p50 s",
                       "TTFT p90 s"], rows), ""]
    verdicts = [(f"later turns on their history's node >= 95 % in every `chats` run (worst {worst:.0%})",
                 bool(ours) and worst >= 0.95)]
    hit, hit0 = mean("70 %", "this", "hit"), mean("70 %", "before", "hit")
    p90, p900 = mean("70 %", "this", "ttft_p90"), mean("70 %", "before", "ttft_p90")
    if hit is not None and hit0 is not None and p90 is not None and p900 is not None:
        verdicts += [(f"hit rate at 70 % no worse than before, means of the rounds ({hit:.2f} vs {hit0:.2f}, "
                      "0.01 of spread allowed)", hit >= hit0 - 0.01),
                     (f"TTFT p90 at 70 % no worse than before, means of the rounds ({p90:.3f} vs {p900:.3f} s, "
                      "10 % of spread allowed)", p90 <= 1.1 * p900)]
    return lines + report.verdict_lines(verdicts)


A_TITLES = {"pressure": ("(a)", "(a) Routing by load and prefix, beside round robin: cache pressure"),
            "light": ("(a1)", "(a1) Routing by load and prefix, light cache pressure (the first workload), rerun")}


def a_section(data: dict[str, Any]) -> tuple[str, list[str]]:
    """Bench (a)'s subsection for one workload's (merged) runs, stamped with the commands run."""
    key, title = A_TITLES[data["workload"]]
    cmds = "; ".join(f"`{c}`" for c in data["commands"])
    head = (f"Date: {report.date()}; llmd at {report.code_version()}; command{'s' if len(data['commands']) > 1 else ''}"
            f": {cmds}; this part took {data['minutes']:.1f} min.")
    return key, [f"### {title}", "", head, "", *report_a(data)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,d")
    ap.add_argument("--seconds", type=float, default=SECONDS, help="arrivals per run (a)")
    ap.add_argument("--quota-seconds", type=float, default=90.0)
    ap.add_argument("--loads", default=",".join(map(str, LOADS)),
                    help="fractions of round robin's capacity (a); \"\" for the hot-prefix runs alone")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="pressure", help="(a): bench/lib/cluster.py")
    ap.add_argument("--capacity", type=float, help="(a): round robin's capacity in req/s (skips measuring it)")
    ap.add_argument("--no-hot", action="store_true", help="(a): skip the hot-prefix run")
    ap.add_argument("--hot-seconds", type=float, default=HOT_SECONDS, help="(a): the hot-prefix run's arrivals")
    ap.add_argument("--homes", choices=("on", "off"),
                    help="(a): nodes with [cluster] balanced_homes set so, not the shipped default (save, merge, "
                    "file by hand)")
    ap.add_argument("--save", type=Path, help="(a): write its runs to this JSON file, not to the docs")
    ap.add_argument("--merge", help="(a): comma-separated --save files of one workload: write them as one")
    ap.add_argument("--baseline", type=Path, help="(h): a checkout of the code before, run in the same run")
    ap.add_argument("--rounds", type=int, default=1, help="(h): rounds of runs")
    ap.add_argument("--h-seconds", type=float, default=H_SECONDS, help="(h): arrivals per run")
    ap.add_argument("--h-from", help="(h): write it from comma-separated --save files (their runs so far)")
    ap.add_argument("--h-before-first", action="store_true", help="(h): run the baseline first in each pair")
    ap.add_argument("--h-kinds", default="chats,70", help="(h): which workloads: chats, 70 (a)'s at 70 %%")
    ap.add_argument("--s-loads", default=",".join(map(str, cluster_sglang.LOADS)),
                    help="(s): fractions of round robin's capacity")
    ap.add_argument("--s-seconds", type=float, default=cluster_sglang.SECONDS, help="(s): arrivals per run")
    ap.add_argument("--s-rounds", type=int, default=1, help="(s): every load this many times; verdicts on medians")
    ap.add_argument("--s-from", help="(s): write it from comma-separated --save files of earlier calls (joined)")
    args = ap.parse_args()
    if args.h_from:  # (h) from saves, as far as each got (a run cut short keeps its finished runs)
        hd = merge_h([json.loads(Path(f).read_text()) for f in args.h_from.split(",")])
        lines = [f"### {H_TITLE}", "", report.stamp(cmd="; ".join(hd["commands"]),
                                                    took=f"{len(hd['runs'])} runs; written from their saves by "
                                                    f"`--h-from`"), "", *report_h(hd)]
        print("\n".join(lines))
        report.write_subsections(report.DOC, SECTION, [INTRO], {"(h)": lines})
        return
    if args.merge:
        data = merge_a([json.loads(Path(f).read_text()) for f in args.merge.split(",")])
        key, lines = a_section(data)
        print("\n".join(lines))
        report.write_subsections(report.DOC, SECTION, [INTRO], {key: lines})
        return
    parts = set(args.parts.split(","))
    t0 = time.monotonic()
    sections: dict[str, tuple[str, list[str], float]] = {}
    subs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="llmd-cluster-") as d:
        tmp = Path(d)
        if "a" in parts:
            t = time.monotonic()
            data = asyncio.run(part_a(tmp, args.seconds, tuple(float(x) for x in args.loads.split(",") if x),
                                      args.workload, args.capacity, not args.no_hot,
                                      None if args.homes is None else args.homes == "on",
                                      args.hot_seconds))
            data.update(commands=[report.command()], minutes=(time.monotonic() - t) / 60)
            if args.save:
                args.save.write_text(json.dumps(data))
                print(f"saved (a) to {args.save}")
            else:
                key, lines = a_section(data)
                subs[key] = lines
        if "h" in parts:
            if args.capacity is None:
                raise SystemExit("--parts h needs --capacity (round robin's, from (a))")
            t = time.monotonic()
            hd = asyncio.run(part_h(tmp, args.h_seconds, args.capacity, args.baseline, args.rounds, args.save,
                                    tuple(k.replace("70", "70 %") for k in args.h_kinds.split(",")),
                                    args.h_before_first))
            sections["(h)"] = (H_TITLE, report_h(hd), time.monotonic() - t)
        if "s" in parts:
            if args.capacity is None and not args.s_from:
                raise SystemExit("--parts s needs --capacity (round robin's, from (a))")
            t = time.monotonic()
            sd = (cluster_sglang.joined([json.loads(Path(f).read_text()) for f in args.s_from.split(",")])
                  if args.s_from else
                  asyncio.run(part_s(tmp, args.s_seconds, tuple(float(x) for x in args.s_loads.split(",")),
                                     args.capacity, args.workload, args.s_rounds)))
            if args.save:
                args.save.write_text(json.dumps(sd))
            sections["(s)"] = (cluster_sglang.TITLE, cluster_sglang.report_s(sd), time.monotonic() - t)
        if "c" in parts:
            t = time.monotonic()
            lines = asyncio.run(part_c(tmp, args.seconds))
            sections["(c2)"] = ("(c2) Gossip bandwidth of real nodes under load", lines, time.monotonic() - t)
        if "d" in parts:
            t = time.monotonic()
            lines = asyncio.run(part_d(tmp, args.quota_seconds))
            sections["(d)"] = ("(d) One tenant's quota across nodes", lines, time.monotonic() - t)
    cmd = report.command()
    subs.update({k: [f"### {title}", "", report.stamp(version=None, cmd=cmd, took=f"this part took {sec / 60:.1f} min"),
                     "", *lines] for k, (title, lines, sec) in sections.items()})
    for sub in subs.values():
        print("\n".join(sub))
    if subs:
        report.write_subsections(report.DOC, SECTION, [INTRO], subs)
        print(f"wrote {SECTION} in {report.DOC} ({(time.monotonic() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
