"""KvChains: an engine's KV-cache events (vLLM's shape) become the cluster's chained hashes.

The hasher here is a reference implementation of docs/cluster.md's `chain_hashes` contract
(one 64-bit hash per full block, each covering the whole prefix); the events are records with
vLLM's class names and fields, as vLLM's own and the fake engine's are."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmd.backends.kv_chains import KvChains

BT = 64  # the cluster's block_tokens


def chain(tokens: Sequence[int], block_tokens: int = BT, key: bytes = b"k") -> list[int]:
    out, h = [], key
    for i in range(len(tokens) // block_tokens):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[i * block_tokens:(i + 1) * block_tokens])
        h = hashlib.blake2b(h + block, digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list[int]


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class Seen:
    calls: list[tuple[str, list[int]]] = field(default_factory=list)

    def __call__(self, kind: str, hashes: list[int]) -> None:
        self.calls.append((kind, hashes))


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def make(capacity: int = 1000) -> tuple[KvChains, Seen]:
    seen = Seen()
    return KvChains(chain, BT, seen, capacity_blocks=capacity), seen


def test_stored_blocks_give_the_prefix_chain_hashes() -> None:
    kv, seen = make()
    prompt = toks(384 + 128)
    kv([BlockStored([11, 12, 13], None, prompt[:384], 128)])
    assert seen.calls == [("stored", chain(prompt)[:6])]
    # a later block names its parent only: the adapter rebuilds the prefix to hash it
    kv([BlockStored([14], 13, prompt[384:], 128)])
    assert seen.calls[-1] == ("stored", chain(prompt)[6:8])
    assert kv.held == 8 and kv.stats.stored == 4


def test_removed_engine_block_maps_back_to_its_cluster_hashes() -> None:
    kv, seen = make()
    prompt = toks(256)
    kv([BlockStored([1, 2], None, prompt, 128)])
    kv([BlockRemoved([2]), BlockRemoved([2, 99])])  # twice and unknown: reported once, ignored
    assert seen.calls[1:] == [("removed", chain(prompt)[2:4])]
    assert kv.held == 2


def test_a_cluster_block_shared_by_two_engine_blocks_stays_until_both_go() -> None:
    kv, seen = make()
    a, b = toks(128), toks(64) + toks(64, start=5000)  # same first 64 tokens, different second half
    kv([BlockStored([1], None, a, 128), BlockStored([2], None, b, 128)])
    kv([BlockRemoved([1])])
    assert seen.calls[-1] == ("removed", [chain(a)[1]])
    kv([BlockRemoved([2])])
    assert seen.calls[-1] == ("removed", chain(b))  # the shared first block only now


def test_cluster_blocks_larger_than_the_engines() -> None:
    kv, seen = make()  # vLLM on a GPU: 16-token blocks, the cluster's 64
    prompt = toks(160)
    kv([BlockStored([1, 2, 3], None, prompt[:48], 16)])
    assert seen.calls == []  # no cluster block is complete yet
    kv([BlockStored([4, 5, 6, 7, 8], 3, prompt[48:128], 16)])
    assert seen.calls == [("stored", chain(prompt)[:2])]
    kv([BlockRemoved([8])])
    assert seen.calls[-1] == ("removed", [chain(prompt)[1]])
    kv([BlockRemoved([5])])  # inside a cluster block but not its end: nothing to report
    assert len(seen.calls) == 2


def test_restored_block_is_reported_again_and_a_removed_parent_still_hashes_children() -> None:
    kv, seen = make()
    prompt = toks(384)
    kv([BlockStored([1, 2], None, prompt[:256], 128), BlockRemoved([1])])
    kv([BlockStored([3], 2, prompt[256:], 128)])  # its grandparent was evicted: still known
    assert seen.calls[-1] == ("stored", chain(prompt)[4:6])
    kv([BlockStored([1], None, prompt[:128], 128)])
    assert seen.calls[-1] == ("stored", chain(prompt)[:2]) and kv.held == 6


def test_what_cannot_be_named_by_tokens_is_skipped() -> None:
    kv, seen = make()
    kv([BlockStored([5], 404, toks(128), 128),  # parent never seen (subscribed late)
        BlockStored([6], None, toks(128), 128, lora_name="adapter"),
        BlockStored([7], None, toks(128), 128, extra_keys=[("salt",)]),
        BlockStored([8], None, toks(128), 128, medium="CPU"),
        BlockStored([9], None, toks(128), 128, group_idx=1),
        BlockStored([10], None, toks(128), 128, extra_keys=[None])])  # no extra keys: fine
    assert seen.calls == [("stored", chain(toks(128)))]
    assert dict(kv.stats.skipped) == {"unknown_parent": 1, "extra_keys": 2, "medium": 1, "group": 1}
    kv([BlockStored([11], 6, toks(128), 128)])  # a child of a skipped block cannot be named either
    assert kv.stats.skipped["unknown_parent"] == 2


def test_cleared_forgets_everything() -> None:
    kv, seen = make()
    kv([BlockStored([1], None, toks(128), 128), AllBlocksCleared()])
    assert seen.calls[-1] == ("cleared", []) and kv.held == 0
    kv([BlockStored([2], 1, toks(128), 128)])
    assert kv.stats.skipped["unknown_parent"] == 1


def test_bounded_removed_blocks_go_first_then_live_ones_are_reported_removed() -> None:
    kv, seen = make(capacity=3)
    kv([BlockStored([1], None, toks(128, 1), 128), BlockStored([2], None, toks(128, 2), 128), BlockRemoved([1])])
    kv([BlockStored([3], None, toks(128, 3), 128), BlockStored([4], None, toks(128, 4), 128)])
    assert kv.held == 6 and ("removed", chain(toks(128, 2))) not in seen.calls  # the removed 1 made room
    kv([BlockStored([5], None, toks(128, 5), 128)])
    # the oldest live one is forgotten, and said so
    assert seen.calls[-2:] == [("removed", chain(toks(128, 2))), ("stored", chain(toks(128, 5)))]
    assert kv.held == 6
