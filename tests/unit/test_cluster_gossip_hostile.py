"""Gossip against a member that holds the secret but sends garbage: real gossip threads on
loopback UDP, a raw socket sealing datagrams with the cluster secret. One malformed datagram
cannot stop a node's gossip thread, and a small state frame that would inflate past the limit
is refused before its output is produced."""

from __future__ import annotations

import json
import socket
import time
import tracemalloc
import zlib
from collections.abc import Iterator

import pytest

from llmd.cluster.appstate import MAX_STATE_BYTES, Inbox
from llmd.cluster.gossip import Gossip
from llmd.cluster.signing import Signer
from tests.unit.test_cluster_gossip import SECRET, node, view, wait_for

BOMB = b"\0" * 10_000_000  # ~10 KB deflated: one datagram


def bomb_against(key: bytes) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, -15, zdict=key)
    return z.compress(BOMB) + z.flush()


@pytest.fixture
def pair() -> Iterator[tuple[Gossip, Gossip]]:
    a = node("a", [])
    b = node("b", [("127.0.0.1", a.bound_port)])
    for g in (a, b):
        g.start()
    wait_for(lambda: view(a) == {"b": "alive"} and view(b) == {"a": "alive"})
    yield a, b
    for g in (a, b):
        g.stop(leave=False)


def send(to: Gossip, head: dict[str, object], blob: bytes = b"", sender: str = "mallory") -> None:
    payload = json.dumps(head).encode()
    data = Signer(sender, [SECRET], time.time).seal(payload + b"\n" + blob if blob else payload, to=to.name)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(data, ("127.0.0.1", to.bound_port))


def test_malformed_datagrams_from_a_member_do_not_stop_the_gossip_thread(pair: tuple[Gossip, Gossip]) -> None:
    a, b = pair
    hostile: list[dict[str, object]] = [
        {"t": "g", "u": 5},  # updates that are not a list
        {"t": "nack", "q": [1]},  # an unhashable probe number
        {"t": "sync", "ms": 7},
        {"t": "g", "u": [{"n": "a", "s": "a", "i": 10**6, "a": "x"}]},  # a known member's address garbled
        {"t": "ping", "to": "b", "q": 1, "kh": "not-a-list"},
    ]
    for head in hostile:
        send(b, head)
    wait_for(lambda: b.stats.dropped["malformed"] >= 4)
    assert b._thread is not None and b._thread.is_alive()
    a.publish(b"after the garbage")  # b still hears a's state, and keeps a alive
    wait_for(lambda: (got := b.state_of("a")) is not None and got[0] == b"after the garbage")
    time.sleep(1.0)  # a few probe rounds: a stays alive in b's view
    assert view(b)["a"] == "alive" and b._thread.is_alive()


def test_a_state_frame_that_inflates_past_the_limit_is_refused(pair: tuple[Gossip, Gossip]) -> None:
    _, b = pair
    key = b"k" * 200
    send(b, {"t": "st", "e": 1, "v": 1}, key)  # a keyframe b keeps
    wait_for(lambda: b.state_of("mallory") is not None)
    blob = bomb_against(key)
    assert len(blob) < 60_000  # it fits one datagram
    send(b, {"t": "st", "e": 1, "v": 2, "k": 1}, blob)
    send(b, {"t": "st", "e": 1, "v": 3}, b"small and fine")  # what comes next is still heard
    wait_for(lambda: (got := b.state_of("mallory")) is not None and got[0] == b"small and fine")
    assert b._thread is not None and b._thread.is_alive()


def test_inflating_a_bomb_never_holds_more_than_the_limit() -> None:
    """Refused before its output exists: the old `decompress(max) + flush()` inflated the
    rest of the frame (10 MB here) before the size check."""
    inbox, key = Inbox(), b"k" * 200
    assert inbox.receive("p", {"e": 1, "v": 1}, key, 0.0) is True
    blob = bomb_against(key)
    tracemalloc.start()
    try:
        assert inbox.receive("p", {"e": 1, "v": 2, "k": 1}, blob, 0.0) is False
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * MAX_STATE_BYTES + 64 * 1024, peak
    assert inbox.state_of("p") == (key, 0.0)
