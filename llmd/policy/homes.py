"""Balanced homes for repeated prompt prefixes: which nodes a prefix's traffic is kept on.

A prefix router keeps each shared prefix (a system prompt) on one node, so that its KV is held
once in the cluster, not once per node. Which node must be agreed by every ingress, and it must
spread both the traffic and the KV the prefixes take. Rendezvous hashing alone does the first
and not the second: bench/cluster.py (a) deals 7 of its 10 system prompts, 62 % of the traffic,
to one of 3 nodes, whose cache then holds none of them for long; past capacity such a router
spills the overflow onto every node and each node's cache thrashes (0.48 hit rate where one
shared cache gets 0.68; the same prompts on balanced homes, held strictly, 0.76).

This is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018), with
two bounds. Each prefix, taken in the order of its hash (the same at every ingress), goes to
the first node in its rendezvous order whose recent traffic stays under (1 + ε)/N of the
cluster's and whose homed prefixes still fit in a share of its KV. A prefix with more traffic
than one node's bound is split over its next homes (a hot system prompt is served from two),
and placed before the others, while the nodes still have KV room for it.
A prefix with no KV_SHARE room left anywhere is homed where its whole KV has room for it and
traffic is least (`_spill`).
A prefix seen once, or over every node's traffic bound, has no home here: the score places it.

Traffic is the cluster's: each ingress's EXPORT_KEYS busiest prefixes, decayed, its own and
what each peer last sent (`export` and `merge`, carried by gossip). Ingresses that counted only
their own sample disagreed on 6-46 % of the requests' homes (ten Zipf-popular prefixes, three
ingresses, a simulation), and every disagreement copies a prefix onto a second node. With the
same totals they differ only by the last second's arrivals: 0.1-0.4 % of the requests. (A
hysteresis that kept each prefix on its last home made it worse: a disagreement from the first
seconds, before peers were heard, was kept for good.) A prefix that still lands apart gets a
second copy: a cost in hits, never in correctness. Pure: an injected clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from llmd.policy.rendezvous import home_ranks

HALF_LIFE_S: Final = 60.0  # how long a prefix's traffic is remembered (decayed by half)
EPSILON: Final = 0.25  # a node's traffic bound: (1 + ε) x the mean; tighter, prefixes were split or left homeless
# and the leftovers piled onto the least loaded node's cache (0.83 of hit rate at 30 % load against 0.89)
KV_SHARE: Final = 0.75  # homed prefixes take at most this share of a node's KV: the rest holds the chats'
# histories and running sequences (at 1.0 a node homed 4 of bench (a)'s 96-block prompts in 400 blocks
# and evicted each chat's history within the 3 s its user read the answer)
MIN_REQUESTS: Final = 2.0  # a prefix seen fewer times (decayed) than this is not repeated traffic
REFRESH_S: Final = 1.0  # the assignment is recomputed at most this often (or when the nodes change)
MAX_KEYS: Final = 512  # prefixes remembered; the least used are dropped beyond this
MAX_SHARED_BLOCKS: Final = 1024  # a prefix's shared blocks are kept up to this many (64k tokens of 64-token blocks)
PEER_TTL_S: Final = 10.0  # a peer's traffic unheard of for this long is left out (it stopped sending)
EXPORT_KEYS: Final = 16  # the busiest prefixes a node tells its peers about
LEVELS_PER_DOUBLING: Final = 8  # exported figures sit on a log grid, one byte each on the wire (±4.4 %)
_LEVEL_ZERO: Final = 32  # level of 1.0: the grid spans 2**-3.9 .. 2**27.9
CONGESTION_TAU_S: Final = 5.0  # the cluster's queued prefill is smoothed over about this long
BIND_ON_S: Final = 0.5  # homes_bind = "congested": homes bind once the nodes' smoothed queued prefill averages
# this many seconds ...
BIND_OFF_S: Final = 0.25  # ... and stop binding once it is back under this (hysteresis: no flapping on bursts)


@dataclass(frozen=True)
class Shared:
    """One prefix's decayed traffic as an ingress reports it to its peers."""

    key: int
    requests: float
    tokens: float
    size: int


@dataclass
class _Traffic:
    requests: float  # decayed, as of `at`
    tokens: float  # decayed prompt tokens: the prefill work the prefix brings
    size: int  # the shortest prompt seen with it: the shared part is at most this long
    at: float


class HomeTable:
    """Recent traffic per prefix key (`rendezvous.home_key`) and the balanced homes derived from it."""

    def __init__(self, clock: Callable[[], float], *, half_life_s: float = HALF_LIFE_S, epsilon: float = EPSILON,
                 kv_share: float = KV_SHARE, min_requests: float = MIN_REQUESTS, refresh_s: float = REFRESH_S,
                 max_keys: int = MAX_KEYS) -> None:
        self._clock = clock
        self.half_life_s, self.epsilon, self.kv_share = half_life_s, epsilon, kv_share
        self.min_requests, self.refresh_s, self.max_keys = min_requests, refresh_s, max_keys
        self._traffic: dict[int, _Traffic] = {}
        self._shared: dict[int, list[int]] = {}  # key -> the block hashes its requests here all began with
        self._peers: dict[str, tuple[float, tuple[Shared, ...]]] = {}  # peer -> (heard at, its traffic then)
        self._sent: tuple[float, tuple[Shared, ...]] | None = None  # (when, what) this ingress last exported
        self._homes: dict[int, dict[str, float]] = {}  # key -> {node: share of its traffic}
        self._nodes: tuple[tuple[str, int], ...] = ()
        self._next = -math.inf

    def observe(self, key: int, prompt_tokens: int, hashes: Sequence[int] = ()) -> None:
        """A request with this prefix key was routed; `hashes`: its prompt's chain of block
        hashes (prefixes.py), from which the blocks its prefix's requests share are kept."""
        now = self._clock()
        t = self._traffic.get(key)
        if t is None:
            if len(self._traffic) >= self.max_keys:
                self._drop_least(now)
            self._traffic[key] = _Traffic(1.0, float(prompt_tokens), prompt_tokens, now)
        else:
            f = self._decay(now - t.at)
            t.requests, t.tokens, t.at = t.requests * f + 1.0, t.tokens * f + prompt_tokens, now
            t.size = min(t.size, prompt_tokens)
        if hashes:
            self._share(key, hashes)

    def shared_blocks(self, key: int) -> int | None:
        """How many leading blocks every request with this prefix key routed here began with
        (a system prompt's, once two chats are seen; a first request's all); None: none seen
        with its hashes. What every home of the prefix is counted as holding (placement's
        `home_credit`): a node holding more of a prompt holds its chat's history."""
        shared = self._shared.get(key)
        return None if shared is None else len(shared)

    def _share(self, key: int, hashes: Sequence[int]) -> None:
        shared = self._shared.get(key)  # kept for the keys in `_traffic` (dropped with them)
        if shared is None:
            self._shared[key] = list(hashes[:MAX_SHARED_BLOCKS])
            return
        n = 0
        for a, b in zip(shared, hashes, strict=False):
            if a != b:
                break
            n += 1
        del shared[n:]

    def export(self, limit: int = EXPORT_KEYS) -> tuple[Shared, ...]:
        """This ingress's own traffic for its busiest prefixes, decayed to now, on the grid the
        wire carries (what gossip sends). Its own totals count these same figures from here on,
        decayed as its peers decay them: every ingress sums the same numbers."""
        now = self._clock()
        self._sent = (now, self._busiest(now, limit))
        return self._sent[1]

    def _busiest(self, now: float, limit: int) -> tuple[Shared, ...]:
        out = []
        for key, t in self._traffic.items():
            f = self._decay(now - t.at)
            out.append((t.tokens * f, key, t.requests * f, t.size))
        out.sort(key=lambda e: (-e[0], e[1]))
        return tuple(Shared(key, on_grid(req), on_grid(tokens), size) for tokens, key, req, size in out[:limit])

    def merge(self, peer: str, traffic: tuple[Shared, ...]) -> None:
        """What `peer` last said it routed (its `export`), as of now."""
        self._peers[peer] = (self._clock(), traffic)

    def forget(self, peer: str) -> None:
        """The peer left or died: its traffic no longer counts."""
        self._peers.pop(peer, None)

    def homes(self, key: int, kv_tokens: Mapping[str, int]) -> dict[str, float]:
        """The prefix's homes among these nodes (name -> KV capacity in tokens), each with its
        share of the prefix's traffic; empty when it has none (rare, or fits nowhere)."""
        nodes = tuple(sorted(kv_tokens.items()))
        now = self._clock()
        if nodes != self._nodes or now >= self._next:
            self._nodes, self._next = nodes, now + self.refresh_s
            self._homes = self._assign(dict(nodes), now)
        return self._homes.get(key, {})

    def status(self) -> dict[str, object]:
        """For /admin/cluster: prefixes this ingress routed, those with homes (from the cluster's
        traffic), how many each node is home to, and the peers whose traffic counts."""
        per_node: dict[str, int] = {}
        for shares in self._homes.values():
            for n in shares:
                per_node[n] = per_node.get(n, 0) + 1
        return {"prefixes": len(self._traffic), "homed": len(self._homes), "per_node": per_node,
                "peers": len(self._peers)}

    def _decay(self, dt: float) -> float:
        return math.exp(-math.log(2) * max(0.0, dt) / self.half_life_s)

    def _drop_least(self, now: float) -> None:
        least = min(self._traffic, key=lambda k: self._traffic[k].requests * self._decay(now - self._traffic[k].at))
        del self._traffic[least]
        self._shared.pop(least, None)

    def _assign(self, kv_tokens: dict[str, int], now: float) -> dict[int, dict[str, float]]:
        """Bounded-load consistent hashing over the repeated prefixes, in the order of their keys."""
        if not kv_tokens:
            return {}
        weight = {key: (e.tokens, e.size) for key, e in self._totals(now).items() if e.requests >= self.min_requests}
        total = sum(w for w, _ in weight.values())
        if total <= 0:
            return {}
        cap = (1 + self.epsilon) * total / len(kv_tokens)
        load = dict.fromkeys(kv_tokens, 0.0)
        room = {n: self.kv_share * kv for n, kv in kv_tokens.items()}
        out: dict[int, dict[str, float]] = {}
        # Prefixes too big for one node's bound first (first-fit decreasing, in two classes so
        # that every ingress orders them alike): placed last, a hot prefix found the nodes' KV
        # taken by small prefixes and piled onto one node (half the traffic: 0.52 of it on one).
        for key in sorted(weight, key=lambda k: (weight[k][0] <= cap, k)):
            w, size = weight[key]
            shares = _place(w, size, home_ranks(key, kv_tokens), cap, load, room, total / len(kv_tokens))
            if shares:
                out[key] = {n: s / w for n, s in shares.items()}
        for key in sorted(k for k in weight if k not in out):  # no KV_SHARE room, or every node with it at its bound
            node = _spill(weight[key][0], weight[key][1], cap, load, room, kv_tokens, self.kv_share)
            if node is not None:
                out[key] = {node: 1.0}
        return out

    def _totals(self, now: float) -> dict[int, Shared]:
        """Each prefix's traffic over the cluster: what this ingress and each of its peers last
        exported, decayed (its own figures now while it has exported none). Only exported
        figures count, its own too: a prefix outside every export (none of the ingresses'
        EXPORT_KEYS busiest) would be counted by one ingress alone and land wherever its own
        sample put it; it has no home (the score places it), and the rest are counted alike at
        every ingress."""
        out: dict[int, Shared] = {}

        def add(key: int, requests: float, tokens: float, size: int) -> None:
            e = out.get(key)
            out[key] = Shared(key, requests, tokens, size) if e is None else \
                Shared(key, e.requests + requests, e.tokens + tokens, min(e.size, size))

        at, own = self._sent if self._sent is not None else (now, self._busiest(now, EXPORT_KEYS))
        f = self._decay(now - at)
        for e in own:
            add(e.key, e.requests * f, e.tokens * f, e.size)
        for peer, (at, traffic) in list(self._peers.items()):
            if now - at > PEER_TTL_S:
                del self._peers[peer]
                continue
            f = self._decay(now - at)
            for e in traffic:
                add(e.key, e.requests * f, e.tokens * f, e.size)
        return out


class Congestion:
    """With `[cluster] homes_bind = "congested"`, whether balanced homes bind now: only once the
    cluster has been queueing prefill for a while (the default binds them always: bench (a14)
    found the gate's light-load placement evicting chats' histories). The gate was built on a
    bench that sent other chats in every run: there homes looked to cost the 70 % load TTFT p90
    (1.29 s against 0.75 s, bench (a8)). The signal is smoothed over
    `tau_s` and held between two bounds, so bursts at half load do not flip it (a per-request
    `busy` test did, and each flip moved prompts between their holders and their homes)."""

    def __init__(self, clock: Callable[[], float], *, tau_s: float = CONGESTION_TAU_S,
                 on_s: float = BIND_ON_S, off_s: float = BIND_OFF_S) -> None:
        self._clock = clock
        self.tau_s, self.on_s, self.off_s = tau_s, on_s, off_s
        self.level = 0.0  # smoothed seconds of prefill queued per node, from an idle start
        self.bound = False
        self._at = clock()

    def update(self, queued_s: float) -> bool:
        """The nodes' mean queued prefill now, in seconds of their prefill; whether homes bind."""
        now = self._clock()
        self.level += (1 - math.exp(-max(0.0, now - self._at) / self.tau_s)) * (queued_s - self.level)
        self._at = now
        if self.bound and self.level < self.off_s:
            self.bound = False
        elif not self.bound and self.level >= self.on_s:
            self.bound = True
        return self.bound


def level(x: float) -> int:
    """`x` as a byte on the log grid (0: nothing); what the wire carries of an exported figure."""
    if not x > 0:
        return 0
    return max(1, min(255, round(LEVELS_PER_DOUBLING * math.log2(x)) + _LEVEL_ZERO))


def from_level(q: int) -> float:
    return 0.0 if q <= 0 else 2.0 ** ((q - _LEVEL_ZERO) / LEVELS_PER_DOUBLING)


def on_grid(x: float) -> float:
    return from_level(level(x))


def _spill(w: float, size: int, cap: float, load: dict[str, float], room: dict[str, float],
           kv_tokens: Mapping[str, int], kv_share: float) -> str | None:
    """A home for a prefix no node had KV_SHARE room for: the node whose whole KV has room for
    the most copies of it, the least traffic on ties, under the traffic bound. Left to the
    score, such a prefix stayed wherever it first ran, its cache holder keeping it; in bench
    (a14)'s two poorest runs at 100 % that was the busiest node, whose chats' histories it
    then evicted."""
    whole = {n: kv - (kv_share * kv - room[n]) for n, kv in kv_tokens.items()}  # its KV less what is homed
    ok = [n for n in sorted(kv_tokens) if whole[n] >= size and load[n] + w <= cap]
    if not ok:
        return None
    node = min(ok, key=lambda n: (-(whole[n] // size), load[n]))  # room counted in copies of it
    load[node] += w
    room[node] -= size
    return node


def _place(w: float, size: int, ranks: Mapping[str, int], cap: float, load: dict[str, float],
           room: dict[str, float], mean: float) -> dict[str, float]:
    """One prefix's traffic `w` on the first nodes (rendezvous `ranks`) with traffic and KV room:
    whole on one when one can take it, else split in order (a prefix bigger than a node's
    bound), each home filled to the `mean` first and to the bound only if the rest fits nowhere
    else: the bound's slack is there for whole prefixes, and a split one can be cut anywhere.
    Filled to the bound, a hot prefix with half the traffic put 1.25x the mean on its first home,
    whose queue read 2.2-2.8x the nodes' mean at 70 % load in three runs (bench (a16)). Filled to
    half the mean first, it went on all three nodes and evened their requests (the worst run's
    max/mean at each load 1.30-1.36 → 1.06-1.13), but cost 0.04-0.07 of hit rate and 12-40 % of
    TTFT p50 at 70-130 %, where no node was overloaded either way (bench (a20)): not kept.
    Updates `load` and `room`. Traffic that no node with KV room can take under its bound gets no home
    (the score places it): pushed over a bound, it piled a hot prefix on one node."""
    order = sorted(ranks, key=ranks.__getitem__)
    fits = [n for n in order if room[n] >= size]
    whole = next((n for n in fits if load[n] + w <= cap), None)
    if whole is not None:
        load[whole] += w
        room[whole] -= size
        return {whole: w}
    shares: dict[str, float] = {}
    left = w
    for bound in (mean, cap):
        for n in fits:
            take = min(left, bound - load[n])
            if take <= 0:
                continue
            if n not in shares:
                room[n] -= size
            shares[n] = shares.get(n, 0.0) + take
            load[n] += take
            left -= take
            if left <= 1e-9 * w:
                return shares
    if not fits or left > 1e-6 * w:  # every node with room is at its bound: no home for the rest
        return shares
    if left > 0:  # a rounding edge: the rest on the least loaded that fits
        n = min(fits, key=load.__getitem__)
        if n not in shares:
            room[n] -= size
        shares[n] = shares.get(n, 0.0) + left
        load[n] += left
    return shares
