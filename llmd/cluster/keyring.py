"""The cluster secrets one node holds, and which of them signs: what makes a rotation safe on a
running cluster (`llmd reload` on each node in turn, docs/cluster.md "Rotating the secret").

A node holds its configured secrets (the first is its *current* one) and, for `window_s` after a
reload replaced it, the *previous* one: both verify, so peers not yet reloaded are still heard.
It signs with the current secret once every peer it has heard from says it holds that secret
(each datagram names the key ids its sender holds: `held()`), and with a key every peer holds
until then, so nobody is sent a signature it cannot check. Once the window ends the previous
secret is refused, whoever still signs with it: that is what revokes a leaked secret.

Thread-safe: the gossip thread and the event loop both use one keyring.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_HELD = 4  # key ids a peer may claim (configured two, plus previous ones in their window)


def derive(secret: bytes, purpose: str) -> bytes:
    """A subkey per purpose (HKDF-style: HMAC with a label), so a gossip MAC is never an HTTP one."""
    return hmac.new(secret, b"llmd-cluster/" + purpose.encode(), hashlib.sha256).digest()


def key_id(secret: bytes) -> str:
    """A short public name for a secret (8 hex digits): peers say which they hold, and a
    receiver tries the named one first."""
    return derive(secret, "id").hex()[:8]


@dataclass(frozen=True)
class Key:
    kid: str
    secret: bytes
    until: float | None = None  # refused from then on (a previous secret); None: configured


class Keyring:
    def __init__(self, secrets: list[bytes], clock: Callable[[], float], window_s: float = 900.0) -> None:
        if not secrets:
            raise ValueError("a cluster needs at least one secret")
        self._clock, self.window_s = clock, window_s
        self._keys = [Key(key_id(s), s) for s in secrets]  # the current one first
        self._peers: dict[str, frozenset[str]] = {}  # peer -> the key ids it says it holds
        self._subkeys: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    # -- what this node holds -----------------------------------------------------------------
    def rekey(self, secrets: list[bytes], window_s: float | None = None) -> list[str]:
        """Hold `secrets` from now on (the first signs once every peer holds it); a secret held
        before and not in `secrets` is accepted `window_s` longer, then refused. Returns notes
        for the reload report (none: nothing changed)."""
        if not secrets:
            raise ValueError("a cluster needs at least one secret")
        with self._lock:
            if window_s is not None:
                self.window_s = window_s
            now = self._clock()
            wanted = [Key(key_id(s), s) for s in secrets]
            ids = {k.kid for k in wanted}
            live = self._live(now)
            if [k.kid for k in wanted] == [k.kid for k in live if k.until is None]:
                return []
            kept = [k for k in live if k.kid not in ids]
            retired = [k if k.until is not None else Key(k.kid, k.secret, now + self.window_s) for k in kept]
            self._keys = wanted + retired
        notes = [f"cluster secret: key {wanted[0].kid} is current; it signs once every peer holds it"]
        notes += [f"cluster secret: key {k.kid} is still accepted for {k.until - now:.0f} s (rotation_window_s), "
                  "then refused: reload every node before then" for k in retired if k.until is not None]
        return notes

    def _live(self, now: float) -> list[Key]:
        self._keys = [k for k in self._keys if k.until is None or now < k.until]
        return self._keys

    def accepted(self) -> list[Key]:
        """The keys a signature may be made with, current first."""
        with self._lock:
            return list(self._live(self._clock()))

    def held(self) -> list[str]:
        """The key ids this node accepts, as it tells its peers."""
        return [k.kid for k in self.accepted()]

    @property
    def current(self) -> str:
        return self.accepted()[0].kid

    # -- what the peers hold --------------------------------------------------------------------
    def peer_holds(self, peer: str, kids: Iterable[object]) -> None:
        ids = frozenset(k for k in kids if isinstance(k, str) and len(k) == 8)
        if ids and len(ids) <= MAX_HELD:
            with self._lock:
                self._peers[peer] = ids

    def forget(self, peer: str) -> None:
        """A peer that died or left no longer holds back the switch to the current key."""
        with self._lock:
            self._peers.pop(peer, None)

    def signing(self) -> Key:
        """The current key once every peer heard from holds it; until then the first held key
        every one of them holds (the previous secret, during a rotation)."""
        with self._lock:
            keys = self._live(self._clock())
            peers = list(self._peers.values())
        for k in keys:
            if all(k.kid in held for held in peers):
                return k
        return keys[0]

    # -- subkeys ---------------------------------------------------------------------------------
    def subkey(self, key: Key, purpose: str) -> bytes:
        with self._lock:
            sub = self._subkeys.get((key.kid, purpose))
            if sub is None:
                sub = self._subkeys[(key.kid, purpose)] = derive(key.secret, purpose)
            return sub
