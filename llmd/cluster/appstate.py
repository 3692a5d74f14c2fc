"""A node's application state (its load, bytes it publishes) pushed to every peer over gossip.

Each frame is a *delta*: the state deflated with a *keyframe* (an earlier full copy) as zlib's
preset dictionary, a few dozen bytes when a few numbers moved. A full copy goes out as the new
keyframe when a delta would not be much smaller, or when the keyframe is `KEY_MAX_AGE_S` old.
A frame goes to every peer when the state changed (at most every interval) and at least every
heartbeat. A peer that lacks the keyframe (it joined since, or the datagram was lost) asks for
it (`keyframe()`), so nothing waits for the next full copy. An epoch, drawn at start, tells a
restarted peer's versions from its previous life's.

Bandwidth: the signature and header cost ~100 bytes a datagram, so a node's state traffic grows
with its peers; `interval_for(peers)` stretches the interval so it stays under
`STATE_BUDGET_BPS` (at 16 nodes and ~200-byte frames: every ~0.5 s instead of 0.25 s).
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from typing import Any

MAX_STATE_BYTES = 1200  # one datagram
KEY_MAX_AGE_S = 30.0  # a new keyframe at least this often, so deltas stay small as the state drifts
STATE_BUDGET_BPS = 6000  # bytes/s of state frames a node sends, all peers together (a soft cap)


def _delta(key: bytes, state: bytes) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, -15, zdict=key)  # raw deflate: no header, no checksum
    return z.compress(state) + z.flush()


def _undelta(key: bytes, blob: bytes) -> bytes:
    """The state a delta holds, never more than MAX_STATE_BYTES of it: a small frame that would
    expand past the limit is refused before its output is produced (no `flush()`, which would
    inflate whatever input is left, unbounded)."""
    z = zlib.decompressobj(-15, zdict=key)
    state = z.decompress(blob, MAX_STATE_BYTES + 1)
    if len(state) > MAX_STATE_BYTES or not z.eof:
        raise zlib.error(f"a state frame expands past {MAX_STATE_BYTES} bytes (or is cut short)")
    return state


class Outbox:
    """This node's state and when to send it: `due(now)` is the frame for every peer, or None."""

    def __init__(self, interval_s: float, heartbeat_s: float) -> None:
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.epoch = int.from_bytes(os.urandom(3), "big")
        self._state: bytes | None = None
        self._version = self._sent = 0
        self._key, self._key_version, self._key_at = b"", 0, -math.inf
        self._last_send = -math.inf
        self._frame_bytes = 200.0  # recent frames' size (EWMA), for the budget

    def publish(self, state: bytes) -> None:
        if len(state) > MAX_STATE_BYTES:
            raise ValueError(f"a node's state is at most {MAX_STATE_BYTES} bytes (one datagram), got {len(state)}")
        if state != self._state:
            self._state = state
            self._version += 1

    def interval_for(self, peers: int) -> float:
        """The push interval with `peers` peers: the configured one, longer if the budget needs it."""
        return max(self.interval_s, peers * (self._frame_bytes + 100) / STATE_BUDGET_BPS)

    def due(self, now: float, interval_s: float | None = None) -> tuple[dict[str, Any], bytes] | None:
        """(header, blob) to send to every peer now, or None. `interval_s` overrides the interval."""
        if self._state is None:
            return None
        interval = self.interval_s if interval_s is None else interval_s
        heartbeat = now - self._last_send >= self.heartbeat_s
        if not heartbeat and (self._version == self._sent or now - self._last_send < interval):
            return None
        head: dict[str, Any] = {"t": "st", "e": self.epoch, "v": self._version}
        blob = self._state
        if self._key_version and now - self._key_at < KEY_MAX_AGE_S:
            d = _delta(self._key, self._state)
            if len(d) < 0.75 * len(self._state):
                head["k"], blob = self._key_version, d
        if "k" not in head:
            self._key, self._key_version, self._key_at = self._state, self._version, now
        self._sent, self._last_send = self._version, now
        self._frame_bytes += 0.2 * (len(blob) - self._frame_bytes)
        return head, blob

    def keyframe(self) -> tuple[dict[str, Any], bytes] | None:
        """The current keyframe, for a peer that asked (it lacks it)."""
        if not self._key_version:
            return None
        return {"t": "st", "e": self.epoch, "v": self._key_version}, self._key


@dataclass
class _Peer:
    epoch: int
    version: int
    state: bytes
    received_at: float
    key: bytes = b""
    key_version: int = 0


class Inbox:
    """Every peer's latest state, as its frames arrive (reordered and stale ones ignored)."""

    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}

    def receive(self, peer: str, head: dict[str, Any], blob: bytes, now: float) -> bool | None:
        """True: the peer's newest state; False: an old frame; None: a delta without its keyframe
        (ask the peer for it)."""
        try:
            epoch, version, key = int(head["e"]), int(head["v"]), int(head.get("k", 0))
        except (KeyError, TypeError, ValueError):
            return False
        p = self._peers.get(peer)
        if p is None or p.epoch != epoch:
            if key:
                return None
            p = self._peers[peer] = _Peer(epoch, 0, b"", now)
        if key:
            if p.key_version != key:
                return None if key > p.key_version else False
            try:
                state = _undelta(p.key, blob)
            except zlib.error:
                return False
        else:
            state = blob
            if version > p.key_version and len(state) <= MAX_STATE_BYTES:
                p.key, p.key_version = state, version
        if version <= p.version or len(state) > MAX_STATE_BYTES:
            return False
        p.version, p.state, p.received_at = version, state, now
        return True

    def state_of(self, peer: str) -> tuple[bytes, float] | None:
        p = self._peers.get(peer)
        return None if p is None or not p.version else (p.state, p.received_at)
