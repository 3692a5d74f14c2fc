"""`Gossip`: the UDP transport that drives `swim.py`, on a thread of its own (not the sanic
event loop: on two cores a busy engine would starve it, and a starved detector declares healthy
nodes dead). Every datagram is sealed with the cluster's `Signer(purpose="gossip")`; an
unsigned, forged, stale, replayed or misaddressed one is dropped and counted, and so is a genuine
one that does not parse (a member holding the secret cannot stop this thread with one bad
datagram). A genuine datagram from a node not yet known is processed: that is how a node joins
through a seed. State frames name the key ids their sender holds (`kh`: to a new peer, to every
peer when they change, and every HELD_REFRESH_S), so a rotated node signs with the new secret
only once every peer holds it (`keyring.py`).

A datagram's payload is one JSON line (the SWIM message, with piggybacked updates), then, for
a state frame, the raw bytes of this node's state or its delta (`appstate.py`). The state is
pushed to every live peer at most every `load_interval_s` when it changed, at least every
`load_heartbeat_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from llmd.cluster.appstate import Inbox, Outbox
from llmd.cluster.signing import Signer
from llmd.cluster.swim import Addr, Member, Out, Swim, Timing
from llmd.config.cluster import ClusterConfig

log = logging.getLogger(__name__)
MAX_DATAGRAM = 65507
POLL_S = 0.05  # the thread wakes at least this often (a publish, a stop)
HELD_REFRESH_S = 5.0  # a peer is told the key ids held again this often (at once when they change, or it is new)


@dataclass(frozen=True)
class MemberInfo:
    name: str
    gossip_addr: tuple[str, int]
    http_url: str
    state: Literal["alive", "suspect", "dead", "left"]
    incarnation: int
    since: float  # wall time of the last change


@dataclass
class GossipStats:
    sent_bytes: int = 0
    recv_bytes: int = 0
    sent_msgs: int = 0
    recv_msgs: int = 0
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> datagrams


def _info(m: Member) -> MemberInfo:
    return MemberInfo(m.name, m.addr, m.http_url, m.state, m.incarnation, m.since)


class Gossip:
    """One node's membership and state exchange. Thread-safe: the public methods may be called
    from any thread; `on_change` runs on the given asyncio loop."""

    def __init__(self, name: str, bind: tuple[str, int], http_url: str, seeds: list[tuple[str, int]],
                 signer: Signer, cfg: ClusterConfig, clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(bind)
        self._sock.setblocking(False)
        self.bound_port: int = self._sock.getsockname()[1]
        self._seeds = [(socket.gethostbyname(h), p) for h, p in seeds]
        self._signer, self._clock = signer, clock
        self._swim = Swim(name, (bind[0], self.bound_port), http_url, Timing.of(cfg), clock, random.Random())
        self._out = Outbox(cfg.load_interval_s, cfg.load_heartbeat_s)
        self._in = Inbox()
        self._asked: dict[str, float] = {}  # peer -> when its keyframe was last asked for
        self._names: dict[Addr, str] = {}  # a peer's gossip address -> its name, as heard from it
        self._held_told: dict[str, tuple[list[str], float]] = {}  # peer -> the key ids it was last told, when
        self._lock = threading.RLock()
        self._stats = GossipStats()
        self._stopping = threading.Event()
        self._leave = True
        self._thread: threading.Thread | None = None
        self._on_change: Callable[[MemberInfo], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the contract ----------------------------------------------------------------------------
    def start(self, on_change: Callable[[MemberInfo], None] | None = None,
              loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._on_change, self._loop = on_change, loop
        self._thread = threading.Thread(target=self._run, name=f"gossip-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, leave: bool = True) -> None:
        """Graceful: the others are told this node left (unless `leave` is False), then the thread ends."""
        self._leave = leave
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        else:
            self._sock.close()

    def publish(self, state: bytes) -> None:
        with self._lock:
            self._out.publish(state)

    def members(self) -> list[MemberInfo]:
        with self._lock:
            return [_info(m) for m in self._swim.members()]

    def state_of(self, name: str) -> tuple[bytes, float] | None:
        with self._lock:
            return self._in.state_of(name)

    @property
    def stats(self) -> GossipStats:
        with self._lock:
            s = self._stats
            return GossipStats(s.sent_bytes, s.recv_bytes, s.sent_msgs, s.recv_msgs,
                               s.dropped + self._signer.dropped)

    @property
    def health(self) -> int:
        """Lifeguard's local health score (0: healthy); this node's timeouts scale by 1 + it."""
        return self._swim.health

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self._lock:
                self._send(self._swim.join(self._seeds))
            while not self._stopping.is_set():
                wait = min(POLL_S, max(0.0, self._swim.next_wakeup() - self._clock()))
                readable, _, _ = select.select([self._sock], [], [], wait)
                if readable:
                    self._drain()
                with self._lock:
                    self._send(self._swim.tick())
                    self._push()
                self._emit()
            if self._leave:
                with self._lock:
                    self._send(self._swim.leave())
        except Exception:  # the detector must never die silently
            log.exception("gossip thread of %s failed", self.name)
        finally:
            self._sock.close()

    def _send(self, outs: list[Out], blob: bytes = b"") -> None:
        for addr, msg in outs:
            self._sendto(addr, msg, blob)

    def _name_at(self, addr: Addr) -> str:
        """The member at `addr`, which the datagram names as its receiver ("": a seed not heard yet)."""
        name = self._names.get(addr)
        if name is None:
            name = next((m.name for m in self._swim.members() if m.addr == addr), "")
        return name

    def _sendto(self, addr: Addr, msg: dict[str, Any], blob: bytes = b"") -> None:
        payload = json.dumps(msg, separators=(",", ":")).encode()
        data = self._signer.seal(payload + b"\n" + blob if blob else payload, to=self._name_at(addr))
        try:
            self._sock.sendto(data, addr)
        except OSError as e:  # unreachable, buffer full: UDP is lossy anyway, SWIM copes
            self._stats.dropped["send_" + (e.__class__.__name__)] += 1
            return
        self._stats.sent_bytes += len(data)
        self._stats.sent_msgs += 1

    def _drain(self) -> None:
        while True:
            try:
                data, src = self._sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ICMP port unreachable reported on the next read
                continue
            with self._lock:
                self._stats.recv_bytes += len(data)
                self._stats.recv_msgs += 1
                try:
                    self._handle(data, (src[0], src[1]))
                except Exception:  # genuine but malformed (a member with the secret, or a bug): drop it
                    self._stats.dropped["malformed"] += 1
                    log.debug("gossip datagram from %s dropped", src, exc_info=True)

    def _handle(self, data: bytes, src: Addr) -> None:
        v = self._signer.open(data)
        if v is None:
            return  # counted by the signer: unsigned, forged, stale or replayed
        head, _, blob = v.payload.partition(b"\n")
        try:
            msg = json.loads(head)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or v.sender == self.name:
            self._stats.dropped["malformed"] += 1
            return
        self._names[src] = v.sender
        held = msg.get("kh")
        if isinstance(held, list):
            self._signer.keyring.peer_holds(v.sender, held)
        self._swim.heard(v.sender)
        t, now = msg.get("t"), self._clock()
        if t == "st" and self._in.receive(v.sender, msg, blob, now) is None:
            if now - self._asked.get(v.sender, -1e9) >= self._out.heartbeat_s:  # lacks the keyframe: ask
                self._asked[v.sender] = now
                self._sendto(src, {"t": "sk"})
        elif t == "sk" and (key := self._out.keyframe()) is not None:
            self._sendto(src, key[0], key[1])
        self._send(self._swim.receive(msg, v.sender, src))

    def _push(self) -> None:
        peers = self._swim.alive()
        frame = self._out.due(self._clock(), self._out.interval_for(len(peers)))
        if frame is None:
            return
        head, blob = frame
        held, now = self._signer.keyring.held(), self._clock()
        for m in peers:
            out = dict(head)
            told = self._held_told.get(m.name)
            if told is None or told[0] != held or now - told[1] >= HELD_REFRESH_S:  # ~18 bytes, rarely
                out["kh"], self._held_told[m.name] = held, (held, now)
            self._sendto(m.addr, self._swim.attach(out, to=m.name), blob)

    def _emit(self) -> None:
        with self._lock:
            changes, self._swim.changes = self._swim.changes, []
            for m in changes:
                if m.state in ("dead", "left"):
                    self._signer.keyring.forget(m.name)
                    self._names.pop(m.addr, None)
                    self._held_told.pop(m.name, None)  # told again if it comes back
        cb = self._on_change
        if cb is None:
            return
        for m in changes:
            info = _info(m)
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(cb, info)
                except RuntimeError:  # the loop was closed (shutting down): nobody is listening
                    return
            else:
                try:
                    cb(info)
                except Exception:
                    log.exception("gossip on_change callback failed")
