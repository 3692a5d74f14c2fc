"""Gossip over real UDP on loopback: three nodes on port 0 join through one seed, a published
state reaches the others (full and delta frames), forged and replayed datagrams are dropped
and counted, and a graceful stop is seen as `left`."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from llmd.cluster.appstate import Inbox, Outbox
from llmd.cluster.gossip import Gossip, MemberInfo
from llmd.cluster.signing import Signer
from llmd.config.cluster import ClusterConfig

SECRET, OTHER = b"s" * 32, b"o" * 32
CFG = ClusterConfig(probe_interval_s=0.2, probe_timeout_s=0.1, suspicion_s=1.0, load_interval_s=0.05,
                    load_heartbeat_s=0.5)


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll until `cond` holds (a generous bound: the box's speed varies, this is no timing check)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def node(name: str, seeds: list[tuple[str, int]]) -> Gossip:
    return Gossip(name, ("127.0.0.1", 0), f"http://127.0.0.1/{name}", seeds, Signer(name, [SECRET], time.time), CFG)


def view(g: Gossip) -> dict[str, str]:
    return {m.name: m.state for m in g.members()}


@pytest.fixture
def trio() -> Iterator[list[Gossip]]:
    a = node("a", [])
    b, c = node("b", [("127.0.0.1", a.bound_port)]), node("c", [("127.0.0.1", a.bound_port)])
    for g in (a, b, c):
        g.start()
    wait_for(lambda: all(view(g) == {n: "alive" for n in "abc" if n != g.name} for g in (a, b, c)))
    yield [a, b, c]
    for g in (a, b, c):
        g.stop(leave=False)


def test_three_nodes_join_through_one_seed(trio: list[Gossip]) -> None:
    _, b, c = trio
    assert view(b) == {"a": "alive", "c": "alive"}  # c was never given b's address: it came through a
    m = next(m for m in b.members() if m.name == "c")
    assert m.gossip_addr == ("127.0.0.1", c.bound_port) and m.http_url == "http://127.0.0.1/c"
    assert all(g.stats.sent_msgs > 0 and g.stats.recv_bytes > 0 for g in trio)


def test_a_published_state_reaches_every_peer_and_changes_travel_as_deltas(trio: list[Gossip]) -> None:
    a, b, c = trio
    base = json.dumps({"node": "a", "kv_free": 123456, "running": 7, "waiting": 0, "pad": "x" * 200}).encode()
    a.publish(base)
    wait_for(lambda: all((g.state_of("a") or (b"",))[0] == base for g in (b, c)))
    sent = a.stats.sent_bytes
    for i in range(1, 6):  # between heartbeats: deltas against the keyframe
        newer = base.replace(b'"running": 7', f'"running": {7 + i}'.encode())
        a.publish(newer)
        wait_for(lambda s=newer: all((g.state_of("a") or (b"",))[0] == s for g in (b, c)))
    got = b.state_of("a")
    assert got is not None and abs(got[1] - time.time()) < 60
    assert b.state_of("nobody") is None
    assert a.stats.sent_bytes > sent
    with pytest.raises(ValueError, match="at most 1200 bytes"):
        a.publish(b"x" * 1201)


def test_forged_and_replayed_datagrams_are_dropped_and_counted(trio: list[Gossip]) -> None:
    a = trio[0]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    lie = json.dumps({"t": "g", "u": [{"n": "b", "s": "l", "i": 99}]}).encode()  # "b left"
    forged = Signer("b", [OTHER], time.time).seal(lie)
    sock.sendto(forged, ("127.0.0.1", a.bound_port))
    wait_for(lambda: a.stats.dropped["forged"] >= 1)
    assert view(a)["b"] != "left"  # the forged "b left" was not believed
    genuine = Signer("z", [SECRET], time.time).seal(json.dumps({"t": "g"}).encode())
    for _ in range(2):
        sock.sendto(genuine, ("127.0.0.1", a.bound_port))
    wait_for(lambda: a.stats.dropped["replayed"] >= 1)
    sock.sendto(b"not signed at all", ("127.0.0.1", a.bound_port))
    wait_for(lambda: a.stats.dropped["unsigned"] >= 1)
    sock.close()
    assert view(a)["b"] != "left"  # the forged "b left" was not believed


async def test_a_graceful_stop_is_seen_as_left_on_the_event_loop() -> None:
    loop = asyncio.get_running_loop()
    seen: list[tuple[MemberInfo, bool]] = []
    a = node("a", [])
    b = node("b", [("127.0.0.1", a.bound_port)])
    a.start(lambda m: seen.append((m, asyncio.get_running_loop() is loop)), loop)
    b.start()
    try:
        for _ in range(1500):
            if any(m.name == "b" and m.state == "alive" for m, _ in seen):
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(b.stop, True)
        for _ in range(1500):
            if view(a).get("b") == "left":
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
    finally:
        a.stop(leave=False)
    assert view(a)["b"] == "left"
    states = [m.state for m, _ in seen if m.name == "b"]
    assert states[0] == "alive" and states[-1] == "left" and "dead" not in states
    assert all(on_loop for _, on_loop in seen)


def test_state_frames_are_small_deltas_and_a_peer_without_the_keyframe_asks_for_it() -> None:
    out, late, early = Outbox(0.25, 1.0), Inbox(), Inbox()
    base = json.dumps({"free": 100000, "running": 3, "pad": "load " * 50}).encode()
    out.publish(base)
    frame = out.due(0.0)
    assert frame is not None and "k" not in frame[0]  # the first frame is the keyframe
    assert early.receive("a", *frame, 0.0) is True
    assert out.due(0.1) is None  # unchanged, before the heartbeat
    out.publish(base.replace(b'"running": 3', b'"running": 4'))
    assert out.due(0.1) is None  # changed, but within the interval
    delta = out.due(0.3)
    assert delta is not None and delta[0].get("k") and len(delta[1]) < len(base) // 4
    assert early.receive("a", *delta, 0.3) is True
    assert early.state_of("a") == (base.replace(b'"running": 3', b'"running": 4'), 0.3)
    assert early.receive("a", *delta, 0.4) is False  # a replayed or reordered frame is old
    assert late.receive("a", *delta, 0.3) is None and late.state_of("a") is None  # joined after the keyframe
    key = out.keyframe()
    assert key is not None and late.receive("a", *key, 0.35) is True
    assert late.receive("a", *delta, 0.36) is True
    assert late.state_of("a") == (base.replace(b'"running": 3', b'"running": 4'), 0.36)
    assert out.due(1.5) is not None  # the heartbeat, unchanged state and all


def test_a_node_that_joins_late_gets_the_state_without_waiting_for_a_new_keyframe(trio: list[Gossip]) -> None:
    a = trio[0]
    a.publish(b"state " * 40)
    wait_for(lambda: trio[1].state_of("a") is not None)
    a.publish(b"state " * 39 + b"moved ")  # a delta against the keyframe the late node never saw
    d = node("d", [("127.0.0.1", a.bound_port)])
    d.start()
    try:  # keyframes are renewed every 30 s: well within that, the late node asked for it
        wait_for(lambda: (d.state_of("a") or (b"",))[0] == b"state " * 39 + b"moved ", timeout=10)
    finally:
        d.stop(leave=False)
