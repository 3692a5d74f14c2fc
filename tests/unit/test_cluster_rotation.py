"""Rotating the cluster secret with `llmd reload`: the keyring's rules on an injected clock, the
window validated at start, and the drill on 3 real llmd processes: each node's secret file is
replaced and the node sent SIGHUP in turn, under load; no request is refused, no member lost,
and once the window has passed the old secret is refused (HTTP and gossip alike)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.lib.cluster import ADMIN, Node, start_nodes, stop_nodes
from llmd.cluster.keyring import Keyring, key_id
from llmd.cluster.signing import Signer
from llmd.config import ConfigError, load_config
from llmd.reload import ReloadError, pid_file, request_reload

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_rotated_keyring_signs_with_the_new_secret_only_once_every_peer_holds_it() -> None:
    clock = Clock()
    ring = Keyring([A], clock, window_s=60)
    ring.peer_holds("p1", [key_id(A)])
    ring.peer_holds("p2", [key_id(A)])
    notes = ring.rekey([B])
    assert any(key_id(B) in n for n in notes) and any(key_id(A) in n and "60 s" in n for n in notes)
    assert ring.held() == [key_id(B), key_id(A)] and ring.current == key_id(B)
    assert ring.signing().kid == key_id(A)  # nobody else holds B yet
    ring.peer_holds("p1", [key_id(B), key_id(A)])
    assert ring.signing().kid == key_id(A)  # p2 still does not
    ring.forget("p2")  # p2 died: it no longer holds the switch back
    assert ring.signing().kid == key_id(B)
    ring.peer_holds("p2", [key_id(B)])
    assert ring.signing().kid == key_id(B)
    assert ring.rekey([B]) == []  # the same file again: nothing to say
    clock.t += 60
    assert ring.held() == [key_id(B)]  # the window is over: A is refused from now on


def test_a_peer_that_never_rotates_is_cut_off_when_the_window_ends() -> None:
    clock = Clock()
    rotated = Signer("r", Keyring([A], clock, window_s=30), clock)
    stale = Signer("s", [A], clock)
    rotated.keyring.peer_holds("s", [key_id(A)])
    rotated.keyring.rekey([B])
    assert stale.open(rotated.seal(b"still A", to="s")) is not None  # it signs what the peer can check
    assert rotated.open(stale.seal(b"A within the window", to="r")) is not None
    clock.t += 31
    assert rotated.keyring.signing().kid == key_id(B)  # A is gone: B signs, whoever lacks it
    assert rotated.open(stale.seal(b"A after the window", to="r")) is None
    assert rotated.dropped["forged"] == 1
    assert stale.open(rotated.seal(b"B", to="s")) is None


def test_a_reload_keeps_a_configured_second_secret_and_windows_only_what_it_drops() -> None:
    clock = Clock()
    ring = Keyring([A, B], clock, window_s=10)
    assert ring.rekey([C, A]) and ring.held() == [key_id(C), key_id(A), key_id(B)]
    clock.t += 11
    assert ring.held() == [key_id(C), key_id(A)]  # A is still configured: never windowed
    with pytest.raises(ValueError, match="at least one secret"):
        ring.rekey([])


def test_the_rotation_window_is_validated_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_CLUSTER_SECRET", "x" * 16)
    p = tmp_path / "config.toml"
    model = '[[models]]\nname = "m"\nbackend = "fake"\n'
    for bad, why in (("0", "greater than 0"), ("4", "must be longer than replay_window_s")):
        p.write_text(f"[cluster]\nenabled = true\nrotation_window_s = {bad}\n{model}")
        with pytest.raises(ConfigError, match=rf"config.toml: invalid configuration\n  cluster.*{why}"):
            load_config(p)
    p.write_text(f"[cluster]\nenabled = true\n{model}")
    assert load_config(p).cluster.rotation_window_s == 900


# -- the drill on real processes ---------------------------------------------------------------
OLD, NEW = "old-cluster-secret-0123456789abcdef", "new-cluster-secret-0123456789abcdef"
WINDOW_S = 8.0


def secret_file(tmp: Path, name: str) -> Path:
    return tmp / name / "llmd.db.key"  # `{db}.key` in cluster_extra: one file per node


def status(node: Node) -> dict[str, Any]:
    return dict(httpx.get(node.srv.url + "/admin/cluster", headers=ADMIN, timeout=5).json())


async def load(nodes: list[Node], stop: asyncio.Event, outcomes: list[str]) -> None:
    """Requests entering the nodes in turn (round-robin placement: most run on a peer), streamed
    and not; every outcome is kept ("ok" or the error)."""
    clients = [openai.AsyncOpenAI(base_url=n.srv.base, api_key="x", max_retries=0, timeout=30) for n in nodes]

    async def one(i: int) -> None:
        c = clients[i % len(clients)]
        msgs: Any = [{"role": "user", "content": f"rotation drill {i}"}]
        try:
            if i % 2:
                chunks = [ch async for ch in await c.chat.completions.create(
                    model="fake", messages=msgs, max_tokens=6, stream=True)]
                assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 6
            else:
                r = await c.chat.completions.create(model="fake", messages=msgs, max_tokens=6)
                assert r.usage is not None and r.usage.completion_tokens == 6
            outcomes.append("ok")
        except Exception as e:  # every failure is the finding
            outcomes.append(f"{type(e).__name__}: {e}")

    async def worker(w: int) -> None:
        i = w
        while not stop.is_set():
            await one(i)
            i += 4

    await asyncio.gather(*(worker(w) for w in range(4)))
    for c in clients:
        await c.close()


def probe(node: Node, secret: str) -> int:
    """A signed internal call to `node` from a would-be member holding `secret`."""
    signer = Signer("probe", [secret.encode()], time.time, purpose="http")
    path = "/internal/v1/prefixes"
    return httpx.get(node.srv.url + path, headers=signer.headers("GET", path, to=node.name), timeout=5).status_code


def forged_datagrams(node: Node) -> int:
    return int(status(node)["gossip"]["dropped"].get("forged", 0))


def member_events(node: Node) -> list[dict[str, Any]]:
    return [json.loads(x) for x in node.srv.log_lines() if '"cluster_member"' in x]


@pytest.mark.timeout(180)
async def test_the_rotation_drill_on_three_nodes_under_load(tmp_path: Path) -> None:
    names = ["n0", "n1", "n2"]
    for n in names:
        secret_file(tmp_path, n).parent.mkdir(parents=True)
        secret_file(tmp_path, n).write_text(OLD)
    extra = f'secret_files = ["{{db}}.key"]\nreplay_window_s = 2\nrotation_window_s = {WINDOW_S}'
    nodes = await asyncio.to_thread(start_nodes, tmp_path, 3, "round_robin", 2.0, cluster_extra=extra, names=names)
    stop, outcomes = asyncio.Event(), list[str]()
    traffic = asyncio.create_task(load(nodes, stop, outcomes))
    try:
        await asyncio.sleep(1.0)
        for i, node in enumerate(nodes):
            secret_file(tmp_path, node.name).write_text(NEW)
            report = await asyncio.to_thread(request_reload, pid_file(node.srv.log_path.parent / "llmd.db"), 30)
            assert any("is current" in n for n in report.notes), report.notes
            assert any("still accepted" in n for n in report.notes), report.notes
            # Mid-rotation: the node accepts both secrets; one not yet reloaded refuses the new one.
            assert probe(node, OLD) == 200 and probe(node, NEW) == 200
            if i + 1 < len(nodes):
                assert probe(nodes[i + 1], NEW) == 401
            await asyncio.sleep(1.0)
        last_reload = time.monotonic()
        # Load runs on past the end of every node's window (the first reload's ended earlier).
        await asyncio.sleep(max(0.0, last_reload + WINDOW_S + 1.5 - time.monotonic()))
        stop.set()
        await traffic
        refused = [o for o in outcomes if o != "ok"]
        assert not refused and len(outcomes) > 40, (len(outcomes), refused[:5])
        for node in nodes:
            st = status(node)
            assert sorted(m["state"] for m in st["members"]) == ["alive", "alive"], st["members"]
            assert not [e for e in member_events(node) if e["state"] in ("dead", "left")], node.name
            assert forged_datagrams(node) == 0, st["gossip"]  # nobody was sent a key it lacked
            assert probe(node, OLD) == 401 and probe(node, NEW) == 200  # the window is over
        # A datagram sealed with the old secret is dropped as forged too.
        old = Signer("intruder", [OLD.encode()], time.time)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(old.seal(b'{"t":"g"}', to="n0"), ("127.0.0.1", nodes[0].gossip))
        end = time.monotonic() + 10
        while forged_datagrams(nodes[0]) == 0 and time.monotonic() < end:
            await asyncio.sleep(0.1)
        assert forged_datagrams(nodes[0]) == 1
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await traffic
        await asyncio.to_thread(stop_nodes, nodes)


def test_a_reload_names_the_cluster_changes_it_cannot_apply(tmp_path: Path) -> None:
    """One real node: a changed `placement` and `seeds` are named in the report (not a bare ok);
    the secret is re-read and the new key named."""
    secret_file(tmp_path, "n0").parent.mkdir(parents=True)
    secret_file(tmp_path, "n0").write_text(OLD)
    nodes = start_nodes(tmp_path, 1, "score", 2.0, cluster_extra='secret_files = ["{db}.key"]', names=["n0"])
    try:
        cfg = nodes[0].srv.log_path.parent / "config.toml"
        text = cfg.read_text()
        cfg.write_text(text.replace('placement = "score"', 'placement = "round_robin"'))
        secret_file(tmp_path, "n0").write_text(NEW)
        report = request_reload(pid_file(cfg.parent / "llmd.db"), 30)
        assert any("[cluster] placement" in n and "next start" in n for n in report.notes), report.notes
        assert any(Signer("x", [NEW.encode()], time.time).keyring.current in n for n in report.notes)
        assert status(nodes[0])["routing"] == "cluster"
        secret_file(tmp_path, "n0").write_text("short")  # fails validation: refused whole
        with pytest.raises(ReloadError, match="secret_files"):
            request_reload(pid_file(cfg.parent / "llmd.db"), 30)
        assert probe(nodes[0], NEW) == 200
    finally:
        stop_nodes(nodes)
