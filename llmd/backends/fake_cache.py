"""The fake engine's KV cache: fixed-size blocks with vLLM's automatic prefix caching.

Routing by prefix is measured on fake engines (real ones sharing two cores would measure
contention), so the double's cache behaves like vLLM's where that matters to a router:
- KV lives in `num_blocks` blocks of `block_tokens` tokens; a full block is named by a hash
  chained over the whole prefix up to it, so a block is reused only under the same prefix;
- a new prompt reuses the longest chain of cached blocks (never its last token, which must be
  computed to sample from), and only the rest is prefilled;
- blocks are reference-counted while sequences run; a finished sequence's full blocks (prompt
  and output) stay cached, unreferenced, and are evicted least recently used first when a new
  block needs room (a sequence's tail before its head, as vLLM frees them);
- every store and eviction is reported as vLLM's KV events (`llmd.backends.kv_events`).
A sequence that does not fit waits, unless nothing else runs (then it overcommits, so one
request larger than the cache still runs, as a real engine would preempt others for it).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvListener

log = logging.getLogger(__name__)


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The engine's name for a full block: its tokens under its parent's name."""
    h = hashlib.blake2b(digest_size=8, person=b"llmd-fake-kv")
    if parent is not None:  # a first block hashes its tokens alone (shorter input: no ambiguity)
        h.update(parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


@dataclass(eq=False)
class CacheSeq:
    """One running sequence's KV: the cached blocks it references, then `private` blocks of
    its own (the partial last one; every block when prefix caching is off)."""

    tokens: list[int]
    cached: int  # prompt tokens found in the cache when it was admitted
    hashes: list[int] = field(default_factory=list)
    private: int = 0


class FakePrefixCache:
    """A block pool with prefix caching; the engine loop calls it, nothing else does."""

    def __init__(self, num_blocks: int, block_tokens: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.caching = caching
        self.queries = 0  # prompt tokens looked up, and found, since `take_stats` (vLLM's counters)
        self.hits = 0
        self._cached: dict[int, int] = {}  # block hash -> sequences referencing it
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recent first
        self._private = 0  # blocks held outside the cache
        self._private_tokens = 0
        self._events: list[KvEvent] = []

    # -- what the engine reports -------------------------------------------------------
    @property
    def occupied(self) -> int:
        """Blocks holding KV: referenced or cached for reuse."""
        return len(self._cached) + self._private

    def usage(self) -> float:
        """The share of the cache's tokens that running sequences hold (vLLM's kv_cache_usage,
        by token): evictable cached blocks count as free."""
        held = (len(self._cached) - len(self._free)) * self.block_tokens + self._private_tokens
        return held / (self.num_blocks * self.block_tokens)

    def cached_blocks(self) -> int:
        return len(self._cached)

    def take_stats(self) -> tuple[int, int]:
        q, h, self.queries, self.hits = self.queries, self.hits, 0, 0
        return q, h

    def flush(self, listener: KvListener | None) -> list[KvEvent]:
        """Hand what happened since the last flush to `listener` (once per engine step)."""
        events, self._events = self._events, []
        if events and listener is not None:
            try:
                listener(events)
            except Exception:  # a listener's bug must not look like an engine crash
                log.exception("kv_events listener failed")
        return events

    # -- sequences ----------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> list[int]:
        """The longest cached chain under `tokens`, leaving at least its last token to compute."""
        if not self.caching:
            return []
        b, hits, parent = self.block_tokens, [], None
        for i in range((len(tokens) - 1) // b):
            h = block_hash(parent, tokens[i * b:(i + 1) * b])
            if h not in self._cached:
                break
            hits.append(h)
            parent = h
        return hits

    def admit(self, tokens: Sequence[int], force: bool = False) -> CacheSeq | None:
        """Room for a prompt: its cached prefix referenced, blocks for the rest taken (evicting
        unreferenced ones). None: it does not fit now (`force`: take them anyway)."""
        hits = self.match(tokens)
        need = math.ceil(len(tokens) / self.block_tokens) - len(hits)
        evictable = len(self._free) - sum(1 for h in hits if h in self._free)
        if not force and need > self.num_blocks - self.occupied + evictable:
            return None
        for h in hits:
            self._ref(h)
        cached = len(hits) * self.block_tokens
        self.queries += len(tokens)
        self.hits += cached
        seq = CacheSeq(tokens=list(tokens), cached=cached, hashes=hits)
        self._take(seq, need)
        self._private_tokens += len(tokens) - cached
        return seq

    def append(self, seq: CacheSeq, token: int) -> None:
        """A generated token joins the sequence (a new block when the last one is full), then
        the blocks it completes are cached."""
        seq.tokens.append(token)
        self._private_tokens += 1
        n, b = len(seq.tokens), self.block_tokens
        if n > (len(seq.hashes) + seq.private) * b:
            self._take(seq, 1)
        if n >= (len(seq.hashes) + 1) * b:  # a block is full: `commit` (else it would find nothing to do)
            self.commit(seq, n)

    def commit(self, seq: CacheSeq, computed: int) -> None:
        """The first `computed` tokens have KV now: their full blocks join the cache. A block
        another sequence cached meanwhile is shared instead (this copy is released)."""
        if not self.caching:
            return
        b = self.block_tokens
        start = len(seq.hashes)  # where the run of newly stored blocks begins
        while (len(seq.hashes) + 1) * b <= computed:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = block_hash(parent, seq.tokens[i * b:(i + 1) * b])
            seq.private -= 1
            self._private -= 1
            self._private_tokens -= b
            if h in self._cached:
                self._ref(h)
                self._stored(seq, start, i)
                start = i + 1
            else:
                self._cached[h] = 1
            seq.hashes.append(h)
        self._stored(seq, start, len(seq.hashes))

    def free(self, seq: CacheSeq) -> None:
        """The sequence ended: its cached blocks stay, unreferenced (tail first to be evicted);
        its own are released. Idempotent."""
        for h in reversed(seq.hashes):
            self._cached[h] -= 1
            if self._cached[h] == 0:
                self._free[h] = None
        self._private -= seq.private
        self._private_tokens -= len(seq.tokens) - len(seq.hashes) * self.block_tokens
        seq.hashes, seq.private, seq.tokens = [], 0, []

    def clear(self) -> None:
        """The engine is gone: so is everything it cached (running sequences must be freed first)."""
        had = bool(self._cached)
        self._cached.clear()
        self._free.clear()
        self._private = self._private_tokens = 0
        if had:
            self._events.append(AllBlocksCleared())

    # -- internals --------------------------------------------------------------------------
    def _ref(self, h: int) -> None:
        if self._cached[h] == 0:
            del self._free[h]
        self._cached[h] += 1

    def _take(self, seq: CacheSeq, n: int) -> None:
        """`n` blocks for `seq`, evicting the least recently used unreferenced ones for room."""
        evicted: list[int] = []
        for _ in range(n):
            if self.occupied >= self.num_blocks and self._free:
                h, _none = self._free.popitem(last=False)
                del self._cached[h]
                evicted.append(h)
            self._private += 1
            seq.private += 1
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))

    def _stored(self, seq: CacheSeq, start: int, end: int) -> None:
        """Blocks start..end of `seq` were just cached: one event, as vLLM sends per sequence."""
        if end > start:
            b = self.block_tokens
            self._events.append(BlockStored(tuple(seq.hashes[start:end]), seq.hashes[start - 1] if start else None,
                                            tuple(seq.tokens[start * b:end * b]), b))
