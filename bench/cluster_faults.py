"""Issue J (b): a node dies, or stops, with streams running on it; nothing is lost or billed twice.

Each trial: 3 llmd processes (fake engines); n0 and n1 drain, so every stream their clients
start runs on n2; once all have tokens, n0 and n1 take work again and n2 is killed (kill -9)
or stopped (SIGSTOP). Every stream must finish through its ingress with all its tokens and
the same text as an undisturbed run; each request must have one ledger row, on its ingress,
and none on n2. From the nodes' logs: when n2 was declared dead (or suspect), when each
stream failed over. `--soak-s`: 3 nodes under steady load while busy loops saturate both
cores; any death or suspicion of a live node is a false one.

  .venv/bin/python bench/cluster_faults.py [--trials 5] [--streams 36] [--soak-s 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report, stats
from bench.lib.cluster import INTRO, SECTION, Node, start_nodes, stop_nodes
from bench.lib.streams import Stream, new_client, stream

MAX_TOKENS = 600
STEP_MS = 15.0
SEATS = 32  # bench/lib/cluster.py's max_running: streams beyond it wait their turn on n2


def body(i: int) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": f"Story number {i}, please."}],
            "max_tokens": MAX_TOKENS, "temperature": 0}


def events(node: Node, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in node.srv.log_lines() if f'"event": "{name}"' in line]


def ledger(node: Node) -> list[tuple[str, str, int]]:
    db = node.srv.log_path.parent / "llmd.db"
    with sqlite3.connect(db) as c:
        return c.execute("SELECT request_id, status, output_tokens FROM usage").fetchall()


async def drain(nodes: list[Node], on: bool) -> None:
    async with httpx.AsyncClient(timeout=5) as h:
        for n in nodes:
            (await h.post(n.srv.url + "/admin/cluster/drain", json={"draining": on})).raise_for_status()


async def trial(tmp: Path, n_streams: int, how: str) -> dict[str, Any]:
    nodes = await asyncio.to_thread(start_nodes, tmp, 3, "score", STEP_MS)
    victim = nodes[2]
    try:
        await drain(nodes[:2], True)
        await asyncio.sleep(1.0)  # every node has heard it
        client = new_client(timeout=120)
        results = [Stream("a", time.monotonic(), texts=[]) for _ in range(n_streams)]
        tasks = [asyncio.create_task(stream(client, nodes[i % 2].srv.url + "/v1/chat/completions", s, body(i)))
                 for i, s in enumerate(results)]
        while sum(1 for s in results if s.chunks) < min(n_streams, SEATS):
            await asyncio.sleep(0.05)
        await drain(nodes[:2], False)  # the survivors take work again: the failovers' destination
        await asyncio.sleep(0.5)
        in_flight = sum(1 for s in results if not s.done)
        t_fault = time.time()
        os.kill(victim.srv.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        await asyncio.gather(*tasks)
        if how == "stop":
            os.kill(victim.srv.proc.pid, signal.SIGCONT)
            await asyncio.sleep(3.0)  # it comes back alive
        await asyncio.sleep(0.5)  # the last rows are committed
        rows = [r for n in nodes[:2] for r in ledger(n)]  # before the reference run adds its own
        reference = [Stream("a", time.monotonic(), texts=[]) for _ in range(n_streams)]
        await asyncio.gather(*(stream(client, nodes[0].srv.url + "/v1/chat/completions", s, body(i))
                               for i, s in enumerate(reference)))
        await client.aclose()
        return measure(nodes, victim, results, reference, t_fault, in_flight, how, rows)
    finally:
        with_signal = victim.srv.proc.poll() is None
        if with_signal and how == "stop":
            os.kill(victim.srv.proc.pid, signal.SIGCONT)
        await asyncio.to_thread(stop_nodes, nodes)


def measure(nodes: list[Node], victim: Node, results: list[Stream], reference: list[Stream], t_fault: float,
            in_flight: int, how: str, rows: list[tuple[str, str, int]]) -> dict[str, Any]:
    ok = [s for s in results if s.ok and s.completion_tokens == MAX_TOKENS]
    same = sum(1 for s, r in zip(results, reference, strict=True) if "".join(s.texts or []) == "".join(r.texts or []))
    state = "dead" if how == "kill" else "suspect"
    declared = [e["t"] - t_fault for n in nodes[:2] for e in events(n, "cluster_member")
                if e["peer"] == victim.name and e["state"] == state and e["t"] >= t_fault]
    first_declared = min(declared) if declared else None
    failovers = [e["t"] - t_fault for n in nodes[:2] for e in events(n, "cluster_failover") if e["t"] >= t_fault]
    ids = [r[0] for r in rows]
    victim_rows = len(ledger(victim))
    came_back = [e for n in nodes[:2] for e in events(n, "cluster_member")
                 if e["peer"] == victim.name and e["state"] == "alive" and e["t"] > t_fault]
    return {"how": how, "streams": len(results), "in_flight": in_flight, "complete": len(ok), "same_text": same,
            "declared_s": declared, "first_declared_s": first_declared, "failovers_s": failovers,
            "failover_after_declared_s": (max(failovers) - first_declared) if failovers and first_declared else None,
            "rows": len(rows), "distinct_rows": len(set(ids)), "rows_ok": sum(1 for r in rows if r[1] == "ok"),
            "victim_rows": victim_rows, "back_alive": bool(came_back)}


async def soak(tmp: Path, seconds: float) -> dict[str, Any]:
    """3 nodes serving steady chats while busy loops hold both cores: count false deaths."""
    nodes = await asyncio.to_thread(start_nodes, tmp / "soak", 3, "score", 5.0)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    client = new_client(timeout=120)
    done = 0
    try:
        end = time.monotonic() + seconds

        async def worker(i: int) -> None:
            nonlocal done
            while time.monotonic() < end:
                s = Stream("a", time.monotonic())
                await stream(client, nodes[i % 3].srv.url + "/v1/chat/completions", s,
                             {"model": "fake", "messages": [{"role": "user", "content": f"soak {i}"}],
                              "max_tokens": 64})
                done += s.ok
        await asyncio.gather(*(worker(i) for i in range(6)))
    finally:
        for b in burners:
            b.kill()
        await client.aclose()
        changes = [e for n in nodes for e in events(n, "cluster_member") if e["state"] in ("suspect", "dead")]
        await asyncio.to_thread(stop_nodes, nodes)
    return {"seconds": seconds, "requests_ok": done, "false_suspect": sum(e["state"] == "suspect" for e in changes),
            "false_dead": sum(e["state"] == "dead" for e in changes)}


def report_lines(trials: list[dict[str, Any]], soaked: dict[str, Any] | None) -> list[str]:
    rows = [[t["how"], t["streams"], t["in_flight"], t["complete"], t["same_text"], f"{t['rows']}/{t['distinct_rows']}",
             t["victim_rows"], report.num(t["first_declared_s"], 2), report.num(t["failover_after_declared_s"], 2),
             report.num(max(t["failovers_s"]) if t["failovers_s"] else None, 2)] for t in trials]
    lines = report.table(["fault", "streams", "in flight at fault", "complete", "same text as undisturbed",
                          "ledger rows / distinct", "rows on the dead node", "declared s", "last failover after "
                          "declared s", "last failover after fault s"], rows)
    kills = [t for t in trials if t["how"] == "kill"]
    stops = [t for t in trials if t["how"] == "stop"]
    declared = [d for t in kills for d in t["declared_s"]]
    suspect = [d for t in stops for d in t["declared_s"]]
    lost = sum(t["streams"] - t["complete"] for t in trials)
    twice = sum(t["rows"] - t["distinct_rows"] + t["victim_rows"] for t in trials)
    after = [t["failover_after_declared_s"] for t in kills if t["failover_after_declared_s"] is not None]
    p99 = stats.pct(declared, 99) if declared else None
    sus = max(suspect) if suspect else None
    verdicts = [
        (f">= 30 streams in flight on the node at the fault (min {min(t['in_flight'] for t in trials)})",
         min(t["in_flight"] for t in trials) >= 30),
        (f"0 lost ({lost} lost; every stream complete, text as undisturbed: "
         f"{sum(t['same_text'] for t in trials)}/{sum(t['streams'] for t in trials)})", lost == 0),
        (f"0 metered twice ({twice}; one ledger row per request, on its ingress)", twice == 0),
        (f"death declared <= 3 s p99 after kill -9 (p99 {report.num(p99, 2)} s over {len(declared)} observations)",
         p99 is not None and p99 <= 3),
        (f"failover starts <= 1 s after death is declared (worst {report.num(max(after) if after else None, 2)} s; "
         "kill -9 breaks the connections, so streams fail over before)", bool(after) and max(after) <= 1),
    ]
    if stops:
        verdicts.append((f"SIGSTOP seen as suspect <= 1.5 s (worst {report.num(sus, 2)} s); it came back alive: "
                         f"{all(t['back_alive'] for t in stops)}", sus is not None and sus <= 1.5))
    lines += ["", *report.verdict_lines(verdicts)]
    if soaked is not None:
        lines += ["", f"Soak: {soaked['seconds']:.0f} s, 3 nodes serving 6 clients ({soaked['requests_ok']} requests) "
                  f"while 2 busy loops saturate both cores: {soaked['false_dead']} false deaths, "
                  f"{soaked['false_suspect']} suspicions of a live node.", "",
                  *report.verdict_lines([(f"no false deaths over {soaked['seconds'] / 60:.0f} min with both cores "
                                          "saturated", soaked["false_dead"] == 0)])]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="kill -9 trials (and one SIGSTOP trial)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--soak-s", type=float, default=0.0)
    args = ap.parse_args()
    t0 = time.monotonic()
    trials: list[dict[str, Any]] = []
    soaked = None
    with tempfile.TemporaryDirectory(prefix="llmd-faults-") as d:
        for i in range(args.trials):
            trials.append(asyncio.run(trial(Path(d) / f"kill{i}", args.streams, "kill")))
            print(trials[-1], flush=True)
        trials.append(asyncio.run(trial(Path(d) / "stop", args.streams, "stop")))
        print(trials[-1], flush=True)
        if args.soak_s:
            soaked = asyncio.run(soak(Path(d), args.soak_s))
            print(soaked, flush=True)
    lines = report_lines(trials, soaked)
    sub = ["### (b) A node killed or stopped with streams running on it", "",
           report.stamp(time.monotonic() - t0), "", *lines]
    print("\n".join(sub))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(b)": sub})


if __name__ == "__main__":
    main()
