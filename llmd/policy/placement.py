"""Which node starts this request soonest: the cluster's routing score, in tokens.

A node's estimated time to first token is the prefill work ahead of the prompt (its waiting
prompts, plus what this node sent it that its gossip does not show yet, plus this prompt's
uncached tokens) over its prefill rate, plus a hop when it is not this node. The score weighs
that by how full the node's KV cache is with running sequences (they slow each step and may
be preempted): score = TTFT · (1 + γ · running_tokens / kv_capacity). docs/cluster.md,
"Routing", says why and what each guard is for.

Guards: *reservations* count what was just sent to a node until its gossip reflects it (a
stale view would otherwise send a whole burst to the node that looked best); the pick is
uniform among the candidates within `near_best` of the best score, capped at NEAR_BEST_MAX_S
(no herding on ties or near-ties, no scattering under deep queues); a *sticky* candidate (this
conversation's last turn ran there) and a *cache holder* (most of the prompt cached) keep it
unless clearly slower, and harder past capacity (`saturated`), where a miss is a full prefill
every later request queues behind. Liveness is the caller's job; so is passing only the routed
version.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from llmd.policy import draws
from llmd.policy.reservations import Reservations
from llmd.policy.room import room_wait_s

HOP_S: Final = 0.005  # forwarding to a peer: a loopback/LAN round trip and a proxy, not free
GAMMA: Final = 1.0  # weight of KV occupancy by running sequences in the score
NEAR_BEST: Final = 0.1  # candidates within 10 % of the best score are equally good ...
NEAR_BEST_MAX_S: Final = 0.05  # ... but never more than 50 ms apart: under deep queues 10 % of the score
# outweighs what a cached prefix saves, and a wide band would scatter prompts off their cache
STICKY_SLACK: Final = 0.5  # a conversation stays on its node unless that node's TTFT is over 1.5x the best ...
STICKY_FLOOR_S: Final = 0.02  # ... plus 20 ms: at light load TTFTs are a few ms, and one turn still queued in
# a stale state (gossip lags a turn or more) read as 1.6x, which moved the chat off its cache
AFFINITY_SLACK: Final = 1.0  # a node holding most of the prompt in cache keeps it up to 2x the best TTFT
# (`_cache_holders`)
SATURATED_AFFINITY_SLACK: Final = 2.0  # past capacity (`saturated`) it keeps it up to 3x: a miss there costs everyone
AFFINITY_MIN_MATCH: Final = 0.5  # "most": at least half the prompt's tokens (SGLang's match threshold)
FLOOR_TPS: Final = 100.0  # a prefill rate nobody knows yet: slow, but never a division by zero
HOME_PREFILLS: Final = 1  # a balanced home (`home_share`) is left when over 3x the best TTFT + this many full prefills
HOLDER_PREFILLS: Final = 1  # a cache holder keeps a prompt up to its slack + this many full prefills of it


@dataclass(init=False, unsafe_hash=True)
class VersionLoad:
    """One served version's load on one node, in tokens (what gossip carries). Immutable: its
    fields are Final. Its __init__ is written out, as are those of the policies' other records
    built per request or tick: compiled (llmd/plan/compiled.py) it runs as C, where a dataclass's
    generated one stays interpreted (a frozen one's at about 15x the cost)."""

    model: Final[str]
    version: Final[str]  # content hash (the store's version id)
    kv_capacity_tokens: Final[int]
    kv_free_tokens: Final[int]
    running: Final[int]
    running_tokens: Final[int]  # sequences and their tokens (prompt + output so far)
    waiting_prefill_tokens: Final[int]  # the engine's waiting prompts plus llmd's queue
    prefill_tps: Final[float]  # recent rates, tokens per second while busy; 0: unknown
    decode_tps: Final[float]
    draining: Final[bool]
    standby: Final[bool]
    tokenizer: Final[str]  # what renders its prompts (llmd.store.tokenizer_id; "": not said)

    def __init__(self, model: str, version: str, kv_capacity_tokens: int, kv_free_tokens: int, running: int,
                 running_tokens: int, waiting_prefill_tokens: int, prefill_tps: float, decode_tps: float,
                 draining: bool = False, standby: bool = False, tokenizer: str = "") -> None:
        self.model = model
        self.version = version
        self.kv_capacity_tokens = kv_capacity_tokens
        self.kv_free_tokens = kv_free_tokens
        self.running = running
        self.running_tokens = running_tokens
        self.waiting_prefill_tokens = waiting_prefill_tokens
        self.prefill_tps = prefill_tps
        self.decode_tps = decode_tps
        self.draining = draining
        self.standby = standby
        self.tokenizer = tokenizer


@dataclass(init=False, unsafe_hash=True)
class Candidate:
    """A node that serves the routed version, as this node last heard from it (immutable, as
    VersionLoad)."""

    node: Final[str]
    load: Final[VersionLoad]
    cached_tokens: Final[int]  # of this prompt, by the node's prefix summary
    age_s: Final[float]  # how old the view is
    local: Final[bool]
    sticky: Final[bool]  # served this conversation's last turn
    home_rank: Final[int | None]  # this node's place in the prompt's order of homes (`home_ranks`; 0: its home)
    home_share: Final[float]  # of the prompt's prefix traffic, this node's in the balanced home table (policy/homes.py)
    shared_tokens: Final[int | None]  # of this prompt, the part its prefix's requests share (`HomeTable.shared_blocks`;
    # None: not known): what every home is counted as holding, so only a chat's history tells its node apart

    def __init__(self, node: str, load: VersionLoad, cached_tokens: int, age_s: float, local: bool,
                 sticky: bool = False, home_rank: int | None = None, home_share: float = 0.0,
                 shared_tokens: int | None = None) -> None:
        self.node = node
        self.load = load
        self.cached_tokens = cached_tokens
        self.age_s = age_s
        self.local = local
        self.sticky = sticky
        self.home_rank = home_rank
        self.home_share = home_share
        self.shared_tokens = shared_tokens


def uncached(c: Candidate, prompt_tokens: int) -> int:
    return max(0, prompt_tokens - max(0, c.cached_tokens))


def estimated_ttft(c: Candidate, prompt_tokens: int, reserved_tokens: int, hop_s: float,
                   default_tps: float = FLOOR_TPS) -> float:
    """Seconds until `c` would start this prompt's first token. A node whose prefill rate is
    unknown (0) is taken to prefill at `default_tps`."""
    work = max(0, c.load.waiting_prefill_tokens) + max(0, reserved_tokens) + uncached(c, prompt_tokens)
    return work / prefill_rate(c, default_tps) + (0.0 if c.local else hop_s)


def prefill_rate(c: Candidate, default_tps: float) -> float:
    """The node's measured prefill rate, or `default_tps` while it has none (never zero)."""
    return c.load.prefill_tps if c.load.prefill_tps > 0 else max(default_tps, 1e-9)


def queued_prefill_s(cands: Sequence[Candidate]) -> float:
    """The nodes' mean queued prefill, in seconds of each node's own prefill rate; nodes whose
    rate is not measured yet are left out (a fresh cluster's first prompts over FLOOR_TPS read
    as 18 s of queue and bound the homes at every load for its first 10 s)."""
    known = [c for c in cands if c.load.prefill_tps > 0]
    return sum(max(0, c.load.waiting_prefill_tokens) / c.load.prefill_tps for c in known) / max(1, len(known))


def occupancy(load: VersionLoad) -> float:
    return max(0, load.running_tokens) / max(1, load.kv_capacity_tokens)


def _default_tps(cands: Sequence[Candidate], floor_tps: float) -> float:
    """A node not yet measured is assumed as fast as its peers' median, even under `floor_tps`
    (a slow reading, tiny prompts on a loaded box, must not make an unmeasured peer look faster),
    or `floor_tps` when none is measured."""
    known = sorted(c.load.prefill_tps for c in cands if c.load.prefill_tps > 0)
    if not known:
        return floor_tps
    i = len(known) // 2  # statistics.median's own arithmetic, without its overhead (a hot path)
    return known[i] if len(known) % 2 else (known[i - 1] + known[i]) / 2


def place(cands: Sequence[Candidate], prompt_tokens: int, expected_output: int,
          reservations: Reservations, rng: random.Random, near_best: float = NEAR_BEST, *,
          gamma: float = GAMMA, hop_s: float = HOP_S, sticky_slack: float = STICKY_SLACK,
          floor_tps: float = FLOOR_TPS, affinity_slack: float = AFFINITY_SLACK,
          saturated_slack: float = SATURATED_AFFINITY_SLACK) -> Candidate | None:
    """The node to run this request on, or None when no candidate can ever hold it. The choice's
    uncached prompt tokens are reserved on it (`reservations`). A node without KV room now waits
    for its running sequences to make it (`room_wait_s`, added to its TTFT); past capacity
    (`saturated`: no node has room, or every node has a full prefill of this prompt queued ahead)
    every node that can hold it competes, and a cache holder keeps it up to `saturated_slack`
    instead of `affinity_slack`: it queues where its prefix is (a miss there is a full prefill
    every later request waits behind).

    While balanced homes bind (`home_share` given; `[cluster] homes_bind`), the candidates narrow
    to the prompt's homes unless far slower (`_at_homes`), and a prompt no node caches half of goes
    to a balanced home within the slack. On a prefix split over several homes, a later turn goes
    to the home holding the most of it past the prefix's shared part (its history: `_history`)
    unless far slower, and a new chat to one of them by share and load (`_split`). Past capacity
    (queues, not only KV, full), one without balanced homes goes to its first home (`home_rank`)
    within the same slack (every ingress orders a prefix's homes alike); below capacity the score
    places it: homes dealt by hashing are uneven, and an uneven queue costs more TTFT than a copy
    costs hits."""
    reserved = {c.node: reservations.of(c.node) for c in cands}
    need = max(0, expected_output)  # fits: KV for it at all
    fitting: list[Candidate] = []
    unc: list[int] = []
    for c in cands:
        u = uncached(c, prompt_tokens)
        if not (c.load.draining or c.load.standby) and c.load.kv_capacity_tokens >= u + need:
            fitting.append(c)
            unc.append(u)
    if not fitting:
        return None
    default = _default_tps(fitting, floor_tps)
    ttft = {c.node: estimated_ttft(c, prompt_tokens, reserved[c.node], hop_s, default) for c in fitting}
    if any(c.home_share > 0 for c in fitting):  # the ingress gives shares only while homes bind
        fitting, unc = _at_homes(fitting, unc, ttft, prompt_tokens, default, saturated_slack)
        if len(fitting) > 1 and all(c.home_share > 0 and not c.sticky for c in fitting):  # homes kept
            chat = _history(fitting, ttft, default, affinity_slack)  # a later turn: where its history is
            if chat:
                return _reserve(reservations, _best(chat, ttft, gamma, near_best, rng), prompt_tokens)
            return _split(fitting, ttft, default, reservations, rng, prompt_tokens)  # a new chat
    queued = saturated(fitting, prompt_tokens, reserved)
    ok, full = _with_room(fitting, unc, need, reserved, ttft, queued)
    best_ttft = min(ttft[c.node] for c in ok)
    slack = max(affinity_slack, saturated_slack) if full else affinity_slack
    sticky = [c for c in ok if c.sticky and ttft[c.node] <= best_ttft * (1 + sticky_slack) + STICKY_FLOOR_S]
    holders = [] if sticky else _cache_holders(ok, ttft, prompt_tokens, best_ttft, slack, default)
    homes = sorted((c for c in ok if queued and c.home_rank is not None and ttft[c.node] <= best_ttft * (1 + slack)),
                   key=lambda c: c.home_rank or 0)
    balanced = [c for c in ok if c.home_share > 0 and ttft[c.node] <= best_ttft * (1 + slack)]
    if sticky or (not holders and not balanced and homes):
        choice = (sticky or homes)[0]
    else:
        choice = _best(holders or balanced or ok, ttft, gamma, near_best, rng)
    return _reserve(reservations, choice, prompt_tokens)


def _with_room(fitting: list[Candidate], unc: list[int], need: int, reserved: dict[str, int],
               ttft: dict[str, float], queued: bool) -> tuple[list[Candidate], bool]:
    """The candidates, and whether the cluster is full (`queued`, or no node has KV room now).
    Below that, a node without room competes with its wait for it added to `ttft` (room_wait_s),
    unless nothing running there can make it."""
    waits = {c.node: room_wait_s(c.load.running, c.load.running_tokens, c.load.decode_tps,
                                 u + need - (c.load.kv_free_tokens - reserved[c.node]), need)
             for c, u in zip(fitting, unc, strict=True)}
    if queued or all(w > 0.0 for w in waits.values()):
        return fitting, True
    ok = [c for c in fitting if waits[c.node] < math.inf]
    for c in ok:
        ttft[c.node] += waits[c.node]
    return ok, False


def _best(pool: Sequence[Candidate], ttft: dict[str, float], gamma: float, near_best: float,
          rng: random.Random) -> Candidate:
    """The pick by score (TTFT weighted by occupancy): uniform among those within `near_best`
    of the best, at most NEAR_BEST_MAX_S apart."""
    score = {c.node: ttft[c.node] * (1 + gamma * occupancy(c.load)) for c in pool}
    best = min(score.values())
    band = min(best * near_best, NEAR_BEST_MAX_S)
    return draws.choice(rng, [c for c in pool if score[c.node] <= best + band])


def _reserve(reservations: Reservations, choice: Candidate, prompt_tokens: int) -> Candidate:
    reservations.add(choice.node, uncached(choice, prompt_tokens))
    return choice


def home_credit(cands: Sequence[Candidate]) -> int:
    """The tokens of this prompt every home of its prefix is counted as holding: its shared
    part (`shared_tokens`, the system prompt) as far as the best candidate holds it; all that
    the best holds when the shared part is not known. A home gets the prefix with its first
    request and its share keeps it there (`_split`); beyond it, only a chat's own history."""
    most = max((c.cached_tokens for c in cands), default=0)
    known = [c.shared_tokens for c in cands if c.shared_tokens is not None]
    return min(most, *known) if known else most


def home_tokens(cands: Sequence[Candidate]) -> dict[str, int]:
    """The tokens of this prompt each candidate is counted as holding while homes bind: what its
    prefix summary says, and at least `home_credit`. A candidate over the credit holds this
    request's longer prefix: the history of its chat."""
    credit = home_credit(cands)
    return {c.node: max(c.cached_tokens, credit) for c in cands}


def _history(cands: Sequence[Candidate], ttft: dict[str, float], default_tps: float,
             slack: float) -> list[Candidate]:
    """The nodes holding the most of this prompt past its prefix's shared part (a later turn:
    its history is cached there), when their TTFT is within `slack` of the best TTFT counted as
    if every candidate held what `home_tokens` credits it with, plus STICKY_FLOOR_S. Empty for a
    new chat (nobody holds more than the shared part) or when they are far slower.

    Why: with a hot prefix split over several homes, each home was counted as caching as much
    as the best and a later turn went to a home by share; only 5-8 of 12 second turns entering
    3 nodes in turn ran where their history was, the rest prefilled it again (issue M)."""
    credit = home_credit(cands)
    most = max(c.cached_tokens for c in cands)
    if most <= credit:
        return []
    as_if = {c.node: ttft[c.node] - (max(c.cached_tokens, credit) - c.cached_tokens) / prefill_rate(c, default_tps)
             for c in cands}
    top = min(as_if.values())
    return [c for c in cands if c.cached_tokens >= most and ttft[c.node] <= top * (1 + slack) + STICKY_FLOOR_S]


def _at_homes(fitting: list[Candidate], unc: list[int], ttft: dict[str, float], prompt_tokens: int,
              default_tps: float, slack: float) -> tuple[list[Candidate], list[int]]:
    """The candidates narrowed to the prompt's balanced homes (`home_share`), while homes bind: a
    repeated prefix kept on its homes is held once in the cluster. A home is left only when it
    is far slower than the best node: its TTFT over `slack` times the best's plus HOME_PREFILLS
    full prefills of this prompt there. A miss elsewhere costs one full prefill and evicts
    another prefix there, a cost later requests pay too, so a home is kept through a queue
    (in one run with 4 prefills, at 70 % with one hot prefix, its homes queued 1.65x the mean).
    A chat that began on a node that is no home (its home was far slower then) comes home at its
    next turn: kept there, every such chat would hold a second copy of its system prompt on a node
    whose KV holds the homes of other prefixes."""
    best = min(ttft.values())

    def near(c: Candidate) -> bool:
        return ttft[c.node] <= best * (1 + slack) + HOME_PREFILLS * prompt_tokens / prefill_rate(c, default_tps)

    kept = [(c, u) for c, u in zip(fitting, unc, strict=True) if c.home_share > 0 and near(c)]
    if not kept:
        return fitting, unc
    return [c for c, _ in kept], [u for _, u in kept]


def _split(homes: list[Candidate], ttft: dict[str, float], default_tps: float, reservations: Reservations,
           rng: random.Random, prompt_tokens: int) -> Candidate:
    """A new chat on a prefix split over several homes (`home_share`: more traffic than one
    node's bound). Each home is taken to hold the prefix as well as the best of them does
    (`home_tokens`: the first request a home gets copies it there, and its share keeps it), and
    the homes whose TTFT so counted is within NEAR_BEST_MAX_S of the best are picked from by
    their shares. The cache holder's slack kept a hot prompt on its first home, its second
    never holding it: 162 of its 162 requests in one 70 % run, where that home's share was 83 %
    (bench (a15))."""
    held = home_tokens(homes)
    as_if = {c.node: ttft[c.node] - (held[c.node] - c.cached_tokens) / prefill_rate(c, default_tps) for c in homes}
    top = min(as_if.values())
    near = [c for c in homes if as_if[c.node] <= top + NEAR_BEST_MAX_S]
    choice = rng.choices(near, weights=[c.home_share for c in near])[0]
    return _reserve(reservations, choice, prompt_tokens)


def saturated(cands: Sequence[Candidate], prompt_tokens: int, reserved: dict[str, int]) -> bool:
    """Every node has at least a full prefill of this prompt queued ahead of it: no node would
    start it sooner than the prefill its cache saves, so none is idle enough to spend it on."""
    def queued(c: Candidate) -> bool:
        ahead = max(0, c.load.waiting_prefill_tokens) + max(0, reserved.get(c.node, 0))
        return ahead >= prompt_tokens > 0  # both over the same node's rate: compared in tokens

    return bool(cands) and all(map(queued, cands))


def _cache_holders(ok: Sequence[Candidate], ttft: dict[str, float], prompt_tokens: int, best_ttft: float,
                   slack: float, default_tps: float) -> list[Candidate]:
    """The nodes caching (nearly) the most of this prompt, when that is at least AFFINITY_MIN_MATCH of
    it, whose TTFT is within `slack` of the best plus HOLDER_PREFILLS full prefills of it there: the
    pick is made among them (empty: among all).

    Why not the score alone: minimising each request's own TTFT is myopic under deep queues.
    A cached prefix saves its prefill (a few hundred ms) while queues differ by seconds, so
    the score scatters prompts off their caches; every miss then adds prefill work, queues
    grow, and the hit rate collapses towards round robin's. Like SGLang's router, stay with
    the cache unless the load is clearly unbalanced; several holders of a hot prefix still
    share its traffic by score. When the nodes holding the most are all too slow (a chat's node,
    holding its history, is busy), the nodes holding at least AFFINITY_MIN_MATCH of it (its
    system prompt) come next: sending it to a node without them would copy the prompt there and
    evict another one, a miss now and misses later. The added prefill: that copy costs as much at
    light load, where `slack` times a few ms would copy a popular prompt onto every node."""
    if slack <= 0 or prompt_tokens <= 0:
        return []
    most = max(c.cached_tokens for c in ok)
    if most < AFFINITY_MIN_MATCH * prompt_tokens:
        return []
    for floor in (most * 0.9, AFFINITY_MIN_MATCH * prompt_tokens):
        near = [c for c in ok if c.cached_tokens >= floor and ttft[c.node] <= best_ttft * (1 + slack)
                + HOLDER_PREFILLS * prompt_tokens / prefill_rate(c, default_tps)]
        if near:
            return near
    return []


def round_robin(cands: Sequence[Candidate], counter: int) -> Candidate | None:
    """The floor a balancer that knows only readiness sets: the ready nodes in turn, by name."""
    ready = sorted((c for c in cands if not (c.load.draining or c.load.standby)), key=lambda c: c.node)
    return ready[counter % len(ready)] if ready else None


class RoutingPolicy(ABC):
    """Where the ingress sends a request among the nodes serving its version."""

    def __init__(self, reservations: Reservations, rng: random.Random) -> None:
        self.reservations = reservations
        self.rng = rng

    @abstractmethod
    def choose(self, cands: Sequence[Candidate], prompt_tokens: int, expected_output: int) -> Candidate | None:
        """The node for this request, or None when none can take it now."""


class ScoreRouting(RoutingPolicy):
    """Lowest estimated TTFT weighted by occupancy, with reservations, a near-best pick and
    session affinity (`place`)."""

    def __init__(self, reservations: Reservations, rng: random.Random, near_best: float = NEAR_BEST,
                 gamma: float = GAMMA, hop_s: float = HOP_S, sticky_slack: float = STICKY_SLACK) -> None:
        super().__init__(reservations, rng)
        self.near_best = near_best
        self.gamma = gamma
        self.hop_s = hop_s
        self.sticky_slack = sticky_slack

    def choose(self, cands: Sequence[Candidate], prompt_tokens: int, expected_output: int) -> Candidate | None:
        return place(cands, prompt_tokens, expected_output, self.reservations, self.rng, self.near_best,
                     gamma=self.gamma, hop_s=self.hop_s, sticky_slack=self.sticky_slack)


class RoundRobinRouting(RoutingPolicy):
    """`round_robin` with its own counter (the bench's baseline)."""

    def __init__(self, reservations: Reservations, rng: random.Random) -> None:
        super().__init__(reservations, rng)
        self.counter = 0

    def choose(self, cands: Sequence[Candidate], prompt_tokens: int, expected_output: int) -> Candidate | None:
        choice = round_robin(cands, self.counter)
        self.counter += 1
        return choice


POLICIES: dict[str, type[RoutingPolicy]] = {"score": ScoreRouting, "round_robin": RoundRobinRouting}
