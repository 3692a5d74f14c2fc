"""Every message between nodes carries an HMAC from the shared cluster secret, so a host that
does not hold it can neither join, nor forge load, nor send work. Gossip datagrams and
internal HTTP calls are signed the same way; a stale or replayed one is dropped and counted.

Replay guard: the sender's clock must be within `window_s` of ours, and a (sender, nonce)
seen within the window is refused. Key rotation: the first secret signs, every secret
verifies, so an operator puts the new secret first on every node, then drops the old one.
Subkeys come from the secret by HKDF-style derivation (HMAC with a label), one per purpose.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAC_BYTES = 16  # truncated HMAC-SHA256: 128 bits is ample against forgery, and gossip stays small
_NONCE_BYTES = 8
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
        self.window_s = window_s
        self._clock = clock
        self._keys = [(key_id(s), _derive(s, purpose)) for s in secrets]
        self._seen: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (sender, nonce) -> expiry
        self.dropped: Counter[str] = Counter()  # reason -> count: unsigned, forged, stale, replayed

    # -- datagrams: node \0 time \0 nonce \0 keyid \0 mac \0 payload ---------------------------
    def seal(self, payload: bytes) -> bytes:
        kid, key = self._keys[0]
        head = b"\0".join([self.node.encode(), repr(self._clock()).encode(), os.urandom(_NONCE_BYTES).hex().encode(),
                           kid.encode()])
        mac = hmac.new(key, head + b"\0" + payload, hashlib.sha256).digest()[:MAC_BYTES]
        return head + b"\0" + base64.b64encode(mac) + b"\0" + payload

    def open(self, data: bytes) -> Verified | None:
        """The payload if the message is genuine and fresh; None (counted by reason) otherwise."""
        parts = data.split(b"\0", 5)
        if len(parts) != 6:
            self.dropped["unsigned"] += 1
            return None
        node, ts, nonce, kid, mac, payload = parts
        try:
            given = base64.b64decode(mac, validate=True)
            sender, sent_at = node.decode(), float(ts)
        except ValueError:
            self.dropped["unsigned"] += 1
            return None
        head = b"\0".join([node, ts, nonce, kid])
        if not self._valid(kid.decode(errors="replace"), head + b"\0" + payload, given):
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
        if abs(now - sent_at) > self.window_s:
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
