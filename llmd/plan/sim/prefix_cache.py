"""A simulated replica's prefix cache: one LRU of token counts, never the tokens themselves.

It holds each shared-prefix group a request started with (key: the group, >= 0) and the full
blocks of a request cut short by a preemption (key: -2 - its trace index), which its resume
finds, as vLLM keeps a freed sequence's blocks cached by hash and the fake backend does too.
"""

from __future__ import annotations

from collections import OrderedDict

from llmd.plan.sim.request import Req


class PrefixLRU:
    def __init__(self, capacity_tokens: int, block_size: int, enabled: bool = True) -> None:
        self.capacity = capacity_tokens
        self.block_size = block_size
        self.enabled = enabled
        self.entries: OrderedDict[int, int] = OrderedDict()  # key -> tokens, least recently used first
        self.tokens = 0
        self.hit_tokens = 0  # a counter, for the report

    def hit(self, r: Req, plen: int) -> int:
        """Prompt tokens of `r` (a prompt of `plen`, resumed ones included) found cached: its
        group's, or its own earlier attempt's; never the last one, which must be computed."""
        if not self.enabled:
            return 0
        own = self.entries.pop(-2 - r.i, 0)
        self.tokens -= own
        group = self.entries.get(r.prefix) if r.prefix >= 0 else None
        if group is not None:
            self.entries.move_to_end(r.prefix)
            own = max(own, min(group, r.prefix_tokens))
        hit = max(0, min(own, plen - 1))
        self.hit_tokens += hit
        return hit

    def keep_own(self, r: Req, tokens: int) -> None:
        """`r` was cut short with `tokens` in its KV: its full blocks stay for its resume."""
        blocks = tokens // self.block_size * self.block_size
        if not self.enabled or blocks <= 0:
            return
        self.tokens += blocks - self.entries.pop(-2 - r.i, 0)
        self.entries[-2 - r.i] = blocks
        self._evict()

    def remember(self, r: Req) -> None:
        """`r`'s shared prefix was computed here: its group's full blocks are cached from now on
        (an engine caches whole blocks: a 96-token prefix is 6 blocks of 16, and none of 128)."""
        blocks = r.prefix_tokens // self.block_size * self.block_size
        if not self.enabled or r.prefix < 0 or blocks <= 0 or r.prefix in self.entries:
            return
        self.entries[r.prefix] = blocks
        self.tokens += blocks
        self._evict()

    def holds(self, prefix: int) -> bool:
        return prefix in self.entries

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0

    def _evict(self) -> None:
        while self.tokens > self.capacity and self.entries:
            self.tokens -= self.entries.popitem(last=False)[1]
