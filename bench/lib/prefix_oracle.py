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


def shared_cache_hit_rate(prompts: Iterable[list[int]], capacity_blocks: int, block: int = 16,
                          counted: Iterable[bool] | None = None) -> float:
    """Cached prompt tokens over prompt tokens, for one LRU cache of `capacity_blocks`; only the
    prompts `counted` says (the rest warm the cache up)."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    hit = total = 0
    flags = iter(counted) if counted is not None else None
    for ids in prompts:
        count = next(flags) if flags is not None else True
        blocks = _chain(ids, block)
        n = 0
        for h in blocks:
            if h not in lru:
                break
            n += 1
        if count:
            hit += n * block
            total += len(ids)
        for h in reversed(blocks):  # the head most recent: the tail is evicted first, as the engine does
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


class BlockLru:
    """One node's prefix cache as an LRU of chained blocks (no KV pinned by running sequences)."""

    def __init__(self, capacity_blocks: int, block: int = 16) -> None:
        self.capacity, self.block = capacity_blocks, block
        self.lru: OrderedDict[bytes, None] = OrderedDict()

    def serve(self, ids: list[int]) -> int:
        """Run one prompt: its tokens found cached (the longest chain), then it is cached."""
        blocks = _chain(ids, self.block)
        n = 0
        for h in blocks:
            if h not in self.lru:
                break
            n += 1
        for h in reversed(blocks):  # tail first to be evicted, as the engine frees them
            self.lru[h] = None
            self.lru.move_to_end(h)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
        return n * self.block


def chat_trace(wl: Any, sessions_per_s: float, seconds: float, seed: int = 1, think_s: float = 3.0,
               turn_s: float = 0.5, answer_words: int = 40) -> list[tuple[float, int, list[int]]]:
    """The bench's chats as (time, system prompt, prompt ids), in time order, without nodes:
    Poisson sessions, each turn `think_s` + `turn_s` after the last, answers of random words."""
    import random

    from bench.lib.cluster import words

    rng = random.Random(seed)
    out: list[tuple[float, int, dict[str, Any]]] = []
    t = 0.0
    while t < seconds:
        chat = wl.new_chat()
        for k in range(chat.turns):
            out.append((t + k * (think_s + turn_s), chat.system, wl.next_turn(chat)))
            wl.answered(chat, words(rng, answer_words))
        t += rng.expovariate(sessions_per_s)
    out.sort(key=lambda x: x[0])
    ids = prompt_ids(b for _, _, b in out)
    return [(t, s, i) for (t, s, _), i in zip(out, ids, strict=True)]


def routed_hit_rates(trace: list[tuple[float, int, list[int]]], kv_blocks: int, nodes: int = 3,
                     warm_s: float = 0.0, seed: int = 1) -> dict[str, float]:
    """Hit rates of the same prompts through `nodes` LRUs of `kv_blocks` each: `round_robin`
    (each request to a random node), `affinity` (each system prompt owned by one node, owners
    dealt by popularity: what a prefix router can reach), and `single` (one LRU of all)."""
    import random

    rng = random.Random(seed)
    seen: dict[int, int] = {}
    for _, s, _ in trace:
        seen[s] = seen.get(s, 0) + 1
    owner = {s: k % nodes for k, s in enumerate(sorted(seen, key=lambda s: -seen[s]))}
    caches = {name: [BlockLru(kv_blocks) for _ in range(nodes)] for name in ("round_robin", "affinity")}
    single = BlockLru(kv_blocks * nodes)
    hit = dict.fromkeys(("round_robin", "affinity", "single"), 0)
    total = 0
    for t, s, ids in trace:
        got = {"round_robin": caches["round_robin"][rng.randrange(nodes)].serve(ids),
               "affinity": caches["affinity"][owner[s]].serve(ids), "single": single.serve(ids)}
        if t >= warm_s:
            total += len(ids)
            for k, v in got.items():
                hit[k] += v
    return {k: v / total if total else 0.0 for k, v in hit.items()}
