"""The hit rate a single shared prefix cache would get: the same prompts, in the order they
ran, through one LRU of blocks as large as all the nodes' caches together. No router can beat
it; issue J asks for >= 90 % of it."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any


def _chain(ids: list[int], block: int) -> list[bytes]:
    out, h = [], b""
    for i in range(0, len(ids) - len(ids) % block, block):
        h = hashlib.blake2b(h + repr(ids[i:i + block]).encode(), digest_size=8).digest()
        out.append(h)
    return out


def shared_cache_hit_rate(prompts: Iterable[list[int]], capacity_blocks: int, block: int = 16) -> float:
    """Cached prompt tokens over prompt tokens, for one LRU cache of `capacity_blocks`."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    hit = total = 0
    for ids in prompts:
        total += len(ids)
        blocks = _chain(ids, block)
        n = 0
        for h in blocks:
            if h not in lru:
                break
            n += 1
        hit += n * block
        for h in blocks:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def prompt_ids(bodies: Iterable[dict[str, Any]]) -> list[list[int]]:
    """Each chat body's prompt as the fake engine's tokenizer renders and counts it."""
    from llmd.backends.tokenizer import TiktokenTokenizer

    tok = TiktokenTokenizer.simple()
    return [tok.encode(tok.render_chat(b["messages"])) for b in bodies]
