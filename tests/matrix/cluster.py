"""The servers the matrix runs on: a standalone node and a clustered ingress, both in this
process (the fake backend, so a case can reach their ledgers and engines), and the ingress's
peer as a real `llmd serve` process, so "node death" is a kill -9 of a process.

The ingress drains: every request it admits is forwarded to the peer, metered at the ingress.
After the peer is killed, the next forwarded case gets a new peer (a new name: the dead one
stays dead in the ingress's view)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sqlite3
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.servers import LiveServer, ServerProcess, start_inprocess, start_server_process, stop
from llmd.auth import hash_key
from llmd.config import Config

KEY = "sk-llmd-matrix-tenant-a"
SECRET = "matrix-cluster-secret-0123456789abcdef"
STEP_MS = 2.0
MODEL = f"""
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
default_max_tokens = 16
[models.engine]
max_model_len = 8192
restart_attempts = 1000
restart_backoff_s = 0.02
[models.fake]
step_ms = {STEP_MS}
step_ms_per_seq = 0.0
max_num_seqs = 16
[models.scheduling]
max_running = 16
[models.filters]
output = ["pii", "words"]
holdback_tokens = 8
[[filters]]
name = "pii"
type = "pii"
action = "redact"
[[filters]]
name = "words"
type = "blocklist"
words = ["forbidden phrase"]
[[tenants]]
name = "a"
keys = ["{hash_key(KEY)}"]
"""
SERVER = """
[server]
node = "{name}"
default_deadline_s = 60
max_deadline_s = 600
{extra}
"""
CLUSTER = """
[cluster]
enabled = true
gossip_port = {gossip}
seeds = [{seeds}]
secret_files = ["{secret}"]
"""
_names = itertools.count()


def free_port() -> int:
    from tests.conftest import free_port as fp
    return fp()


async def inprocess(toml: str, db: Path) -> LiveServer:
    cfg = Config.model_validate(tomllib.loads(textwrap.dedent(toml)))
    cfg.server.db_path = db
    return await start_inprocess(cfg, f"llmd_matrix_{next(_names)}")


def ledger_rows(db: Path) -> list[dict[str, Any]]:
    """The usage rows of a node's SQLite ledger (read from the file: the peer is another process)."""
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute("SELECT * FROM usage")]


@dataclass
class Peer:
    name: str
    srv: ServerProcess
    db: Path

    def kill(self) -> None:
        """kill -9: the node dies with whatever it runs."""
        os.kill(self.srv.proc.pid, signal.SIGKILL)


@dataclass
class Servers:
    """The standalone node, the draining ingress and its current peer."""

    tmp: Path
    solo: LiveServer
    ingress: LiveServer
    gossip: int
    secret: Path
    peer: Peer | None = None
    dead: list[Peer] = field(default_factory=list)

    async def live_peer(self) -> Peer:
        """A peer the ingress forwards to: the current one, or a new process if it was killed."""
        if self.peer is not None and self.peer.srv.proc.poll() is None:
            return self.peer
        if self.peer is not None:
            self.dead.append(self.peer)
        self.peer = await asyncio.to_thread(self._start_peer, f"p{len(self.dead)}")
        await _wait(lambda: self._sees(self.peer.name if self.peer else ""), 30, "the ingress to see its peer")
        return self.peer

    def _start_peer(self, name: str) -> Peer:
        d = self.tmp / name
        d.mkdir()
        toml = (SERVER.format(name=name, extra='host = "127.0.0.1"\nport = {port}\ndb_path = "{db}"')
                + CLUSTER.format(gossip=free_port(), seeds=f'"127.0.0.1:{self.gossip}"', secret=self.secret)
                + MODEL)
        srv = start_server_process(toml, d, ready_timeout=60)
        return Peer(name, srv, d / "llmd.db")

    def _sees(self, name: str) -> bool:
        p = self.ingress.node.cluster.peers.get(name)
        return p is not None and p.info.state == "alive" and p.state is not None and bool(p.state.versions)

    def peer_rows(self) -> int:
        return sum(len(ledger_rows(p.db)) for p in [*self.dead, *([self.peer] if self.peer else [])])

    async def close(self) -> None:
        for p in [*self.dead, *([self.peer] if self.peer else [])]:
            await asyncio.to_thread(stop, p.srv.proc, 5.0)
        await self.ingress.stop()
        await self.solo.stop()


async def _wait(pred: Any, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.05)


async def start(tmp: Path) -> Servers:
    secret = tmp / "cluster-secret"
    secret.write_text(SECRET)
    solo = await inprocess(SERVER.format(name="solo", extra="") + MODEL, tmp / "solo.db")
    gossip = free_port()
    ingress = await inprocess(SERVER.format(name="ingress", extra="")
                              + CLUSTER.format(gossip=gossip, seeds="", secret=secret) + MODEL, tmp / "ingress.db")
    ingress.node.cluster.draining = True  # everything it admits runs on the peer
    return Servers(tmp, solo, ingress, gossip, secret)
