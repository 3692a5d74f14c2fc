"""Clusters of llmd processes for bench/cluster.py: their configs, starting them together, and
the multi-turn chat workload that shares a few long system prompts with skewed popularity."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.servers import ServerProcess, free_port, spawn, stop, wait_ready
from llmd.auth import hash_key

SECRET = "bench-cluster-secret-0123456789abcdef"
SECTION = "## Cluster (J)"
INTRO = ("Issue J's cluster on llmd processes with fake engines on loopback (the engines' prefix cache and "
         "prefill cost are simulated; routing, forwarding, gossip, metering and failover are the real code). "
         "(a) and (d): `bench/cluster.py`; (a2): `bench/cluster_ceiling.py`; (a3): `bench/cluster_hot.py`; "
         "(a4): `bench/cluster.py --homes`; (a5): `bench/cluster_homes.py`; (a14), (a15): `bench/cluster_misses.py` "
         "(and (a15) `bench/cluster_hot.py`); (a20), (a21): `bench/cluster_hot.py --save`; "
         "(b): `bench/cluster_faults.py`; (c): `bench/cluster_gossip.py`; "
         "(e): `bench/cluster_registry.py`; (h): `bench/cluster.py --parts h`; (s): `bench/cluster.py --parts s`; "
         "the real engine: tests/engine/test_cluster_engine.py. Each subsection names the run that produced it.")
ADMIN_KEY = "sk-bench-cluster-admin"
NODE_TOML = """
{auth}
[server]
host = "127.0.0.1"
port = {{port}}
node = "{name}"
db_path = "{{db}}"
default_deadline_s = 120
max_deadline_s = 600
[cluster]
enabled = true
gossip_port = {gossip}
seeds = [{seeds}]
placement = "{placement}"
{cluster_extra}
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
default_max_tokens = 16
{model_extra}
[models.engine]
max_model_len = 16384
[models.fake]
step_ms = {step_ms}
step_ms_per_seq = 0.05
max_num_seqs = {seqs}
prefill_tokens_per_step = 100000
block_tokens = 16
kv_blocks = {kv_blocks}
prefill_tokens_per_s = {prefill_tps}
{fake_extra}
[models.scheduling]
max_running = {seqs}
max_queue = 100000
{tenants}
"""


@dataclass
class Node:
    name: str
    srv: ServerProcess
    gossip: int


def start_nodes(tmp: Path, n: int, placement: str = "score", step_ms: float = 5.0, kv_blocks: int = 1024,
                prefill_tps: float = 3000.0, tenants: str = "", cluster_extra: str = "",
                names: list[str] | None = None, seqs: int = 32, model_extra: str = "", fake_extra: str = "",
                env: dict[str, str] | None = None, root: Path | None = None) -> list[Node]:
    """`n` llmd processes (fake engines) that find each other through the first one's gossip port;
    returned once every one is ready and sees the others. `model_extra`/`fake_extra`: more lines
    for the model's table and its `[models.fake]` (a stored source and version, sleep mode);
    `env`: more environment (LLMD_HOME); `root`: another checkout whose llmd the nodes run (a
    baseline measured in the same run)."""
    if root is not None:
        env = {**(env or {}), "PYTHONPATH": str(root)}
    gossip = [free_port() for _ in range(n)]
    names = names or [f"n{i}" for i in range(n)]
    procs = []
    for i in range(n):
        d = tmp / names[i]
        d.mkdir(parents=True, exist_ok=True)
        seeds = ", ".join(f'"127.0.0.1:{p}"' for j, p in enumerate(gossip) if j != i)
        auth = f'[auth]\nadmin_keys = ["{hash_key(ADMIN_KEY)}"]' if tenants else ""
        toml = NODE_TOML.format(auth=auth, name=names[i], gossip=gossip[i], seeds=seeds, placement=placement,
                                step_ms=step_ms,
                                kv_blocks=kv_blocks, prefill_tps=prefill_tps, tenants=tenants, seqs=seqs,
                                cluster_extra=cluster_extra, model_extra=model_extra, fake_extra=fake_extra)
        port = free_port()
        cfg = d / "config.toml"
        cfg.write_text(toml.format(port=port, db=d / "llmd.db"))
        log = d / "server.log"
        proc = spawn([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)], log,
                     {"LLMD_CLUSTER_SECRET": SECRET, **(env or {})}, cwd=root)
        procs.append(Node(names[i], ServerProcess(f"http://127.0.0.1:{port}", proc, log), gossip[i]))
    try:
        for node in procs:
            wait_ready(node.srv.proc, node.srv.url + "/ready", 120, node.srv.log_path)
        _wait_joined(procs)
    except BaseException:
        stop_nodes(procs)
        raise
    return procs


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # where the nodes have tenants (else open mode on loopback)


def _wait_joined(nodes: list[Node], timeout: float = 30.0) -> None:
    import time

    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ok = 0
        for node in nodes:
            st = httpx.get(node.srv.url + "/admin/cluster", timeout=5, headers=ADMIN).json()
            ok += sum(1 for m in st["members"] if m["state"] == "alive" and m["versions"]) == len(nodes) - 1
        if ok == len(nodes):
            return
        time.sleep(0.3)
    raise RuntimeError("the nodes did not see each other in time")


def stop_nodes(nodes: list[Node]) -> None:
    for node in nodes:
        stop(node.srv.proc, grace=10)


# -- the workload -------------------------------------------------------------------
WORDS = ("river stone cloud lantern harbor meadow copper violet engine orbit signal garden thunder "  # noqa: SIM905
         "marble falcon quiet amber winter canyon pepper silver window crystal mirror compass").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Chat:
    system: int
    turns: int
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Session:
    """One chat as a run will send it: when it starts (seconds after the run's start), its turns'
    questions and the node each turn enters at (a load balancer's pick)."""

    at: float
    chat: Chat
    questions: list[str]
    ingress: list[int]


# Bench (a)'s workloads: each node's KV cache (blocks of 16 tokens) against the system prompts.
# "pressure": 10 prompts of ~1,530 tokens (96 blocks each, 960 in all) on 400 blocks a node: one
# node holds about 4 of them, the three together all 10 and the live chats' histories mostly;
# round robin thrashes every node's cache, a prefix router gives each prompt a home. "light":
# the first workload, 36 prompts of ~820 tokens (1,840 blocks) on 900 blocks a node: one node
# holds half of them, the skew keeps the popular ones in every cache, round robin already gets
# 0.6 at light load, and 3x that is out of any router's reach.
WORKLOADS: dict[str, dict[str, Any]] = {
    "pressure": {"n_systems": 10, "system_words": 1500, "zipf_s": 0.5, "kv_blocks": 400},
    "light": {"n_systems": 36, "system_words": 800, "zipf_s": 0.3, "kv_blocks": 900},
    # (h): every chat on one hot system prompt (split over several homes), 2-5 turns each
    "chats": {"n_systems": 1, "system_words": 1500, "zipf_s": 0.5, "kv_blocks": 400, "turns": (2, 5)},
}


class Workload:
    """`n_systems` long system prompts, Zipf-popular (or one taking `hot` of the traffic), and
    chats of a few turns on each; every turn's prompt is the system prompt plus the chat so far."""

    def __init__(self, seed: int = 7, n_systems: int = 36, system_words: int = 800, zipf_s: float = 0.3,
                 hot: float | None = None, user_words: int = 60, turns: tuple[int, int] = (4, 7)) -> None:
        self.rng = random.Random(seed)
        self.user_words, self.turns = user_words, turns
        self.systems = [f"System prompt {i}. " + words(self.rng, system_words) for i in range(n_systems)]
        if hot is not None:
            rest = (1 - hot) / (n_systems - 1)
            self.weights = [hot] + [rest] * (n_systems - 1)
        else:
            self.weights = [1 / (k + 1) ** zipf_s for k in range(n_systems)]

    def new_chat(self) -> Chat:
        i = self.rng.choices(range(len(self.systems)), weights=self.weights)[0]
        return Chat(i, self.rng.randint(*self.turns), [{"role": "system", "content": self.systems[i]}])

    def question(self) -> str:
        return words(self.rng, self.user_words) + "?"

    def next_turn(self, chat: Chat, question: str | None = None) -> dict[str, Any]:
        chat.messages.append({"role": "user", "content": question if question is not None else self.question()})
        return {"model": "fake", "messages": list(chat.messages), "max_tokens": 48, "temperature": 0}

    def sessions(self, per_s: float, seconds: float, nodes: int, seed: int) -> list[Session]:
        """The run's chat sessions, drawn before it starts: Poisson start times (from `seed`), each
        session's system prompt, questions and the ingress of every turn. Drawn while the run
        went, from generators the running sessions shared, each run of the same seed got other
        chats and another number of them (614 to 811 requests in five 120 s runs at one rate)."""
        rng, pick = random.Random(seed), random.Random(f"{seed}-ingress")
        out: list[Session] = []
        t = rng.expovariate(per_s)
        while t < seconds:
            chat = self.new_chat()
            # one draw a turn whatever the node count: `single`'s one node gets the same sessions
            out.append(Session(t, chat, [self.question() for _ in range(chat.turns)],
                               [int(pick.random() * nodes) for _ in range(chat.turns)]))
            t += rng.expovariate(per_s)
        return out

    @staticmethod
    def answered(chat: Chat, text: str) -> None:
        chat.messages.append({"role": "assistant", "content": text})
