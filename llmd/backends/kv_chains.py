"""An engine's KV-cache events turned into the cluster's own chained block hashes.

vLLM names a cached block by its own hash (seeded per process, block size 128 on CPU, 16 on
GPU); the cluster names a prefix by `chain_hashes(token_ids, block_tokens, key)`, the same on
every node. This adapter keeps, per engine block, its parent and its token ids, so a stored
block's whole prefix can be rebuilt and hashed the cluster's way, and a removed engine block
maps back to the cluster hashes it carried. It reads events by their class name and fields
(`BlockStored(block_hashes, parent_block_hash, token_ids, block_size)`, `BlockRemoved(
block_hashes)`, `AllBlocksCleared`), so vLLM's own records and the fake engine's alike feed it.
Pure: no vllm, no I/O, no clock; call it on one thread (the event loop).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ChainHasher = Callable[[Sequence[int]], list[int]]
# ("stored" | "removed" | "cleared", the cluster's chained hashes that changed; [] for "cleared")
ChainListener = Callable[[str, list[int]], None]


@dataclass
class _Block:
    parent: int | bytes | None  # the engine's hash of the block before it (None: starts the sequence)
    end: int  # tokens from the start of the sequence through this block
    tokens: tuple[int, ...]
    ours: tuple[int, ...]  # the cluster hashes of the cluster blocks that end inside this block
    live: bool = True


@dataclass
class ChainStats:
    """What the adapter did; `skipped` by reason (unknown_parent, extra_keys, medium, group)."""

    stored: int = 0  # engine blocks
    removed: int = 0
    cleared: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


class KvChains:
    """Engine events in, `listener(kind, cluster_hashes)` out; a `KvListener` itself.

    A cluster block counts as held while at least one live engine block carries it (with
    block_tokens 64 and vLLM's 128, two engine blocks that differ only in their second half
    share the first cluster hash). Removed engine blocks keep their tokens, up to
    `capacity_blocks` in all, so a later child of theirs can still be hashed.
    """

    def __init__(self, hasher: ChainHasher, block_tokens: int, listener: ChainListener,
                 capacity_blocks: int = 65536) -> None:
        self._hasher = hasher
        self._bt = block_tokens
        self._listener = listener
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int | bytes, _Block] = OrderedDict()
        self._held: Counter[int] = Counter()  # cluster hash -> live engine blocks carrying it
        self.stats = ChainStats()

    def __call__(self, events: Iterable[Any]) -> None:
        for e in events:
            kind = type(e).__name__
            if kind == "BlockStored":
                self._stored(e)
            elif kind == "BlockRemoved":
                self._removed(e.block_hashes)
            elif kind == "AllBlocksCleared":
                self.clear()

    def clear(self) -> None:
        """The engine's cache is empty (reset, restart, stop)."""
        self._blocks.clear()
        self._held.clear()
        self.stats.cleared += 1
        self._listener("cleared", [])

    def _skip(self, e: Any) -> str | None:
        if getattr(e, "medium", None) not in (None, "GPU"):  # an offload tier, not the engine's cache
            return "medium"
        if getattr(e, "group_idx", None) not in (None, 0):  # a second KV group (hybrid models)
            return "group"
        if getattr(e, "lora_name", None) or any(k for k in (getattr(e, "extra_keys", None) or ())):
            return "extra_keys"  # LoRA, salt or multimodal: the tokens alone do not name the block
        return None

    def _prefix(self, parent: int | bytes | None) -> list[int] | None:
        """The token ids before a block whose parent is `parent`; None if a link is unknown."""
        parts: list[tuple[int, ...]] = []
        while parent is not None:
            b = self._blocks.get(parent)
            if b is None:
                return None
            parts.append(b.tokens)
            parent = b.parent
        return [t for part in reversed(parts) for t in part]

    def _stored(self, e: Any) -> None:
        reason = self._skip(e)
        prefix = self._prefix(e.parent_block_hash) if reason is None else None
        if reason is None and prefix is None:
            reason = "unknown_parent"
        if prefix is None:
            self.stats.skipped[reason or "unknown_parent"] += len(e.block_hashes)
            return
        size = int(e.block_size)
        tokens = list(e.token_ids)
        hashes = self._hasher(prefix + tokens)
        parent, start = e.parent_block_hash, len(prefix)
        out: list[int] = []
        for i, h in enumerate(e.block_hashes):
            own = tuple(tokens[i * size:(i + 1) * size])
            end = start + len(own)
            ours = tuple(hashes[start // self._bt:end // self._bt])
            old = self._blocks.pop(h, None)
            if old is None or not old.live:
                self._held.update(ours)
            self._blocks[h] = _Block(parent, end, own, ours)
            out.extend(ours)
            self.stats.stored += 1
            parent, start = h, end
        self._prune()
        if out:
            self._listener("stored", out)

    def _removed(self, engine_hashes: Sequence[int | bytes]) -> None:
        out: list[int] = []
        for h in engine_hashes:
            b = self._blocks.get(h)
            if b is None or not b.live:
                continue
            b.live = False
            self.stats.removed += 1
            for ours in b.ours:
                self._held[ours] -= 1
                if self._held[ours] <= 0:
                    del self._held[ours]
                    out.append(ours)
        if out:
            self._listener("removed", out)

    def _prune(self) -> None:
        """Forget the oldest blocks past the bound, removed ones first (their tokens only serve
        to hash later children); a live one forgotten is reported removed."""
        excess = len(self._blocks) - self._capacity
        if excess <= 0:
            return
        dead = [h for h, b in self._blocks.items() if not b.live][:excess]
        for h in dead:
            del self._blocks[h]
        while len(self._blocks) > self._capacity:
            h, b = next(iter(self._blocks.items()))
            if b.live:
                self._removed([h])
            del self._blocks[h]

    @property
    def held(self) -> int:
        """Distinct cluster hashes the engine holds now."""
        return len(self._held)
