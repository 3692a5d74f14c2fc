"""A node's prefix summary kept from its engine's KV events (`llmd.backends.kv_events`).

The engine names its blocks with its own hashes, per engine block (16 tokens); the cluster
names them with keyed chained hashes per summary block (a multiple of that, 64 tokens), so
that every node computes the same name for the same prefix. This follows each stored chain:
for every engine block it remembers where the summary chain stands after it (the summary
hash so far and the tokens of the summary block being filled); when an engine block completes
a summary block, that summary hash joins the index. An evicted engine block takes the
summary block it belongs to with it (the prefix through it is no longer whole). A chain whose
parent was never seen (stored before this listener started) is skipped: an index that holds
less than the cache costs only affinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmd.backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from llmd.cluster.prefixes import PrefixIndex, next_hash


@dataclass(frozen=True)
class _After:
    """Where the summary chain stands after one engine block."""

    summary: int | None  # the last complete summary block's hash
    pending: tuple[int, ...]  # tokens since it (a summary block being filled)
    members: tuple[int, ...]  # the engine blocks holding `pending`


class EventSummary:
    """A KV-event listener (`backend.kv_events = EventSummary(index, key, 16)`) feeding `index`."""

    def __init__(self, index: PrefixIndex, key: bytes, engine_block_tokens: int) -> None:
        if index.block_tokens % engine_block_tokens:
            raise ValueError(f"the summary block ({index.block_tokens} tokens) must be a multiple of the "
                             f"engine's block ({engine_block_tokens} tokens)")
        self.index = index
        self.engine_block_tokens = engine_block_tokens
        self._key = key
        self._after: dict[int, _After] = {}  # engine block -> the chain after it, while it is cached
        self._group: dict[int, int] = {}  # engine block -> the summary block it is part of

    def __call__(self, events: Sequence[KvEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                self.index.remove([s for h in e.block_hashes if (s := self._forget(h)) is not None])
            elif isinstance(e, AllBlocksCleared):
                self._after.clear()
                self._group.clear()
                self.index.clear()

    def _stored(self, e: BlockStored) -> None:
        b = e.block_size
        if b != self.engine_block_tokens:
            raise ValueError(f"KV event with {b}-token blocks; this summary expects {self.engine_block_tokens}")
        at = _After(None, (), ()) if e.parent_block_hash is None else self._after.get(e.parent_block_hash)
        if at is None:
            return  # its chain began before we listened: unknown, so left out
        added: list[int] = []
        for i, h in enumerate(e.block_hashes):
            pending, members = at.pending + tuple(e.token_ids[i * b:(i + 1) * b]), (*at.members, h)
            if len(pending) == self.index.block_tokens:
                summary = next_hash(at.summary, pending, self._key)
                for m in members:
                    self._group[m] = summary
                added.append(summary)
                at = _After(summary, (), ())
            else:
                at = _After(at.summary, pending, members)
            self._after[h] = at
        self.index.add(added)

    def _forget(self, h: int) -> int | None:
        self._after.pop(h, None)
        return self._group.pop(h, None)
