"""Issue J item 6 on real nodes: registry changes made on any node reach every node, and the warm
pool promotes a standby version under load and puts it back after the calm. Three `llmd serve`
processes with fake engines on loopback, over one weight store holding three versions of a tiny
model (bench/lib/servers.py `tiny_versions`).

  (e1) propagation: splits and rollbacks alternating, each made on another node through the admin
       API; every node's view (GET /admin/models/<name>) polled until it shows the change's
       revision. A trickle of requests into every node meanwhile, each checked against the splits
       its node could have held while admitting it (X-LLMD-Model-Version).
  (e2) warm pool: n2 holds the model's version in the warm pool (asleep); load past
       `promote_queue_tokens` into every node; seconds from the crossing to promotion and to the
       first request n2 runs; from the load's end to demotion; TTFT before and after.

  .venv/bin/python bench/cluster_registry.py [--parts e1,e2] [--changes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report, stats
from bench.lib.cluster import INTRO, SECRET, SECTION, Node, start_nodes, stop_nodes, words
from bench.lib.cluster_registry import Change, check_versions, demoted, plan
from bench.lib.servers import tiny_versions
from bench.lib.streams import Stream, new_client, statuses, stream

MODEL = "fake"
PAYLOADS = (b"weights v1", b"weights v2", b"weights v3")
HEARTBEAT_S = 1.0  # [cluster] load_heartbeat_s (default): the documented bound is this plus one fetch
POLL_S = 0.05
N_WORDS = 700  # (e2) each prompt's length in words: about 730 tokens
AFTER_S = 10.0  # (e2) the load goes on this long after the pool node served its first request
TRICKLE = {"model": MODEL, "messages": [{"role": "user", "content": "which weights are you?"}], "max_tokens": 4}


def start(tmp: Path, home: Path, v1: str, cluster_extra: str = "", fake_extra: str = "",
          prefill_tps: float = 3000.0) -> list[Node]:
    return start_nodes(tmp, 3, "score", 5.0, 1024, prefill_tps, cluster_extra=cluster_extra,
                       model_extra=f'source = "tiny"\nversion = "{v1[:12]}"', fake_extra=fake_extra,
                       env={"LLMD_HOME": str(home)})


async def admin(h: httpx.AsyncClient, node: Node, method: str, path: str = "",
                body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = await h.request(method, f"{node.srv.url}/admin/models/{MODEL}{path}", json=body)
    r.raise_for_status()
    return dict(r.json())


# -- (e1) propagation ------------------------------------------------------------------------
async def signed_fetch(h: httpx.AsyncClient, node: Node) -> float:
    """One fetch as a peer makes it: the signed registry snapshot, timed."""
    from llmd.cluster.signing import Signer

    path = "/internal/v1/registry"
    headers = Signer("bench", [SECRET.encode()], time.time, purpose="http").headers("GET", path, to=node.name)
    t = time.monotonic()
    (await h.get(node.srv.url + path, headers=headers)).raise_for_status()
    return time.monotonic() - t


async def change(h: httpx.AsyncClient, nodes: list[Node], kind: str, at: int, split: dict[str, float] | None) -> Change:
    c = Change(kind, nodes[at].name, time.monotonic())
    d = await (admin(h, nodes[at], "PUT", "/split", {"weights": split}) if kind == "split"
               else admin(h, nodes[at], "POST", "/rollback"))
    c.rev, c.split, c.seen[c.node] = int(d["revision"]), dict(d["cluster_split"]), time.monotonic()

    async def watch(node: Node) -> None:
        while time.monotonic() - c.t0 < 15:
            v = await admin(h, node, "GET")
            if int(v["revision"]) >= c.rev:
                if v["cluster_split"] != c.split or int(v["revision"]) != c.rev:
                    raise RuntimeError(f"{node.name} shows {v['cluster_split']} at {v['revision']}, "
                                       f"not {c.split} at {c.rev}")
                c.seen[node.name] = time.monotonic()
                return
            await asyncio.sleep(POLL_S)

    await asyncio.gather(*(watch(n) for n in nodes if n.name != c.node))
    c.fetch_s = [await signed_fetch(h, n) for n in nodes]
    return c


async def trickle(nodes: list[Node], stop: asyncio.Event, out: list[tuple[str, Stream, float]]) -> None:
    """A steady stream of small requests into every node, one after another per node."""
    client = new_client(timeout=60)

    async def into(node: Node) -> None:
        while not stop.is_set():
            s = Stream(node.name, time.monotonic())
            await stream(client, node.srv.url + "/v1/chat/completions", s, TRICKLE)
            out.append((node.name, s, time.monotonic()))
            await asyncio.sleep(0.1)

    await asyncio.gather(*(into(n) for n in nodes))
    await client.aclose()


async def part_e1(tmp: Path, home: Path, versions: list[str], n_changes: int) -> list[str]:
    nodes = await asyncio.to_thread(start, tmp / "e1", home, versions[0])
    sent: list[tuple[str, Stream, float]] = []
    changes: list[Change] = []
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(timeout=30) as h:
            for node in nodes:
                for v in versions[1:]:
                    await admin(h, node, "POST", "/versions", {"version": v, "warm": False})
            initial = set((await admin(h, nodes[0], "GET"))["cluster_split"])
            load = asyncio.create_task(trickle(nodes, stop, sent))
            await asyncio.sleep(1.0)
            rng = random.Random(6)
            for kind, at, split in plan(versions, n_changes):
                changes.append(await change(h, nodes, kind, at, split))
                print(f"{kind} on {changes[-1].node}: every node in "
                      f"{max(changes[-1].seen.values()) - changes[-1].t0:.3f} s", flush=True)
                await asyncio.sleep(rng.uniform(0.3, 1.0))
            stop.set()
            await load
    finally:
        stop.set()
        await asyncio.to_thread(stop_nodes, nodes)
    checked, moving, wrong = check_versions(changes, initial, sent)
    return report_e1(changes, sent, checked, moving, wrong, versions)


def report_e1(changes: list[Change], sent: list[tuple[str, Stream, float]], checked: int, moving: int,
              wrong: list[str], versions: list[str]) -> list[str]:
    every = [max(c.seen.values()) - c.t0 for c in changes]
    others = [t - c.seen[c.node] for c in changes for n, t in c.seen.items() if n != c.node]
    fetch = [f for c in changes for f in c.fetch_s]
    bound = HEARTBEAT_S + stats.pct(fetch, 99)
    n_split = sum(c.kind == "split" for c in changes)
    rows = [["until every node shows it (from the admin call sent)", *(f"{stats.pct(every, q):.3f}" for q in (50, 99)),
             f"{max(every):.3f}"],
            ["a peer shows it (from the call's answer on the node that made it)",
             *(f"{stats.pct(others, q):.3f}" for q in (50, 99)), f"{max(others):.3f}"],
            ["one signed snapshot fetch (`/internal/v1/registry`)", *(f"{stats.pct(fetch, q):.3f}" for q in (50, 99)),
             f"{max(fetch):.3f}"]]
    failed = [s for _, s, _ in sent if not s.ok]
    lines = [f"{len(changes)} changes ({n_split} splits, {len(changes) - n_split} rollbacks) of model `{MODEL}` over "
             f"versions {', '.join(v[:8] for v in versions)}, each made on another node than the last (a split and "
             f"its rollback never on the same one), 0.3-1 s apart; every node's admin view polled every "
             f"{POLL_S * 1000:.0f} ms. Meanwhile a trickle of requests into every node (one after another per "
             f"node): {len(sent)} sent, {checked} ok ({statuses([s for _, s, _ in sent])}).", ""]
    lines += report.table(["seconds", "p50", "p99", "max"], rows)
    lines += ["", f"Each request's version (X-LLMD-Model-Version) checked against the splits its node could have held "
              f"while admitting it (from a change being made until that node showed the next one): {checked} "
              f"checked, {moving} of them admitted while a change was on its way to their node, "
              f"**{len(wrong)} on a version the split did not route to**.", ""]
    lines += [f"  - {w}" for w in wrong[:5]] + ([""] if wrong else [])
    lines += report.verdict_lines([
        (f"every change on every node within the documented bound, heartbeat {HEARTBEAT_S:.0f} s + one fetch "
         f"(p99 {stats.pct(fetch, 99):.3f} s) = {bound:.2f} s (max {max(every):.3f} s)", max(every) <= bound),
        (f"no request on a version the split does not route to ({len(wrong)} of {checked})", not wrong),
        (f"no request failed ({len(failed)})", not failed)])
    return lines


# -- (e2) the warm pool ------------------------------------------------------------------------
@dataclass
class PoolRun:
    samples: list[tuple[float, int, bool]] = field(default_factory=list)  # (t, queue tokens, n2 routes to it)
    sent: list[tuple[str, Stream]] = field(default_factory=list)
    t_stop: float = 0.0
    hot_since: float | None = None  # the pool's own view: when the hot stretch that promoted began
    calm_since: float | None = None  # and the calm one that demoted


async def watch_pool(h: httpx.AsyncClient, nodes: list[Node], stop: asyncio.Event, run: PoolRun) -> None:
    """Every 0.2 s, from the pool node n2: the cluster's waiting prefill tokens as its warm pool
    last saw them (its own and its live peers' gossiped figures), when its policy's current hot
    or calm stretch began (`since`, on the system-wide monotonic clock this process shares),
    and whether n2 routes to its pool version."""
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError, TypeError):
            wp = (await h.get(nodes[2].srv.url + "/admin/cluster")).json()["warm_pool"][MODEL]
            d = await admin(h, nodes[2], "GET")
            routed = any(v["weight"] > 0 for v in d["versions"])
            up_before = any(p for _, _, p in run.samples)
            if wp["since"] is not None and not wp["promoted"] and not up_before:
                run.hot_since = float(wp["since"])
            if wp["since"] is not None and wp["promoted"]:
                run.calm_since = float(wp["since"])
            run.samples.append((time.monotonic(), int(wp["queue_tokens"]), routed))
        await asyncio.sleep(0.2)


def ask(rng: random.Random, n_words: int, max_tokens: int = 16) -> dict[str, Any]:
    """A prompt no cache holds (random words): its prefill costs its whole length."""
    return {"model": MODEL, "messages": [{"role": "user", "content": words(rng, n_words)}], "max_tokens": max_tokens}


async def pool_load(nodes: list[Node], rate: float, n_words: int, run: PoolRun, max_s: float, after_s: float) -> None:
    """Poisson arrivals at `rate` into random nodes, until `after_s` after n2's first request
    (or `max_s`); then wait for every one to finish."""
    client, rng, tasks = new_client(timeout=300), random.Random(8), []
    t0 = time.monotonic()

    async def one(node: Node) -> None:
        s = Stream(node.name, time.monotonic())
        run.sent.append((node.name, s))
        await stream(client, node.srv.url + "/v1/chat/completions", s, ask(rng, n_words))

    while time.monotonic() - t0 < max_s:
        first = min((s.t_first for _, s in run.sent if s.node == nodes[2].name and s.t_first), default=None)
        if first is not None and time.monotonic() - first >= after_s:
            break
        tasks.append(asyncio.create_task(one(rng.choice(nodes))))
        await asyncio.sleep(rng.expovariate(rate))
    run.t_stop = time.monotonic()
    await asyncio.gather(*tasks)
    await client.aclose()


async def part_e2(tmp: Path, home: Path, versions: list[str], bound: int, sustain: float, demote: float,
                  prefill_tps: float = 1000.0) -> list[str]:
    warm = (f"[cluster.warm_pool]\npromote_queue_tokens = {bound}\nsustain_s = {sustain}\n"
            f"demote_after_s = {demote}\n")
    nodes = await asyncio.to_thread(start, tmp / "e2", home, versions[0], warm, "sleep_mode = true", prefill_tps)
    run, stop = PoolRun(), asyncio.Event()
    try:
        async with httpx.AsyncClient(timeout=30) as h:
            await admin(h, nodes[2], "POST", "/versions", {"version": versions[0], "warm_pool": True})
            async with new_client(60) as c:
                probe = await stream(c, nodes[0].srv.url + "/v1/chat/completions", Stream("p", 0.0),
                                     ask(random.Random(5), N_WORDS, 1))
            tokens = probe.prompt_tokens or 1000
            capacity = 2 * prefill_tps / tokens  # n0 and n1 only, req/s
            rate = 1.3 * capacity
            await asyncio.sleep(2.0)  # n2's version asleep, its standby gossiped
            watcher = asyncio.create_task(watch_pool(h, nodes, stop, run))
            await pool_load(nodes, rate, N_WORDS, run, max_s=60.0, after_s=AFTER_S)
            end = time.monotonic() + demote + 15
            while time.monotonic() < end and not demoted(run.samples):
                await asyncio.sleep(0.2)
            stop.set()
            await watcher
    finally:
        stop.set()
        await asyncio.to_thread(stop_nodes, nodes)
    return report_e2(run, nodes[2].name, bound, sustain, demote, tokens, rate, capacity, prefill_tps)


def ttft_table(run: PoolRun, pool_node: str, t_cross: float | None, t_up: float | None) -> list[str]:
    """TTFT of the requests sent before promotion, just after it, and after that until the load
    stopped; and how many of each ran on the pool node."""
    if t_cross is None or t_up is None:
        return ["(no promotion: no TTFT windows)"]
    rows = []
    for name, lo, hi in (("crossing -> promotion", t_cross, t_up), ("first 2 s after promotion", t_up, t_up + 2),
                         ("2 s after promotion -> load stopped", t_up + 2, run.t_stop)):
        xs = [x for _, x in run.sent if lo <= x.t_send < hi and x.ttft is not None]
        mine = [x.ttft for x in xs if x.node == pool_node and x.ttft is not None]
        rest = [x.ttft for x in xs if x.node != pool_node and x.ttft is not None]
        rows.append([name, len(xs), len(mine), *(report.num(stats.pct([x.ttft for x in xs if x.ttft], q), 2)
                                                 for q in (50, 90)),
                     report.num(stats.pct(mine, 50), 2), report.num(stats.pct(rest, 50), 2)])
    return report.table(["requests sent", "n", f"ran on {pool_node}", "TTFT p50 s", "TTFT p90 s",
                         f"p50 on {pool_node}", "p50 elsewhere"], rows)


def report_e2(run: PoolRun, pool_node: str, bound: int, sustain: float, demote: float, tokens: int, rate: float,
              capacity: float, prefill_tps: float) -> list[str]:
    s = run.samples
    t_up = next((t for t, _, p in s if p), None)
    t_down = next((t for t, _, p in s if t_up is not None and t > t_up and not p), None)
    t_cross = next((t for t, q, _ in s if q >= bound), None)  # first over the bound, as the bench sampled it
    t_hot, t_calm = run.hot_since, run.calm_since
    on_pool = [x for _, x in run.sent if x.node == pool_node and x.t_first]
    t_sent = min((x.t_send for x in on_pool), default=None)
    t_first = min((x.t_first for x in on_pool if x.t_first), default=None)
    early = [x for _, x in run.sent if x.node == pool_node and t_up is not None and x.t_send < t_up - 0.5]
    failed = [x for _, x in run.sent if not x.ok]

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    up, sent, first = span(t_cross, t_up), span(t_cross, t_sent), span(t_cross, t_first)
    hot, down, calm = span(t_hot, t_up), span(run.t_stop, t_down), span(t_calm, t_down)
    peak = max((q for _, q, _ in s), default=0)
    lines = [f"`[cluster.warm_pool]` promote_queue_tokens = {bound}, sustain_s = {sustain:g}, demote_after_s = "
             f"{demote:g}. Fake engines prefilling {prefill_tps:.0f} tokens/s each; {pool_node} holds the model's one "
             f"version in the warm pool (loaded, asleep: fake sleep mode), so n0 and n1 serve {capacity:.2f} req/s "
             f"of {tokens}-token prompts. Load: Poisson at {rate:.2f} req/s (1.3x that) into random nodes, stopped "
             f"{AFTER_S:g} s after {pool_node} served its first request; {len(run.sent)} requests "
             f"({statuses([x for _, x in run.sent])}). The cluster's queue as {pool_node}'s warm pool last saw it "
             f"(its own and its peers' gossiped waiting prefill tokens), sampled every 0.2 s; peak {peak}.",
             ""]
    lines += report.table(["from", "to", "seconds"], [
        ["the queue first over the bound (bench's samples)", f"{pool_node} routes to its pool version",
         report.num(up, 2)],
        ["the pool's hot stretch began (its own view)", f"{pool_node} routes to its pool version", report.num(hot, 2)],
        ["the queue first over the bound", f"the first request {pool_node} ran was sent", report.num(sent, 2)],
        ["the queue first over the bound", f"first token from {pool_node}", report.num(first, 2)],
        ["load stopped", f"{pool_node} demoted", report.num(down, 2)],
        ["the pool's calm stretch began (its own view)", f"{pool_node} demoted", report.num(calm, 2)]])
    lines += ["", *ttft_table(run, pool_node, t_cross, t_up), ""]
    lines += report.verdict_lines([
        (f"promoted after sustain_s of crossing, within one 0.5 s tick (+ a sample): {sustain:g} <= "
         f"{report.num(hot, 2)} <= {sustain + 0.7:g} s", hot is not None and sustain <= hot <= sustain + 0.7),
        (f"{pool_node} runs requests once promoted, none before ({len(early)} before)",
         first is not None and not early),
        (f"demoted slowly: after demote_after_s of calm, within one tick (+ a sample): {demote:g} <= "
         f"{report.num(calm, 2)} <= {demote + 0.7:g} s", calm is not None and demote <= calm <= demote + 0.7),
        (f"no request failed ({len(failed)})", not failed)])
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="e1,e2")
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--bound", type=int, default=4000, help="promote_queue_tokens (e2)")
    ap.add_argument("--sustain", type=float, default=2.0)
    ap.add_argument("--demote", type=float, default=20.0)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    parts, t0, out = set(args.parts.split(",")), time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="llmd-cluster-registry-") as d:
        tmp = Path(d)
        home = tmp / "home"
        _, versions = tiny_versions(home, PAYLOADS)
        if "e1" in parts:
            out += ["#### (e1) Splits and rollbacks reaching every node", "",
                    *asyncio.run(part_e1(tmp, home, versions, args.changes)), ""]
        if "e2" in parts:
            out += ["#### (e2) The warm pool promoted under load, demoted after the calm", "",
                    *asyncio.run(part_e2(tmp, home, versions, args.bound, args.sustain, args.demote)), ""]
    took = time.monotonic() - t0
    sub = ["### (e) Registry changes and the warm pool across nodes", "",
           report.stamp(version=None, cmd=report.command(), took=f"this part took {took / 60:.1f} min"), "", *out]
    print("\n".join(sub))
    if not args.no_write and parts == {"e1", "e2"}:
        report.write_subsections(report.DOC, SECTION, [INTRO], {"(e)": sub})
        print(f"wrote (e) of {SECTION} in {report.DOC}")


if __name__ == "__main__":
    main()
