"""Gossip membership and bandwidth (issue J, targets (b) and (c)).

    .venv/bin/python bench/cluster_gossip.py                       # bandwidth + detection
    .venv/bin/python bench/cluster_gossip.py --parts soak --soak-s 600
    .venv/bin/python bench/cluster_gossip.py --no-write            # print only

(c) bandwidth: N in-process `Gossip` nodes (3, then 16) on loopback, each publishing a ~300-byte
state (load numbers that move, a few new prefix hashes) every 250 ms; bytes/s sent and received
per node over `--bw-s` seconds, UDP payload (IP/UDP headers excluded). Detection: `--agents`
agents (`python -m llmd.cluster.agent`) as processes; kill -9 of one, `--trials` times: time
until every other agent declares it dead (and it is restarted and rejoins); SIGSTOP: time until
the others suspect it, SIGCONT: time until all see it alive again. Soak: the agents while
`os.cpu_count()` busy-loop processes saturate the cores, `--soak-s` seconds: any `dead` is false.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lib import report, stats
from llmd.cluster.gossip import Gossip
from llmd.cluster.signing import Signer
from llmd.config.cluster import ClusterConfig

TITLE = "## Cluster gossip: membership and bandwidth"
SECRET = b"bench-cluster-secret-0123456789"
ROOT = Path(__file__).resolve().parents[1]


# -- (c) bandwidth -------------------------------------------------------------------------------
def load_state(name: str, n: int, rng: random.Random) -> bytes:
    """A realistic node state: one served version's load in tokens, rates, tenants' usage, and
    the prefix hashes added since the last one (random: they do not compress)."""
    s = {"node": name, "url": f"http://10.0.0.{len(name)}:8000", "seq": n, "rev": 3,
         "v": [{"m": "smollm2", "ver": "9f2c4e1ab37d5e60", "cap": 262144, "free": 262144 - rng.randint(0, 200000),
                "run": rng.randint(0, 48), "run_tok": rng.randint(0, 90000), "wait": rng.randint(0, 20000),
                "ptps": round(rng.uniform(2000, 9000), 1), "dtps": round(rng.uniform(300, 1500), 1)}],
         "pseq": n * 4, "pdelta": os.urandom(rng.choice((0, 8, 16, 32))).hex(),
         "tenants": {"acme": 1000 * n + rng.randint(0, 99), "globex": 700 * n, "initech": 12345}}
    return json.dumps(s, separators=(",", ":")).encode()


def bandwidth(n: int, seconds: float) -> dict[str, float]:
    cfg = ClusterConfig()
    nodes: list[Gossip] = []
    for i in range(n):
        seeds = [("127.0.0.1", nodes[0].bound_port)] if nodes else []
        nodes.append(Gossip(f"n{i}", ("127.0.0.1", 0), f"http://n{i}", seeds,
                            Signer(f"n{i}", [SECRET], time.time), cfg))
    rng = random.Random(n)
    for g in nodes:
        g.start()
    try:
        end = time.monotonic() + 60
        while any(sum(m.state == "alive" for m in g.members()) < n - 1 for g in nodes) and time.monotonic() < end:
            time.sleep(0.1)
        sizes: list[int] = []
        k, t_end = 0, None
        before = [g.stats for g in nodes]
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            k += 1
            for g in nodes:
                st = load_state(g.name, k, rng)
                sizes.append(len(st))
                g.publish(st)
            time.sleep(max(0.0, t0 + k * 0.25 - time.monotonic()))
        t_end = time.monotonic() - t0
        after = [g.stats for g in nodes]
        alive = min(sum(m.state == "alive" for m in g.members()) for g in nodes)
    finally:
        for g in nodes:
            g.stop(leave=False)
    sent = [(a.sent_bytes - b.sent_bytes) / t_end for a, b in zip(after, before, strict=True)]
    recv = [(a.recv_bytes - b.recv_bytes) / t_end for a, b in zip(after, before, strict=True)]
    msgs = [(a.sent_msgs - b.sent_msgs) / t_end for a, b in zip(after, before, strict=True)]
    return {"n": n, "state_bytes": stats.mean(sizes), "sent_mean": stats.mean(sent), "sent_max": max(sent),
            "recv_mean": stats.mean(recv), "recv_max": max(recv), "msgs": stats.mean(msgs), "alive_min": alive}


# -- agents as processes ---------------------------------------------------------------------------
class Agent:
    """One `python -m llmd.cluster.agent`; its member events are read on a thread."""

    def __init__(self, name: str, seeds: list[int]) -> None:
        env = {**os.environ, "LLMD_CLUSTER_SECRET": SECRET.decode(), "PYTHONPATH": str(ROOT)}
        args = [sys.executable, "-m", "llmd.cluster.agent", "--name", name, "--bind", "127.0.0.1:0", "--publish-bytes",
                "300",
                "--seeds", ",".join(f"127.0.0.1:{p}" for p in seeds)]
        self.name = name
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.view: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"agent {name} did not start")
        self.port: int = json.loads(line)["port"]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            e = json.loads(line)
            if e.get("event") == "member":
                self.events.append(e)
                self.view[e["name"]] = e["state"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def wait_until(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def first_event(agents: list[Agent], name: str, state: str, after: float) -> list[float]:
    """Each agent's first time (wall) it saw `name` in `state` after `after`."""
    out = []
    for a in agents:
        ts = [e["t"] for e in a.events if e["name"] == name and e["state"] == state and e["t"] >= after]
        if ts:
            out.append(min(ts))
    return out


def start_agents(k: int) -> list[Agent]:
    agents = [Agent("a0", [])]
    try:
        agents += [Agent(f"a{i}", [agents[0].port]) for i in range(1, k)]
        if not wait_until(lambda: all(sum(s == "alive" for s in a.view.values()) == k - 1 for a in agents), 60):
            raise RuntimeError("the agents did not converge")
    except BaseException:
        for a in agents:
            a.kill()
        raise
    return agents


def converged(agents: list[Agent], k: int) -> bool:
    return all(len(a.view) >= k - 1 and all(s == "alive" for s in a.view.values()) for a in agents)


def detection(k: int, trials: int) -> dict[str, Any]:
    agents = start_agents(k)
    kill_all, kill_first, stop_sus, stop_all_sus, cont_alive = [], [], [], [], []
    try:
        for t in range(trials):
            i = 1 + t % (k - 1)
            victim, others = agents[i], [a for a in agents if a is not agents[i]]
            t0 = time.time()
            victim.kill()
            wait_until(lambda v=victim, os_=others: all(o.view.get(v.name) == "dead" for o in os_), 30)
            seen = first_event(others, victim.name, "dead", t0)
            if len(seen) == len(others):
                kill_all.append(max(seen) - t0)
                kill_first.append(min(seen) - t0)
            agents[i] = Agent(victim.name, [agents[0].port])  # restart: it rejoins, refuting its death
            wait_until(lambda: converged(agents, k), 30)
        for t in range(trials):
            victim = agents[1 + t % (k - 1)]
            others = [a for a in agents if a is not victim]
            t0 = time.time()
            victim.proc.send_signal(signal.SIGSTOP)
            wait_until(lambda v=victim, os_=others: all(o.view.get(v.name) in ("suspect", "dead") for o in os_),
                       30)
            seen = first_event(others, victim.name, "suspect", t0)
            stop_sus.append(min(seen) - t0 if seen else float("nan"))
            stop_all_sus.append(max(seen) - t0 if len(seen) == len(others) else float("nan"))
            wait_until(lambda v=victim, os_=others: all(o.view.get(v.name) == "dead" for o in os_), 30)
            t1 = time.time()  # resumed after its death: it must refute and be readmitted
            victim.proc.send_signal(signal.SIGCONT)
            ok = wait_until(lambda: converged(agents, k), 30)
            cont_alive.append(time.time() - t1 if ok else float("nan"))
            time.sleep(1)
    finally:
        for a in agents:
            a.kill()
    return {"agents": k, "trials": len(kill_all), "kill_all": kill_all, "kill_first": kill_first,
            "stop_first": stop_sus, "stop_all": stop_all_sus, "cont_alive": cont_alive}


def soak(k: int, seconds: float) -> dict[str, Any]:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    agents: list[Agent] = []
    try:
        agents = start_agents(k)
        t0 = time.time()
        time.sleep(seconds)
        deaths = [e for a in agents for e in a.events if e["t"] >= t0 and e["state"] == "dead"]
        suspects = [e for a in agents for e in a.events if e["t"] >= t0 and e["state"] == "suspect"]
    finally:
        for a in agents:
            a.kill()
        for b in burners:
            b.kill()
            b.wait()
    return {"agents": k, "seconds": seconds, "burners": len(burners), "false_deaths": len(deaths),
            "suspicions": len(suspects)}


# -- the report ------------------------------------------------------------------------------------
def _bw_lines(rows: list[dict[str, float]]) -> list[str]:
    target = {3: 2048, 16: 8192}
    body = [[r["n"], f"{r['state_bytes']:.0f}", f"{r['sent_mean']:.0f}", f"{r['sent_max']:.0f}",
             f"{r['recv_mean']:.0f}", f"{r['recv_max']:.0f}", f"{r['msgs']:.1f}", int(r["alive_min"])] for r in rows]
    verdicts = [(f"{r['n']} nodes: the busiest node's max(sent, received) ≤ {target[int(r['n'])] // 1024} KB/s",
                 max(r["sent_max"], r["recv_max"]) <= target[int(r["n"])]) for r in rows if int(r["n"]) in target]
    return ["### (c) gossip bandwidth per node", "",
            *report.table(["nodes", "state B", "sent B/s mean", "sent B/s max", "recv B/s mean", "recv B/s max",
                           "datagrams/s sent", "alive peers (min)"], body),
            "", "Compared with the target: the larger of sent and received on the busiest node (UDP payload, "
            "signing included).", "", *report.verdict_lines(verdicts)]


def _p(xs: list[float], q: float) -> str:
    xs = [x for x in xs if x == x]
    return report.num(stats.pct(xs, q), 2) if xs else "n/a"


def _det_lines(d: dict[str, Any]) -> list[str]:
    names = [("kill_all", "kill -9 → every other agent says dead"), ("kill_first", "kill -9 → the first says dead"),
             ("stop_first", "SIGSTOP → the first says suspect"), ("stop_all", "SIGSTOP → every other says suspect"),
             ("cont_alive", "SIGCONT (once declared dead) → all see it alive again")]
    rows = [[label, len(d[k]), _p(d[k], 50), _p(d[k], 99)] for k, label in names]
    kill99 = stats.pct(d["kill_all"], 99) if d["kill_all"] else float("inf")
    stop = [x for x in d["stop_all"] if x == x]
    return [f"### (b1) failure detection, {d['agents']} agents as processes", "",
            *report.table(["event", "trials", "p50 s", "p99 s"], rows), "",
            *report.verdict_lines([("death declared ≤ 3 s (p99, every observer)", kill99 <= 3.0),
                                   ("SIGSTOP seen as suspect ≤ 1.5 s (every observer, worst trial)",
                                    bool(stop) and max(stop) <= 1.5)])]


def _soak_lines(s: dict[str, Any]) -> list[str]:
    return [f"### (b2) soak: {s['agents']} agents, {s['burners']} busy-loop processes, {s['seconds']:.0f} s", "",
            f"False deaths: {s['false_deaths']}; suspicions (refuted): {s['suspicions']}.", "",
            *report.verdict_lines([("no false deaths with every core saturated", s["false_deaths"] == 0)])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="bandwidth,detection", help="bandwidth, detection, soak (comma-separated)")
    ap.add_argument("--bw-s", type=float, default=20.0)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--soak-s", type=float, default=0.0, help="run the soak this long (adds it to --parts)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so `finally` kills the agents and burners
    parts = set(a.parts.split(",")) | ({"soak"} if a.soak_s else set())
    t0, subs = time.monotonic(), {}
    if "bandwidth" in parts:
        rows = [bandwidth(n, a.bw_s) for n in (3, 16)]
        print(json.dumps(rows, indent=1))
        subs["(c)"] = _bw_lines(rows)
    if "detection" in parts:
        d = detection(a.agents, a.trials)
        print(json.dumps(d, indent=1))
        subs["(b1)"] = _det_lines(d)
    if "soak" in parts:
        s = soak(a.agents, a.soak_s or 60.0)
        print(json.dumps(s, indent=1))
        subs["(b2)"] = _soak_lines(s)
    stamp = report.stamp(time.monotonic() - t0) + f" Python {sys.version.split()[0]}, {os.cpu_count()} CPUs."
    for key, lines in subs.items():
        subs[key] = [lines[0], "", stamp, *lines[1:]]
        print("\n".join(subs[key]) + "\n")
    if not a.no_write:
        intro = ["`bench/cluster_gossip.py` (its docstring says how each figure is taken). SWIM defaults: probe "
                 "0.5 s, timeout 0.25 s, 2 indirect probes, suspicion 1.5 s; state every 250 ms."]
        report.write_subsections(report.DOC, TITLE, intro, subs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
