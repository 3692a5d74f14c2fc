"""Prefix summaries: chained keyed hashes, the LRU-bounded index, bounded deltas and snapshots
a peer keeps in step with (gaps detected), correction from the engine's count, and the summary
kept from a fake engine's KV events."""

from __future__ import annotations

import pytest

from llmd.backends.base import Sampling
from llmd.backends.fake import FakeBackend
from llmd.backends.kv_chains import KvChains
from llmd.backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.cluster.prefixes import (
    BATCH_MAX,
    HASH_BYTES,
    MIN_DELTA_BYTES,
    PeerPrefixes,
    PrefixIndex,
    chain_hashes,
    feeder,
    prefix_key,
)
from llmd.config import FakeEngineConfig

KEY = prefix_key(b"cluster secret")
BT = 64


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def index(capacity: int = 1000, **kw: int) -> PrefixIndex:
    return PrefixIndex(capacity, BT, KEY, epoch=7, **kw)


def test_hashes_chain_over_the_whole_prefix() -> None:
    a = chain_hashes(ids(300), BT, KEY)
    assert len(a) == 4  # full blocks only: 300 tokens -> 4 blocks of 64
    assert chain_hashes([*ids(256), 1, 2, 3], BT, KEY) == a  # same prefix, same hashes
    assert all(0 <= h < 2 ** 64 for h in a) and len(set(a)) == 4
    early = ids(300)
    early[5] = 1
    assert set(chain_hashes(early, BT, KEY)).isdisjoint(a)  # an early change renames every later block
    late = ids(300)
    late[200] = 1
    assert chain_hashes(late, BT, KEY)[:3] == a[:3] and chain_hashes(late, BT, KEY)[3] != a[3]
    assert chain_hashes(ids(300), BT, prefix_key(b"another cluster")) != a  # keyed
    # The same tokens in another position are another block (no block is named by its tokens alone).
    assert chain_hashes(ids(64, start=164), BT, KEY)[0] != a[1]


def test_cached_tokens_is_the_longest_held_prefix() -> None:
    ix = index()
    h = ix.hashes(ids(300))
    ix.add(h[:2])
    assert ix.cached_tokens(h) == 2 * BT
    ix.add([h[3]])
    assert ix.cached_tokens(h) == 2 * BT  # a hole ends the prefix
    assert ix.cached_tokens(ix.hashes(ids(300, start=9))) == 0


def test_the_index_is_bounded_and_evicts_least_recently_used_tails_first() -> None:
    ix = index(capacity=6)
    a, b, c = ix.hashes(ids(256)), ix.hashes(ids(256, start=5000)), ix.hashes(ids(256, start=9000))
    ix.add(a)
    ix.add(b[:2])
    ix.add(c[:2])  # two more than it holds: two of a's go, its tail first
    assert len(ix) == 6 and ix.cached_tokens(a) == 2 * BT and ix.cached_tokens(b) == 2 * BT
    ix.add(a[:2])  # touched: a's head is the most recent now
    ix.add(c[2:])  # so b's go
    assert len(ix) == 6
    assert (ix.cached_tokens(a), ix.cached_tokens(b), ix.cached_tokens(c)) == (2 * BT, 0, 4 * BT)


def test_deltas_keep_a_peer_in_step() -> None:
    ix, peer = index(), PeerPrefixes(BT)
    a, b = ix.hashes(ids(640)), ix.hashes(ids(640, start=7000))
    ix.add(a)
    d1 = ix.delta(0, 1200)
    assert d1 is not None and peer.apply(d1) and peer.seq == ix.seq
    assert peer.cached_tokens(a) == 10 * BT
    ix.add(b)
    ix.remove(a[4:])
    d2 = ix.delta(peer.seq, 1200)
    assert d2 is not None and len(d2) == 20 + HASH_BYTES * (10 + 6)
    assert peer.apply(d2) and peer.seq == ix.seq
    assert (peer.cached_tokens(a), peer.cached_tokens(b)) == (4 * BT, 10 * BT)
    assert peer.apply(d2) and peer.apply(d1)  # repeats are harmless...
    assert (peer.cached_tokens(a), peer.cached_tokens(b)) == (4 * BT, 10 * BT)
    # ...and so is an overlap: a peer anywhere within a delta's range can take it.
    late = PeerPrefixes(BT)
    assert late.apply(d1)
    ix.add(ix.hashes(ids(128, start=9000)))
    both = ix.delta(0, 4000)
    assert both is not None and late.apply(d2) and late.apply(both)
    assert late.seq == ix.seq and late.cached_tokens(a) == 4 * BT and late.cached_tokens(b) == 10 * BT
    assert ix.delta(ix.seq, 1200) is not None  # nothing new: a header alone
    assert len(ix.delta(ix.seq, 1200) or b"") == 20


def test_a_gap_is_detected_and_a_snapshot_heals_it() -> None:
    ix, peer = index(), PeerPrefixes(BT)
    ix.add(ix.hashes(ids(640)))
    d1 = ix.delta(0, 1200)
    ix.add(ix.hashes(ids(640, start=7000)))
    d2 = ix.delta(ix.seq - 1, 1200)  # the push that carried the batches before it was lost
    assert d1 is not None and d2 is not None
    assert not peer.apply(d2) and peer.seq == 0 and len(peer) == 0  # a gap: nothing applied
    peer.load(ix.snapshot())
    assert peer.seq == ix.seq and len(peer) == len(ix) == 20
    assert peer.cached_tokens(ix.hashes(ids(640, start=7000))) == 640
    ix.remove(ix.hashes(ids(640)))
    d3 = ix.delta(peer.seq, 1200)
    assert d3 is not None and peer.apply(d3) and len(peer) == 10
    ix.add(ix.hashes(ids(128)))
    ix.add(ix.hashes(ids(128, start=3000)))
    d5 = ix.delta(ix.seq - 1, 1200)  # a peer in step, but one push lost: a gap again
    assert d5 is not None and not peer.apply(d5) and peer.seq == ix.seq - 2 and len(peer) == 10


def test_a_restarted_node_is_a_gap_too() -> None:
    before, peer = index(), PeerPrefixes(BT)
    before.add(before.hashes(ids(640)))
    assert peer.apply(before.delta(0, 1200) or b"")
    after = PrefixIndex(1000, BT, KEY, epoch=8)  # same node, new process: seq starts over
    after.add(after.hashes(ids(128)))
    assert not peer.apply(after.delta(0, 1200) or b"")
    peer.load(after.snapshot())
    assert len(peer) == 2 and peer.cached_tokens(after.hashes(ids(640))) == 2 * BT


def test_history_is_bounded_and_older_peers_need_a_snapshot() -> None:
    ix = index(capacity=1000, history_changes=64)
    for i in range(10):
        ix.add(ix.hashes(ids(640, start=i * 1000)))  # 10 hashes per batch
    assert ix.seq == 10
    assert ix.delta(0, 4000) is None  # too far back
    assert ix.delta(3, 4000) is None
    recent = ix.delta(ix.seq - 6, 4000)
    assert recent is not None and len(recent) == 20 + 60 * HASH_BYTES


def test_deltas_are_bounded_and_the_rest_waits_for_the_next_push() -> None:
    ix, peer = index(), PeerPrefixes(BT)
    hashes = ix.hashes(ids(64 * 200))  # 200 blocks in one call: batches of BATCH_MAX
    ix.add(hashes)
    assert ix.seq == -(-200 // BATCH_MAX)
    pushes = 0
    while peer.seq < ix.seq:
        d = ix.delta(peer.seq, 600)
        assert d is not None and len(d) <= 600
        assert peer.apply(d)
        pushes += 1
    assert pushes == 3 and peer.cached_tokens(hashes) == 200 * BT  # up to 72 hashes a push: 64, 64, 72
    with pytest.raises(ValueError, match="at least"):
        ix.delta(0, MIN_DELTA_BYTES - 1)  # could never carry a whole batch


def test_correct_drops_what_the_engine_did_not_have() -> None:
    ix = index()
    h = ix.hashes(ids(640))
    ix.add(h)
    ix.correct(h, engine_cached_tokens=3 * BT + 10)  # the engine had 3 blocks and a bit
    assert ix.cached_tokens(h) == 3 * BT and len(ix) == 3
    seq = ix.seq
    ix.correct(h, engine_cached_tokens=5 * BT)  # more than the index held: nothing to drop
    assert ix.seq == seq and len(ix) == 3


def test_malformed_summaries_are_refused() -> None:
    peer = PeerPrefixes(BT)
    good = index().delta(0, 1200) or b""
    for bad in (b"", good[:10], good + b"\0" * 3):
        with pytest.raises(ValueError, match=r"prefix (delta|summary)"):
            peer.apply(bad)
    with pytest.raises(ValueError, match="prefix summary"):
        peer.load(index().snapshot()[:-1] + b"\0\0")


async def test_a_summary_kept_from_fake_engine_events_routes_like_the_cache() -> None:
    conf = FakeEngineConfig(step_ms=0.0, step_ms_per_seq=0.0, block_tokens=16, kv_blocks=20)
    be = FakeBackend("m", "v1", 1024, conf, TiktokenTokenizer.simple())
    ix = index()
    be.kv_events = KvChains(lambda t: chain_hashes(t, BT, KEY), BT, feeder(ix))
    await be.start()
    try:
        prompt = ids(200)
        out = [d async for d in be.generate("a", be.render_completion(prompt), Sampling(max_tokens=4))]
        # 204 tokens in the engine: 12 engine blocks of 16 = 3 summary blocks of 64.
        full = prompt + [t for d in out for t in d.token_ids]
        assert ix.cached_tokens(ix.hashes(full)) == 3 * BT and len(ix) == 3
        peer = PeerPrefixes(BT)
        assert peer.apply(ix.delta(0, 1200) or b"")
        assert peer.cached_tokens(chain_hashes(prompt + [5] * 100, BT, KEY)) == 3 * BT
        # Another prompt needs 13 of the 20 engine blocks: eviction takes the first one's
        # blocks tail first, and the summary blocks they were part of go with them.
        other = ids(200, start=9000)
        _ = [d async for d in be.generate("b", be.render_completion(other), Sampling(max_tokens=1))]
        assert ix.cached_tokens(ix.hashes(full)) == 1 * BT
        assert ix.cached_tokens(ix.hashes(other)) == 3 * BT
        assert peer.apply(ix.delta(peer.seq, 1200) or b"") and peer.cached_tokens(ix.hashes(full)) == BT
    finally:
        await be.stop()
    assert len(ix) == 0  # the engine's cache is gone with it


def test_the_event_summary_follows_chains_it_saw_start_and_their_evictions() -> None:
    ix = index()
    feed = KvChains(lambda t: chain_hashes(t, BT, KEY), BT, feeder(ix))
    toks = ids(160)
    feed([BlockStored((1, 2, 3, 4, 5, 6), None, tuple(toks[:96]), 16)])  # one summary block and a half
    h = ix.hashes(toks)
    assert ix.cached_tokens(h) == BT and len(ix) == 1
    feed([BlockStored((7, 8), 6, tuple(toks[96:128]), 16)])  # the second completes
    assert ix.cached_tokens(h) == 2 * BT
    feed([BlockRemoved((8,))])  # the engine evicts from the tail: the block that completed it goes
    assert ix.cached_tokens(h) == BT and len(ix) == 1
    feed([BlockStored((10, 11, 12, 13), 99, tuple(ids(64, start=4000)), 16)])  # parent never seen: left out
    assert len(ix) == 1
    feed([AllBlocksCleared()])
    assert len(ix) == 0
