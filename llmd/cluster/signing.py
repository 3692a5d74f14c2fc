"""Every message between nodes carries an HMAC from the shared cluster secret, so a host that
does not hold it can neither join, nor forge load, nor send work. Gossip datagrams and
internal HTTP calls are signed the same way; a stale or replayed one is dropped and counted.

Replay guard: the sender's clock must be within `window_s` of ours, and a (sender, nonce)
seen within the window is refused. Key rotation: the first secret signs, every secret
verifies, so an operator puts the new secret first on every node, then drops the old one.
Subkeys come from the secret by HKDF-style derivation (HMAC with a label), one per purpose.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAC_BYTES = 16  # truncated HMAC-SHA256: 128 bits is ample against forgery, and gossip stays small
_NONCE_BYTES = 8
_KID_BYTES = 4  # a key id (`key_id`, 8 hex digits) as bytes
_MAGIC = b"\xa7"  # a sealed datagram's first byte (its binary header: ~40 bytes, not ~75 as text)
_TIME = struct.Struct("<d")
HEADER_NODE, HEADER_TIME, HEADER_NONCE, HEADER_KEY, HEADER_SIG = (
    "X-LLMD-Node", "X-LLMD-Time", "X-LLMD-Nonce", "X-LLMD-Key", "X-LLMD-Signature")


def _derive(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, b"llmd-cluster/" + purpose.encode(), hashlib.sha256).digest()


def key_id(secret: bytes) -> str:
    """A short public name for a secret, so a receiver tries the right key first."""
    return _derive(secret, "id").hex()[:8]


@dataclass(frozen=True)
class Verified:
    sender: str
    payload: bytes
    sent_at: float


class Signer:
    """Seals and opens messages for one node. `clock` is wall time (peers compare clocks)."""

    def __init__(self, node: str, secrets: list[bytes], clock: Callable[[], float], window_s: float = 5.0,
                 purpose: str = "gossip") -> None:
        if not secrets:
            raise ValueError("a cluster needs at least one secret")
        self.node = node
        self._node = node.encode()
        if not 0 < len(self._node) < 256:
            raise ValueError(f"a node's name is 1-255 bytes of UTF-8, got {len(self._node)}")
        self.window_s = window_s
        self._clock = clock
        self._keys = [(key_id(s), _derive(s, purpose)) for s in secrets]
        self._seen: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (sender, nonce) -> expiry
        self.dropped: Counter[str] = Counter()  # reason -> count: unsigned, forged, stale, replayed

    # -- datagrams: magic, len(node), node, time (f64), nonce, key id, mac, payload ---------------
    def seal(self, payload: bytes) -> bytes:
        kid, key = self._keys[0]
        head = (_MAGIC + bytes([len(self._node)]) + self._node + _TIME.pack(self._clock())
                + os.urandom(_NONCE_BYTES) + bytes.fromhex(kid))
        return head + hmac.new(key, head + payload, hashlib.sha256).digest()[:MAC_BYTES] + payload

    def open(self, data: bytes) -> Verified | None:
        """The payload if the message is genuine and fresh; None (counted by reason) otherwise."""
        n = data[1] if len(data) > 1 and data[:1] == _MAGIC else -1
        at = 2 + n + _TIME.size + _NONCE_BYTES + _KID_BYTES  # where the mac starts
        if n < 0 or len(data) < at + MAC_BYTES:
            self.dropped["unsigned"] += 1
            return None
        try:
            sender = data[2:2 + n].decode()
        except UnicodeDecodeError:
            self.dropped["unsigned"] += 1
            return None
        (sent_at,) = _TIME.unpack_from(data, 2 + n)
        nonce = data[at - _KID_BYTES - _NONCE_BYTES:at - _KID_BYTES]
        kid, payload = data[at - _KID_BYTES:at].hex(), data[at + MAC_BYTES:]
        if not self._valid(kid, data[:at] + payload, data[at:at + MAC_BYTES]):
            self.dropped["forged"] += 1
            return None
        return Verified(sender, payload, sent_at) if self._fresh(sender, nonce, sent_at) else None

    # -- HTTP: the same MAC over method, path, the headers' fields and the body's digest ---------
    def headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        kid, key = self._keys[0]
        ts, nonce = repr(self._clock()), os.urandom(_NONCE_BYTES).hex()
        sig = hmac.new(key, _canonical(method, path, self.node, ts, nonce, body), hashlib.sha256).hexdigest()
        return {HEADER_NODE: self.node, HEADER_TIME: ts, HEADER_NONCE: nonce, HEADER_KEY: kid, HEADER_SIG: sig}

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"") -> str | None:
        """The sending node's name, or None (counted) for an unsigned, forged, stale or replayed call."""
        h = {k.lower(): v for k, v in headers.items()}
        got = [h.get(n.lower()) for n in (HEADER_NODE, HEADER_TIME, HEADER_NONCE, HEADER_KEY, HEADER_SIG)]
        if any(v is None for v in got):
            self.dropped["unsigned"] += 1
            return None
        node, ts, nonce, kid, sig = (str(v) for v in got)
        try:
            sent_at, given = float(ts), bytes.fromhex(sig)
        except ValueError:
            self.dropped["unsigned"] += 1
            return None
        if not self._valid(kid, _canonical(method, path, node, ts, nonce, body), given):
            self.dropped["forged"] += 1
            return None
        return node if self._fresh(node, nonce.encode(), sent_at) else None

    # -- shared checks ---------------------------------------------------------------------------
    def _valid(self, kid: str, message: bytes, given: bytes) -> bool:
        ordered = sorted(self._keys, key=lambda k: k[0] != kid)  # the named key first, then the others
        for _, key in ordered:
            want = hmac.new(key, message, hashlib.sha256).digest()
            if hmac.compare_digest(want[:len(given)], given) and len(given) >= MAC_BYTES:
                return True
        return False

    def _fresh(self, sender: str, nonce: bytes, sent_at: float) -> bool:
        now = self._clock()
        if not math.isfinite(sent_at) or abs(now - sent_at) > self.window_s:
            self.dropped["stale"] += 1
            return False
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if (sender, nonce) in self._seen:
            self.dropped["replayed"] += 1
            return False
        self._seen[(sender, nonce)] = now + 2 * self.window_s  # outlives any timestamp still accepted
        return True


def _canonical(method: str, path: str, node: str, ts: str, nonce: str, body: bytes) -> bytes:
    return "\n".join([method.upper(), path, node, ts, nonce, hashlib.sha256(body).hexdigest()]).encode()
