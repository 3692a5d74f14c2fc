"""What an engine's KV cache tells a listener, shaped like vLLM's KV-cache events.

vLLM publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` (vllm/distributed/kv_events.py)
so a router can know what each engine's prefix cache holds. The fake engine emits the same
records, so the cluster's prefix summary is built the same way from either. Block hashes here
are the engine's own 64-bit ints (vLLM's with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`); a
consumer that must agree with other nodes re-hashes `token_ids` with its own key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence became cached: `token_ids` holds
    `len(block_hashes) * block_size` tokens; `parent_block_hash` is the block before the first
    (None: they start the sequence)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These blocks were evicted: a prefix through any of them is no longer cached."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache is gone (the engine stopped or died)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
# Called with one step's events, in order, on the engine's loop; it must not block.
KvListener = Callable[[Sequence[KvEvent]], None]
