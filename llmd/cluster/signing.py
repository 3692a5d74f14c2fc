"""Every message between nodes carries an HMAC from the shared cluster secret, so a host that
does not hold it can neither join, nor forge load, nor send work. Gossip datagrams, internal
HTTP calls, their responses and each line of a forwarded stream are signed; a stale, replayed,
misaddressed or forged one is dropped and counted.

Each signature names its receiver: an HTTP call the node it is sent to (a call captured on its
way to one node is refused by another), a response or stream line the request it answers (its
nonce), a datagram the member it is for ("" only for a seed whose name is not known yet).
Replay guard: the sender's clock must be within `window_s` of ours, and a (sender, nonce) seen
within the window is refused. Which secret signs and which verify is the `Keyring`'s (two-key
rotation by `llmd reload`). Datagrams start with a magic and a format version byte; this format
(2) does not interoperate with the one before it (a rolling upgrade across it is unsupported).
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

from llmd.cluster.keyring import Key, Keyring, key_id

MAC_BYTES = 16  # truncated HMAC-SHA256: 128 bits is ample against forgery, and gossip stays small
_NONCE_BYTES = 8
_KID_BYTES = 4  # a key id (`key_id`, 8 hex digits) as bytes
_MAGIC = b"\xa7"  # a sealed datagram's first byte; then its format version
VERSION = 2
_TIME = struct.Struct("<d")
HEADER_NODE, HEADER_TO, HEADER_TIME, HEADER_NONCE, HEADER_KEY, HEADER_SIG = (
    "X-LLMD-Node", "X-LLMD-To", "X-LLMD-Time", "X-LLMD-Nonce", "X-LLMD-Key", "X-LLMD-Signature")
_HEADERS = (HEADER_NODE, HEADER_TO, HEADER_TIME, HEADER_NONCE, HEADER_KEY, HEADER_SIG)
LINE_TAG = 8 + 2 * MAC_BYTES  # a signed stream line starts with its key id and MAC in hex, then a space

__all__ = ["HEADER_NONCE", "Keyring", "Signer", "Verified", "key_id"]


@dataclass(frozen=True)
class Verified:
    sender: str
    payload: bytes
    sent_at: float
    to: str = ""


class Signer:
    """Seals and opens messages for one node. `clock` is wall time (peers compare clocks).
    `keys` is the node's keyring (shared by its signers, so a reload re-keys them all), or a
    list of secrets (a keyring of its own)."""

    def __init__(self, node: str, keys: Keyring | list[bytes], clock: Callable[[], float], window_s: float = 5.0,
                 purpose: str = "gossip") -> None:
        self.node = node
        self._node = node.encode()
        if not 0 < len(self._node) < 256:
            raise ValueError(f"a node's name is 1-255 bytes of UTF-8, got {len(self._node)}")
        self.keyring = keys if isinstance(keys, Keyring) else Keyring(keys, clock)
        self.window_s, self.purpose = window_s, purpose
        self._clock = clock
        self._seen: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (sender, nonce) -> expiry
        self.dropped: Counter[str] = Counter()  # reason -> count: unsigned, forged, stale, replayed, misaddressed

    def _signing(self) -> tuple[str, bytes]:
        k = self.keyring.signing()
        return k.kid, self.keyring.subkey(k, self.purpose)

    # -- datagrams: magic, version, len(node), node, len(to), to, time (f64), nonce, key id, mac, payload
    def seal(self, payload: bytes, to: str = "") -> bytes:
        kid, key = self._signing()
        dest = to.encode()[:255]
        head = (_MAGIC + bytes([VERSION, len(self._node)]) + self._node + bytes([len(dest)]) + dest
                + _TIME.pack(self._clock()) + os.urandom(_NONCE_BYTES) + bytes.fromhex(kid))
        return head + hmac.new(key, head + payload, hashlib.sha256).digest()[:MAC_BYTES] + payload

    def open(self, data: bytes) -> Verified | None:
        """The payload if the message is genuine, fresh and for this node; None (counted by reason) otherwise."""
        parsed = _parse(data)
        if parsed is None:
            other_version = len(data) > 1 and data[:1] == _MAGIC and data[1] != VERSION
            self.dropped["version" if other_version else "unsigned"] += 1
            return None
        sender, to, sent_at, nonce, kid, at = parsed
        payload = data[at + MAC_BYTES:]
        if not self._valid(kid, data[:at] + payload, data[at:at + MAC_BYTES]):
            self.dropped["forged"] += 1
            return None
        if to not in ("", self.node):
            self.dropped["misaddressed"] += 1
            return None
        return Verified(sender, payload, sent_at, to) if self._fresh(sender, nonce, sent_at) else None

    # -- HTTP: the same MAC over method, path, sender, receiver, the headers' fields and the body's digest
    def headers(self, method: str, path: str, body: bytes = b"", to: str = "", reply_to: str = "") -> dict[str, str]:
        """Headers for a call to node `to` (or, with `reply_to`, a response to the call with that nonce)."""
        kid, key = self._signing()
        ts, nonce = repr(self._clock()), os.urandom(_NONCE_BYTES).hex()
        sig = hmac.new(key, _canonical(method, path, self.node, to, ts, nonce, body, reply_to),
                       hashlib.sha256).hexdigest()
        return {HEADER_NODE: self.node, HEADER_TO: to, HEADER_TIME: ts, HEADER_NONCE: nonce, HEADER_KEY: kid,
                HEADER_SIG: sig}

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"",
               reply_to: str = "", sender: str | None = None) -> str | None:
        """The sending node's name, or None (counted) for an unsigned, forged, stale, replayed call
        or one addressed to another node. A response: `reply_to` is the call's nonce, `sender`
        the node called."""
        h = {k.lower(): v for k, v in headers.items()}
        got = [h.get(n.lower()) for n in _HEADERS]
        if any(v is None for v in got):
            self.dropped["unsigned"] += 1
            return None
        node, to, ts, nonce, kid, sig = (str(v) for v in got)
        try:
            sent_at, given = float(ts), bytes.fromhex(sig)
        except ValueError:
            self.dropped["unsigned"] += 1
            return None
        if not self._valid(kid, _canonical(method, path, node, to, ts, nonce, body, reply_to), given):
            self.dropped["forged"] += 1
            return None
        if to != self.node or (sender is not None and node != sender):
            self.dropped["misaddressed"] += 1
            return None
        return node if self._fresh(node, nonce.encode(), sent_at) else None

    # -- a streamed response's lines: each MAC binds the call's nonce and the line's place ---------
    def sign_line(self, nonce: str, index: int, line: bytes) -> bytes:
        """`line` prefixed with its key id and MAC (over the line without its newline), newline-ended."""
        kid, key = self._signing()
        line = line.rstrip(b"\n")
        return (kid + _line_mac(key, nonce, index, line).hex() + " ").encode() + line + b"\n"

    def open_line(self, nonce: str, index: int, signed: bytes) -> bytes | None:
        """The line if it is the `index`th line of the answer to the call with `nonce`; None (counted)."""
        signed = signed.rstrip(b"\n")
        tag, line = signed[:LINE_TAG], signed[LINE_TAG + 1:]
        try:
            kid, given = tag[:8].decode(), bytes.fromhex(tag[8:].decode())
        except (UnicodeDecodeError, ValueError):
            kid, given = "", b""
        if len(given) != MAC_BYTES or signed[LINE_TAG:LINE_TAG + 1] != b" ":
            self.dropped["unsigned"] += 1
            return None
        for k in self._ordered(kid):
            if hmac.compare_digest(_line_mac(self.keyring.subkey(k, self.purpose), nonce, index, line), given):
                return line
        self.dropped["forged"] += 1
        return None

    # -- shared checks ---------------------------------------------------------------------------
    def _ordered(self, kid: str) -> list[Key]:
        return sorted(self.keyring.accepted(), key=lambda k: k.kid != kid)  # the named key first

    def _valid(self, kid: str, message: bytes, given: bytes) -> bool:
        if len(given) < MAC_BYTES:
            return False
        for k in self._ordered(kid):
            want = hmac.new(self.keyring.subkey(k, self.purpose), message, hashlib.sha256).digest()
            if hmac.compare_digest(want[:len(given)], given):
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


def _parse(data: bytes) -> tuple[str, str, float, bytes, str, int] | None:
    """(sender, to, sent_at, nonce, key id, where the mac starts) of a well-formed datagram."""
    if len(data) < 3 or data[:1] != _MAGIC or data[1] != VERSION:
        return None
    n = data[2]
    if len(data) < 4 + n:
        return None
    m = data[3 + n]
    at = 4 + n + m + _TIME.size + _NONCE_BYTES + _KID_BYTES
    if n == 0 or len(data) < at + MAC_BYTES:
        return None
    try:
        sender, to = data[3:3 + n].decode(), data[4 + n:4 + n + m].decode()
    except UnicodeDecodeError:
        return None
    (sent_at,) = _TIME.unpack_from(data, 4 + n + m)
    nonce = data[at - _KID_BYTES - _NONCE_BYTES:at - _KID_BYTES]
    return sender, to, sent_at, nonce, data[at - _KID_BYTES:at].hex(), at


def _line_mac(key: bytes, nonce: str, index: int, line: bytes) -> bytes:
    return hmac.new(key, f"line\n{nonce}\n{index}\n".encode() + line, hashlib.sha256).digest()[:MAC_BYTES]


def _canonical(method: str, path: str, node: str, to: str, ts: str, nonce: str, body: bytes, reply_to: str) -> bytes:
    return "\n".join([method.upper(), path, node, to, ts, nonce, reply_to, hashlib.sha256(body).hexdigest()]).encode()
