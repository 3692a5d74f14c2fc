"""SWIM membership (Das et al., 2002) with Lifeguard's local health (Dadgar et al., 2017), as a
pure state machine: no sockets, no threads, an injected clock and `random.Random`. The caller
feeds it messages (`receive`) and the passage of time (`tick`) and sends what they return, so
every rule below is tested with a fake clock and a fake network.

- One member is probed per interval, round-robin over a shuffled list, and at once any member
  silent for 3 of its usual gaps (`heard`). No ack within the probe timeout: `indirect_probes`
  others ping it for us (ping-req), and nack if they get nothing either. No ack by the end of
  the interval: suspect. Not refuted within the suspicion timeout (suspicion_s, a little longer
  with log N): dead. A member that hears itself suspected (or dead) refutes by raising its
  incarnation; for one incarnation, alive < suspect < dead < left.
- Lifeguard: this node's health score rises with probes that fail without the others' nacks
  (the fault is probably ours), with refutations, and with stalls of its own thread; it scales
  this node's timeouts by (1 + score), so a starved node does not declare healthy ones dead.
- Updates ride on every message, each about 3·ln(N+1) times, and while any are pending they go
  to 3 random members every 200 ms (memberlist's gossip interval). Joins and anti-entropy
  exchange the whole member list (push-pull). Dead members are synced with now and then, so
  the halves of a healed partition find each other; `left` members are not.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from llmd.cluster.broadcasts import Broadcasts

State = Literal["alive", "suspect", "dead", "left"]
Addr = tuple[str, int]
Msg = dict[str, Any]
Out = tuple[Addr, Msg]
_RANK: dict[str, int] = {"alive": 0, "suspect": 1, "dead": 2, "left": 3}
_CODE: dict[str, State] = {"a": "alive", "s": "suspect", "d": "dead", "l": "left"}


class _Timings(Protocol):
    probe_interval_s: float
    probe_timeout_s: float
    indirect_probes: int
    suspicion_s: float


@dataclass(frozen=True)
class Timing:
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.25
    indirect_probes: int = 2
    suspicion_s: float = 1.5
    max_health: int = 8  # Lifeguard's cap: timeouts grow at most 9x
    dead_sync_s: float = 5.0  # a dead member is synced with this often (a healed partition rejoins)
    sync_s: float = 30.0  # anti-entropy: the whole list with one random alive member
    join_retry_s: float = 1.0  # seeds are asked again while no member is known alive
    gossip_s: float = 0.2  # pending updates go to `gossip_fanout` random members this often
    gossip_fanout: int = 3

    @classmethod
    def of(cls, cfg: _Timings) -> Timing:
        return cls(cfg.probe_interval_s, cfg.probe_timeout_s, cfg.indirect_probes, cfg.suspicion_s)


@dataclass
class Member:
    name: str
    addr: Addr
    http_url: str
    meta: dict[str, Any]
    state: State
    incarnation: int
    since: float  # clock time of the last change
    deadline: float = 0.0  # a suspect's: dead at this time unless refuted


@dataclass
class _Probe:
    target: str
    seq: int
    timeout_at: float
    end_at: float
    acked: bool = False
    indirect: int = 0  # ping-reqs sent
    nacks: int = 0


@dataclass
class _Relay:  # a ping sent on another member's behalf (ping-req)
    to: Addr
    seq: int
    nack_at: float  # early enough to reach the asker before its probe ends (Lifeguard counts them)
    expire_at: float  # a late ack is still forwarded until then
    done: bool = False


@dataclass
class Swim:
    name: str
    addr: Addr
    http_url: str
    timing: Timing
    clock: Callable[[], float]
    rng: random.Random
    meta: dict[str, Any] = field(default_factory=dict)
    incarnation: int = 0
    health: int = 0  # Lifeguard's local health multiplier score
    leaving: bool = False

    def __post_init__(self) -> None:
        self._members: dict[str, Member] = {}
        self._queue = Broadcasts()
        self._order: list[str] = []
        self._probes: dict[int, _Probe] = {}  # seq -> the round-robin probe and any early ones
        self._heard: dict[str, list[float]] = {}  # member -> [last datagram, its usual gap (EWMA)]
        self._relays: dict[int, _Relay] = {}
        self._seq = 0
        now = self._last_tick = self._next_probe = self._next_dead_sync = self._next_gossip = self.clock()
        self._next_join = now
        self._next_sync = now + self.timing.sync_s
        self._seeds: list[Addr] = []
        self.changes: list[Member] = []  # drained by the caller: members whose state changed

    # -- views --------------------------------------------------------------------------------
    def members(self) -> list[Member]:  # copies
        return [replace(m) for m in self._members.values()]

    def alive(self) -> list[Member]:
        return [m for m in self._members.values() if m.state in ("alive", "suspect")]

    def scale(self) -> int:
        return 1 + self.health

    def suspicion_timeout(self) -> float:
        n = 1 + len(self.alive())
        return self.timing.suspicion_s * max(1.0, math.log10(n + 1)) * self.scale()

    # -- updates ------------------------------------------------------------------------------
    def _self_update(self, state: str = "a") -> Msg:
        return {"n": self.name, "s": state, "i": self.incarnation, "a": list(self.addr), "h": self.http_url,
                "m": self.meta}

    @staticmethod
    def _update(m: Member) -> Msg:
        return {"n": m.name, "s": m.state[0], "i": m.incarnation, "a": list(m.addr), "h": m.http_url, "m": m.meta}

    def _gossip(self, update: Msg) -> None:
        self._queue.put(update, math.ceil(3 * math.log(len(self._members) + 2)))  # ~3·ln(N+1) copies

    def attach(self, msg: Msg, to: str | None = None) -> Msg:
        """Piggyback pending updates on `msg` (those about its recipient first), each counted."""
        m = self._members.get(to) if to else None
        first = [self._update(m)] if m is not None and m.state == "suspect" and to not in self._queue else []
        picked = self._queue.take(to, first)  # a suspect must hear its suspicion, to refute it
        if picked:
            msg["u"] = picked
        return msg

    def _apply(self, u: Msg) -> None:
        """One update about a member, by SWIM's precedence: (incarnation, rank) must grow."""
        try:
            name, state, inc = str(u["n"]), _CODE[u["s"]], int(u["i"])
        except (KeyError, TypeError, ValueError):
            return
        if name == self.name:
            self._about_me(state, inc)
            return
        now, m = self.clock(), self._members.get(name)
        if m is None:
            try:
                addr = (str(u["a"][0]), int(u["a"][1]))
            except (KeyError, TypeError, ValueError, IndexError):
                return
            m = Member(name, addr, str(u.get("h", "")), dict(u.get("m") or {}), state, inc, now)
            self._members[name] = m
            self._order.insert(self.rng.randint(0, len(self._order)), name)
        elif (inc, _RANK[state]) <= (m.incarnation, _RANK[m.state]):
            return
        else:
            changed = m.state != state
            m.state, m.incarnation = state, inc
            if changed:
                m.since = now
            if state == "alive" and "a" in u:
                m.addr = (str(u["a"][0]), int(u["a"][1]))
                m.http_url, m.meta = str(u.get("h", "")), dict(u.get("m") or {})
        if state == "suspect":
            m.deadline = now + self.suspicion_timeout()
        self.changes.append(replace(m))
        self._gossip(self._update(m))

    def _about_me(self, state: State, inc: int) -> None:
        if self.leaving:
            return
        if state != "alive" and inc >= self.incarnation:  # suspected or declared dead: refute
            self.incarnation = inc + 1
            self._hurt(1)
            self._gossip(self._self_update())
        elif state == "alive" and inc > self.incarnation:  # a previous life of ours: outrank it
            self.incarnation = inc + 1
            self._gossip(self._self_update())
        elif state != "alive" and self.name not in self._queue:  # stale news: say again who we are
            self._gossip(self._self_update())

    def _hurt(self, delta: int) -> None:
        self.health = min(self.timing.max_health, max(0, self.health + delta))

    def _mark(self, m: Member, state: State) -> None:  # our own verdict, spread like anyone's
        self._apply({"n": m.name, "s": state[0], "i": m.incarnation})

    # -- messages -----------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _sync_msg(self, reply: bool) -> Msg:
        everyone = [self._self_update(), *(self._update(m) for m in self._members.values())]
        return {"t": "sync", "r": reply, "ms": everyone}

    def receive(self, msg: Msg, sender: str, src: Addr) -> list[Out]:
        """Handle one genuine message from `sender` (the signed name) at `src`; what to send."""
        for u in msg.get("u") or ():
            if isinstance(u, dict):
                self._apply(u)
        t, out = msg.get("t"), list[Out]()
        if t == "ping" and msg.get("to") == self.name:
            out.append((src, self.attach({"t": "ack", "q": msg.get("q")}, to=sender)))
        elif t == "ack":
            self._on_ack(msg.get("q"), out)
        elif t == "nack" and (p := self._probes.get(msg.get("q"))) is not None:  # type: ignore[arg-type]
            p.nacks += 1
        elif t == "preq":
            self._relay(msg, src, out)
        elif t == "sync":
            for u in msg.get("ms") or ():
                if isinstance(u, dict):
                    self._apply(u)
            if msg.get("r"):
                out.append((src, self._sync_msg(False)))
        m = self._members.get(sender)
        if m is not None and m.state in ("dead", "left") and not self.leaving:
            back = self.attach({"t": "g"}, to=sender)  # it is back: tell it (so it refutes), with our news
            back["u"] = [self._update(m), *back.get("u", [])]
            out.append((src, back))
        return out

    def _on_ack(self, seq: Any, out: list[Out]) -> None:
        if (p := self._probes.get(seq)) is not None:
            p.acked = True
        relay = self._relays.get(seq) if isinstance(seq, int) else None
        if relay is not None and not relay.done:
            relay.done = True
            out.append((relay.to, self.attach({"t": "ack", "q": relay.seq})))

    def _relay(self, msg: Msg, src: Addr, out: list[Out]) -> None:
        try:
            target, addr = str(msg["to"]), (str(msg["ta"][0]), int(msg["ta"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            return
        seq = self._next_seq()
        now, timeout = self.clock(), self.timing.probe_timeout_s
        self._relays[seq] = _Relay(src, msg.get("q", 0), now + timeout / 2, now + timeout * 2)
        out.append((addr, self.attach({"t": "ping", "q": seq, "to": target}, to=target)))

    # -- time -----------------------------------------------------------------------------------
    def join(self, seeds: Iterable[Addr]) -> list[Out]:
        """Ask each seed for its member list (retried by `tick` while no member is alive)."""
        self._seeds = [s for s in seeds if s != self.addr]
        self._next_join = self.clock() + self.timing.join_retry_s
        return [(s, self._sync_msg(True)) for s in self._seeds]

    def leave(self) -> list[Out]:
        """Graceful: every live member is told this node left (not a death); it stops refuting."""
        self.leaving = True
        self.incarnation += 1
        self._gossip(self._self_update("l"))
        return [(m.addr, self.attach({"t": "g"}, to=m.name)) for m in self.alive()]

    def tick(self) -> list[Out]:
        """Advance timers: suspicions, the probe in flight, the next probe, syncs. Call at least
        every few tens of milliseconds (and at `next_wakeup`)."""
        now, out = self.clock(), list[Out]()
        gap = now - self._last_tick
        self._last_tick = now
        if gap > self.timing.probe_interval_s * 2:  # our own thread stalled: do not blame the others
            self._stalled(gap)
        for m in list(self._members.values()):
            if m.state == "suspect" and now >= m.deadline:
                self._mark(m, "dead")
        for p in list(self._probes.values()):
            self._advance_probe(p, now, out)
        if now >= self._next_probe:
            self._start_probe(self._next_target(), now, out)
        self._probe_the_silent(now, out)
        for seq, r in list(self._relays.items()):
            if now >= r.nack_at and not r.done:
                out.append((r.to, {"t": "nack", "q": r.seq}))
                r.nack_at = r.expire_at
            if now >= r.expire_at:
                del self._relays[seq]
        self._syncs(now, out)
        return out

    def next_wakeup(self) -> float:
        times = [self._next_probe, self._next_sync, self._next_dead_sync]
        times += [m.deadline for m in self._members.values() if m.state == "suspect"]
        times += [t for p in self._probes.values() for t in (p.timeout_at, p.end_at)]
        times += [r.nack_at for r in self._relays.values()]
        return min(times)

    def _stalled(self, gap: float) -> None:
        self._hurt(1)
        for m in self._members.values():
            if m.state == "suspect":
                m.deadline += gap
        for p in self._probes.values():
            p.timeout_at += gap
            p.end_at += gap
        for h in self._heard.values():
            h[0] += gap

    def _next_target(self) -> Member | None:
        for _ in range(2):
            while self._order:
                m = self._members.get(self._order.pop())
                if m is not None and m.state in ("alive", "suspect"):
                    return m
            self._order = list(self._members)
            self.rng.shuffle(self._order)
        return None

    def heard(self, name: str) -> None:
        """A genuine datagram came from `name`: a member that falls silent for several of its
        usual gaps (the state it pushes every ~250 ms) is probed at once, not at its turn."""
        now, h = self.clock(), self._heard.get(name)
        if h is None:
            self._heard[name] = [now, self.timing.probe_interval_s * 4]
        else:
            h[1] += 0.2 * (min(now - h[0], 10.0) - h[1])
            h[0] = now

    def _probe_the_silent(self, now: float, out: list[Out]) -> None:
        probing = {p.target for p in self._probes.values()}
        for name, (last, gap) in self._heard.items():
            m = self._members.get(name)
            if m is None or m.state != "alive" or name in probing:
                continue
            if now - last > max(3 * gap, self.timing.probe_timeout_s) * self.scale():
                self._heard[name][0] = now  # once per silence, not at every tick
                self._start_probe(m, now, out, regular=False)

    def _start_probe(self, m: Member | None, now: float, out: list[Out], regular: bool = True) -> None:
        end = now + self.timing.probe_interval_s * self.scale()
        if regular:
            self._next_probe = end
        if m is None:
            return
        p = _Probe(m.name, self._next_seq(), now + self.timing.probe_timeout_s * self.scale(), end)
        self._probes[p.seq] = p
        out.append((m.addr, self.attach({"t": "ping", "q": p.seq, "to": m.name}, to=m.name)))

    def _advance_probe(self, p: _Probe, now: float, out: list[Out]) -> None:
        m = self._members.get(p.target)
        if p.acked or m is None or m.state in ("dead", "left"):
            del self._probes[p.seq]
            if p.acked:
                self._hurt(-1)
            return
        if now >= p.timeout_at and not p.indirect:
            helpers = [h for h in self.alive() if h.name != p.target and h.state == "alive"]
            for h in self.rng.sample(helpers, min(self.timing.indirect_probes, len(helpers))):
                out.append((h.addr, self.attach({"t": "preq", "q": p.seq, "to": m.name, "ta": list(m.addr)})))
                p.indirect += 1
            p.indirect = p.indirect or -1  # -1: none could be sent
        if now >= p.end_at:
            del self._probes[p.seq]
            self._hurt(p.indirect - p.nacks if p.indirect > 0 else 1)  # Lifeguard: missing nacks blame us
            if m.state == "alive":
                self._mark(m, "suspect")

    def _syncs(self, now: float, out: list[Out]) -> None:
        if self._queue and now >= self._next_gossip:  # news spreads now, not on the next probe
            self._next_gossip = now + self.timing.gossip_s
            live = self.alive()
            fanout = self.rng.sample(live, min(self.timing.gossip_fanout, len(live)))
            out.extend((m.addr, self.attach({"t": "g"}, to=m.name)) for m in fanout)
        if self._seeds and not self.alive() and now >= self._next_join:
            out += self.join(self._seeds)
        if now >= self._next_dead_sync:
            self._next_dead_sync = now + self.timing.dead_sync_s
            dead = [m for m in self._members.values() if m.state == "dead"]
            if dead:
                out.append((self.rng.choice(dead).addr, self._sync_msg(True)))
        if now >= self._next_sync:
            self._next_sync = now + self.timing.sync_s
            live = self.alive()
            if live:
                out.append((self.rng.choice(live).addr, self._sync_msg(True)))
