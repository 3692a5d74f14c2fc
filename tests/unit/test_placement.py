"""The cluster's routing score (llmd/policy/placement.py): which node starts a request soonest,
with reservations against stale views, a near-best random pick, session affinity, and the
round-robin peer the bench compares it with. A fake clock throughout."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from llmd.policy.placement import (
    POLICIES,
    Candidate,
    RoundRobinRouting,
    ScoreRouting,
    VersionLoad,
    estimated_ttft,
    place,
    round_robin,
    saturated,
)
from llmd.policy.rendezvous import conversation_node, home_key, home_ranks
from llmd.policy.reservations import Reservations


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def load(**kw: float | int | bool) -> VersionLoad:
    base = VersionLoad(model="m", version="ab" * 32, kv_capacity_tokens=100_000, kv_free_tokens=100_000,
                       running=0, running_tokens=0, waiting_prefill_tokens=0, prefill_tps=10_000.0,
                       decode_tps=500.0)
    return replace(base, **kw)  # type: ignore[arg-type]


def cand(node: str, cached: int = 0, local: bool = False, sticky: bool = False, home: int | None = None,
         **kw: float | int | bool) -> Candidate:
    return Candidate(node=node, load=load(**kw), cached_tokens=cached, age_s=0.1, local=local, sticky=sticky,
                     home_rank=home)


@pytest.fixture
def res() -> Reservations:
    return Reservations(Clock(), ttl_s=2.0)


def picks(cands: list[Candidate], n: int, prompt: int = 1000, out: int = 100, seed: int = 1,
          ttl_s: float = 2.0) -> Counter[str]:
    """Where `n` placements go, each with fresh reservations (no burst), varying the seed."""
    got: Counter[str] = Counter()
    for i in range(n):
        c = place(cands, prompt, out, Reservations(Clock(), ttl_s), random.Random(seed + i))
        got[c.node if c else "-"] += 1
    return got


def test_ttft_counts_waiting_reserved_uncached_and_hop() -> None:
    c = cand("a", cached=300, waiting_prefill_tokens=2000, prefill_tps=1000.0)
    assert estimated_ttft(c, 1300, 500, hop_s=0.005) == pytest.approx((2000 + 500 + 1000) / 1000 + 0.005)
    local = replace(c, local=True)
    assert estimated_ttft(local, 1300, 500, hop_s=0.005) == pytest.approx(3.5)
    unknown = cand("b", prefill_tps=0.0)
    assert estimated_ttft(unknown, 1000, 0, 0.0, default_tps=100.0) == pytest.approx(10.0)


def test_prefix_holder_wins_at_equal_load() -> None:
    cands = [cand("a"), cand("b", cached=900), cand("c")]
    assert picks(cands, 50) == {"b": 50}


def test_loaded_node_loses_to_empty_one_despite_cache() -> None:
    cands = [cand("busy", cached=900, waiting_prefill_tokens=20_000), cand("idle")]
    assert picks(cands, 50) == {"idle": 50}
    # occupancy by running sequences counts too: the same TTFT, but a full KV cache
    cands = [cand("full", running_tokens=90_000, kv_free_tokens=10_000), cand("empty")]
    assert picks(cands, 50) == {"empty": 50}


def test_local_node_preferred_over_an_equal_peer_by_the_hop() -> None:
    cands = [cand("peer"), cand("me", local=True)]
    assert picks(cands, 30, prompt=10) == {"me": 30}


@pytest.mark.parametrize("bad", [{"kv_free_tokens": 50}, {"draining": True}, {"standby": True}])
def test_kv_full_draining_and_standby_are_excluded(bad: dict[str, int | bool]) -> None:
    cands = [cand("best", cached=1000, **bad), cand("other")]
    assert picks(cands, 20) == {"other": 20}
    alone = place([cands[0]], 1000, 100, Reservations(Clock(), 2.0), random.Random(0))
    # a full cache is a queue, not a refusal, when no node has room; draining/standby never take work
    assert (alone is cands[0]) if "kv_free_tokens" in bad else alone is None


def test_past_capacity_a_request_queues_on_its_cache_holder_not_nowhere() -> None:
    """Every node's KV cache full of running sequences: the request still gets a node (the one
    holding its prefix) and waits in that node's queue; None only for what no cache can ever hold."""
    full = [cand("a", kv_free_tokens=0, waiting_prefill_tokens=9000), cand("b", kv_free_tokens=0, cached=900,
                                                                           waiting_prefill_tokens=10_000)]
    assert picks(full, 20) == {"b": 20}
    tiny = [cand("a", kv_capacity_tokens=500, kv_free_tokens=500)]
    assert place(tiny, 1000, 100, Reservations(Clock(), 2.0), random.Random(0)) is None


def test_kv_room_counts_only_uncached_tokens_and_reservations() -> None:
    c = cand("a", cached=900, kv_free_tokens=250)  # 100 uncached + 100 output fits in 250
    r = Reservations(Clock(), ttl_s=2.0)
    assert place([c], 1000, 100, r, random.Random(0)) is c
    assert r.of("a") == 100  # its uncached prompt tokens are reserved on it
    roomy = cand("b", kv_free_tokens=5000)
    assert place([c, roomy], 1000, 100, r, random.Random(0)) is roomy  # 250 - 100 reserved < 200 on a


def test_reservations_spread_a_burst(res: Reservations) -> None:
    """100 placements with no gossip in between: what was sent counts as queued there."""
    cands = [cand("a", cached=500), cand("b"), cand("c")]
    rng = random.Random(7)
    got = Counter(c.node for c in (place(cands, 1000, 100, res, rng) for _ in range(100)) if c)
    assert sum(got.values()) == 100
    assert set(got) == {"a", "b", "c"}
    # the holder of half the prompt keeps it up to 2x the best TTFT, 3x once what was sent fills
    # every node's queue (saturated): about three quarters, not all
    assert max(got.values()) <= 80, got
    assert got["a"] > got["b"] and got["a"] > got["c"]  # the cache still counts


def test_reservations_expire_by_ttl() -> None:
    clock = Clock()
    r = Reservations(clock, ttl_s=2.0)
    r.add("a", 100)
    clock.t += 1.0
    r.add("a", 50)
    assert r.of("a") == 150
    clock.t += 1.5
    assert r.of("a") == 50
    clock.t += 1.0
    assert r.of("a") == 0


def test_reservations_end_when_a_newer_state_arrives() -> None:
    r = Reservations(Clock(), ttl_s=60.0)
    r.add("a", 100)  # nothing seen from a yet
    r.seen("a", 5)
    assert r.of("a") == 0
    r.add("a", 70)  # made after state 5
    r.add("b", 30)
    r.seen("a", 5)  # the same state again (a heartbeat): it cannot include the request
    assert r.of("a") == 70
    r.seen("a", 6)
    assert r.of("a") == 0
    assert r.of("b") == 30  # another node's state says nothing of b
    r.forget("b")
    assert r.of("b") == 0


def test_near_best_picks_at_random_among_near_ties() -> None:
    # a and b within 10 % of each other; c 50 % worse
    cands = [cand("a", waiting_prefill_tokens=1000), cand("b", waiting_prefill_tokens=1150),
             cand("c", waiting_prefill_tokens=2000)]
    got = picks(cands, 200)
    assert set(got) == {"a", "b"}
    assert min(got.values()) > 60, got
    strict = Counter(c.node for c in (place(cands, 1000, 100, Reservations(Clock(), 2.0), random.Random(i),
                                            near_best=0.0) for i in range(50)) if c)
    assert strict == {"a": 50}


def test_unknown_rate_node_is_not_shunned() -> None:
    """A node that has not prefilled yet is assumed as fast as its peers, not the floor."""
    cands = [cand("known", waiting_prefill_tokens=5000), cand("fresh", prefill_tps=0.0)]
    assert picks(cands, 20) == {"fresh": 20}


def test_an_unmeasured_node_is_never_taken_as_faster_than_a_slow_measured_one() -> None:
    """The only measured node reads slow (tiny prompts on a loaded box: 40 tok/s, under the
    floor): a fresh peer is assumed as slow, so the conversation stays where its turns ran."""
    cands = [cand("mine", sticky=True, prefill_tps=40.0), cand("fresh", prefill_tps=0.0)]
    assert picks(cands, 30, prompt=20) == {"mine": 30}


def test_sticky_node_keeps_the_conversation_unless_clearly_slower() -> None:
    slightly = [cand("best"), cand("mine", sticky=True, waiting_prefill_tokens=400)]  # TTFT 1.4x the best
    assert picks(slightly, 30) == {"mine": 30}
    much = [cand("best"), cand("mine", sticky=True, waiting_prefill_tokens=800)]  # 1.8x (1.5x + 20 ms: 0.18 s)
    assert picks(much, 30) == {"best": 30}
    edge = [cand("best"), cand("mine", sticky=True, waiting_prefill_tokens=600)]  # 1.6x: 0.165 s, within it
    assert picks(edge, 30) == {"mine": 30}
    full = [cand("best"), cand("mine", sticky=True, kv_free_tokens=10)]
    assert picks(full, 10) == {"best": 10}


def test_round_robin_cycles_over_ready_nodes_ignoring_load() -> None:
    cands = [cand("c"), cand("a", waiting_prefill_tokens=10**6), cand("b", cached=1000), cand("d", draining=True)]
    assert [round_robin(cands, i).node for i in range(6)] == ["a", "b", "c", "a", "b", "c"]  # type: ignore[union-attr]
    assert round_robin([cand("x", standby=True)], 0) is None


def test_policies_table_swaps_routing() -> None:
    assert set(POLICIES) == {"score", "round_robin"}
    cands = [cand("a"), cand("b", cached=900)]
    rr = POLICIES["round_robin"](Reservations(Clock(), 2.0), random.Random(0))
    assert isinstance(rr, RoundRobinRouting)
    assert [rr.choose(cands, 1000, 10).node for _ in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]
    score = POLICIES["score"](Reservations(Clock(), 2.0), random.Random(0))
    assert isinstance(score, ScoreRouting)
    assert score.choose(cands, 1000, 10).node == "b"  # type: ignore[union-attr]
    assert score.reservations.of("b") == 100


def test_a_reservation_is_released_once_its_request_has_had_its_prefill(res: Reservations) -> None:
    res.add("a", 500)
    res.add("a", 300)
    res.release("a", 500)
    assert res.of("a") == 300
    res.release("a", 999)  # nothing reserved that size: nothing changes
    assert res.of("a") == 300
    res.release("b", 300)
    assert res.of("a") == 300


def test_a_conversation_is_not_moved_off_its_node_by_a_few_ms_of_stale_queue() -> None:
    """Light load, short prompts: TTFTs of a few ms. The sticky node's latest state still counts
    the conversation's last turn (60 tokens) as waiting, though it has run since (gossip lags)."""
    mine = cand("mine", sticky=True, waiting_prefill_tokens=60, prefill_tps=5000.0)
    other = cand("other", prefill_tps=5000.0)
    assert picks([mine, other], 20, prompt=20, out=2) == {"mine": 20}  # 21 ms against 9 ms (hop included)
    busy = replace(mine, load=replace(mine.load, waiting_prefill_tokens=200))  # 49 ms: over 1.5x + 20 ms
    assert picks([busy, other], 20, prompt=20, out=2) == {"other": 20}


def test_cache_holder_keeps_its_prompts_unless_clearly_slower() -> None:
    """Some node has less than this prompt's prefill queued (not saturated): the node caching most
    of the prompt keeps it up to 2x the best TTFT plus one full prefill of the prompt (the score
    alone would move it for a small difference and lose the cache)."""
    near = [cand("idle-ish", waiting_prefill_tokens=500), cand("holder", cached=900, waiting_prefill_tokens=1_100)]
    assert picks(near, 30) == {"holder": 30}  # TTFT 0.12 s vs 0.15 s at the idle-ish node
    far = [cand("idle-ish", waiting_prefill_tokens=500), cand("holder", cached=900, waiting_prefill_tokens=4_000)]
    assert picks(far, 30) == {"idle-ish": 30}  # 0.41 s vs 0.15 s: over 2x plus a 0.1 s prefill
    light = [cand("idle", waiting_prefill_tokens=0), cand("holder", cached=900, waiting_prefill_tokens=2_500)]
    assert picks(light, 30) == {"holder": 30}  # 0.27 s vs 0.1 s: at light load 2x alone would copy the prompt
    two = [cand("idle-ish", waiting_prefill_tokens=500), cand("h1", cached=900, waiting_prefill_tokens=1_100),
           cand("h2", cached=900, waiting_prefill_tokens=1_110)]
    assert set(picks(two, 60)) == {"h1", "h2"}  # several holders of a hot prefix share it (near-best)
    small = [cand("idle-ish", waiting_prefill_tokens=500), cand("holder", cached=400, waiting_prefill_tokens=1_300)]
    assert picks(small, 30) == {"idle-ish": 30}  # under half the prompt cached: the score decides


def test_past_capacity_a_cache_holder_keeps_its_prompts_up_to_3x() -> None:
    """Every node has at least this prompt's full prefill queued (saturated): a miss is a full
    prefill added to a queue everyone waits behind, so the holder keeps the prompt up to 3x the
    best TTFT (2x otherwise: 2.1 s vs 5.0 s would move it); beyond that it still spills."""
    cands = [cand("idle-ish", waiting_prefill_tokens=20_000), cand("holder", cached=900, waiting_prefill_tokens=50_000)]
    assert picks(cands, 30) == {"holder": 30}  # 5.0 s vs 2.1 s
    far = [cand("idle-ish", waiting_prefill_tokens=20_000), cand("holder", cached=900, waiting_prefill_tokens=70_000)]
    assert picks(far, 30) == {"idle-ish": 30}  # 7 s vs 2.1 s: over 3x
    # one node with less than a prompt queued: not saturated, the 2x rule holds (the hot-prefix guard)
    one_free = [cand("idle-ish", waiting_prefill_tokens=900), cand("holder", cached=900, waiting_prefill_tokens=50_000),
                cand("busy", waiting_prefill_tokens=20_000)]
    assert picks(one_free, 30) == {"idle-ish": 30}
    # reservations count as queued: a burst just sent to the idle node saturates the cluster
    r = Reservations(Clock(), ttl_s=2.0)
    r.add("idle-ish", 19_100)
    got = place(one_free, 1000, 100, r, random.Random(0))
    assert got is not None and got.node == "holder"


def test_a_busy_chat_node_hands_the_turn_to_a_system_prompt_holder_not_to_anyone() -> None:
    """The chat's node holds the whole history (most) but is over its slack: the nodes
    holding its system prompt (over half the prompt) come next; a node with none of it would copy
    the system prompt there, evicting another."""
    cands = [cand("chat", cached=950, waiting_prefill_tokens=5_000),
             cand("system", cached=700, waiting_prefill_tokens=1_500), cand("empty", waiting_prefill_tokens=500)]
    assert picks(cands, 30) == {"system": 30}  # 0.18 s vs 0.15 s at the empty node; the chat node 0.51 s
    cands[1] = cand("system", cached=700, waiting_prefill_tokens=4_000)  # 0.43 s: over 2x + a prefill too
    assert picks(cands, 30) == {"empty": 30}


def test_past_capacity_a_holder_without_kv_room_still_keeps_its_prompt() -> None:
    """Saturated: a holder whose KV cache is full of running sequences queues the request (room
    comes back as they finish) rather than another node with room taking it off its cache; not
    saturated, the node with room now gets it."""
    cands = [cand("roomy", waiting_prefill_tokens=20_000), cand("holder", cached=900, kv_free_tokens=0,
                                                               waiting_prefill_tokens=25_000)]
    assert picks(cands, 30) == {"holder": 30}
    light = [cand("roomy", waiting_prefill_tokens=0), cand("holder", cached=900, kv_free_tokens=0)]
    assert picks(light, 30) == {"roomy": 30}


def test_below_capacity_a_holder_without_kv_room_keeps_its_prompt_when_room_comes_soon() -> None:
    """Its running sequences end within a fraction of the full prefill a node with room would run:
    it waits for them, on its cache (bench (s): SGLang's router queues it there too). Where room
    comes only after more than the prefill saves, or nothing running can make it, the node with
    room takes it."""
    soon = [cand("roomy"), cand("holder", cached=900, kv_free_tokens=0, running=4, running_tokens=4000,
                                 decode_tps=4000.0)]  # one of 4 sequences ends: 100 tokens at 4000/s
    assert picks(soon, 30) == {"holder": 30}  # 0.015 s + 0.025 s of wait against a 0.105 s miss
    late = [cand("roomy"), cand("holder", cached=900, kv_free_tokens=0, running=4, running_tokens=4000,
                                 decode_tps=200.0)]  # 0.5 s of wait
    assert picks(late, 30) == {"roomy": 30}
    never = [cand("roomy"), cand("holder", cached=900, kv_free_tokens=0, running=1, running_tokens=100,
                                  decode_tps=4000.0)]  # all it runs frees 100 of the 200 tokens it needs
    assert picks(never, 30) == {"roomy": 30}


def test_room_wait_counts_the_sequences_that_must_end() -> None:
    from llmd.policy.room import room_wait_s

    busy = (4, 4000, 1000.0)  # running sequences, their tokens, the decode rate
    assert room_wait_s(*busy, 0, 100) == 0.0 and room_wait_s(*busy, -5, 100) == 0.0
    assert room_wait_s(*busy, 1000, 100) == pytest.approx(0.1)  # one mean sequence ends
    assert room_wait_s(*busy, 1001, 100) == pytest.approx(0.2)  # two must
    assert room_wait_s(*busy, 4001, 100) == float("inf")
    assert room_wait_s(4, 4000, 0.0, 10, 100) == float("inf")


def test_saturated_needs_every_node_a_prompt_behind() -> None:
    cands = [cand("a", waiting_prefill_tokens=1000), cand("b", waiting_prefill_tokens=400)]
    assert not saturated(cands, 1000, {})
    assert saturated(cands, 1000, {"b": 600})
    assert not saturated([], 1000, {}) and not saturated(cands, 0, {})


def test_near_best_band_is_capped_in_seconds_under_deep_queues() -> None:
    # 10 % of a 5 s TTFT is 0.5 s, more than a cached prefix saves: only 50 ms counts as a tie
    cands = [cand("a", waiting_prefill_tokens=49_000), cand("b", waiting_prefill_tokens=52_000)]
    assert picks(cands, 40) == {"a": 40}


def test_home_ranks_agree_whoever_asks_and_a_leaving_node_moves_only_its_own_prefixes() -> None:
    nodes = ["n0", "n1", "n2", "n3"]
    for key in range(200):
        ranks = home_ranks(key, nodes)
        assert sorted(ranks.values()) == [0, 1, 2, 3]
        assert home_ranks(key, reversed(nodes)) == ranks  # every ingress, whatever order it lists peers in
        gone = max(ranks, key=lambda n: ranks[n])  # the last choice leaves: the order of the rest holds
        assert home_ranks(key, [n for n in nodes if n != gone]) == {n: r for n, r in ranks.items() if n != gone}
    homes = Counter(min(home_ranks(key, nodes).items(), key=lambda kv: kv[1])[0] for key in range(4000))
    assert min(homes.values()) > 800  # spread over the nodes (1000 each on average)
    assert home_key([]) is None and home_key([5, 6]) == 6 and home_key(list(range(20))) == 7  # 8 blocks


def test_past_capacity_a_prompt_no_node_caches_goes_to_its_home_not_to_the_least_loaded() -> None:
    """Saturated, and no node holds half of the prompt (it is new, or every copy was evicted): the
    least loaded node would copy its prefix onto whichever node was freest at the time, so a
    prompt's chats end up on every node, each caching it beside the others' prompts, and the
    copies evict one another (bench (a) at 130 % load, traced: 0.45 hit rate against 0.70 for one
    node with the three's cache). Its home keeps it within the saturated slack (3x); a slow home
    spills to the prompt's second home, the same for every ingress; a cache holder comes first.
    Below capacity the score places it (homes dealt by hashing are uneven)."""
    cands = [cand("least", waiting_prefill_tokens=20_000, home=2), cand("home", waiting_prefill_tokens=50_000, home=0),
             cand("second", waiting_prefill_tokens=30_000, home=1)]
    assert picks(cands, 30) == {"home": 30}  # 5.1 s vs 2.1 s at the least loaded: within 3x
    cands[1] = cand("home", waiting_prefill_tokens=70_000, home=0)  # 7.1 s: over 3x the best
    assert picks(cands, 30) == {"second": 30}  # 3.1 s
    holder = [*cands, cand("holder", cached=900, waiting_prefill_tokens=50_000, home=3)]
    assert picks(holder, 30) == {"holder": 30}
    light = [cand("idle", waiting_prefill_tokens=0, home=1), cand("home", waiting_prefill_tokens=800, home=0)]
    assert picks(light, 30) == {"idle": 30}
    # KV full everywhere but the queues short (bench (a)'s 70 %: three long prompts fill a node's
    # KV): not past capacity, so no homes, or the uneven ones would queue one node deep
    kv_full = [cand("idle", waiting_prefill_tokens=0, kv_free_tokens=0, home=1),
               cand("home", waiting_prefill_tokens=800, kv_free_tokens=0, home=0)]
    assert picks(kv_full, 30) == {"idle": 30}


def test_every_ingress_names_the_same_node_for_a_conversation_and_a_leaving_node_moves_only_its_own() -> None:
    nodes = ["n0", "n1", "n2"]
    keys = [f"chat-{i}" for i in range(300)]
    first = {k: conversation_node(k, nodes) for k in keys}
    assert first == {k: conversation_node(k, reversed(nodes)) for k in keys}  # whoever asks, in any order
    spread = Counter(first.values())
    assert set(spread) == set(nodes) and min(spread.values()) >= 70, spread  # about a third each
    after = {k: conversation_node(k, ["n0", "n2"]) for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != "n1")
    assert conversation_node("chat-1", []) is None
