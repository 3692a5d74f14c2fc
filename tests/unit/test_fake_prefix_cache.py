"""The fake engine's prefix cache: blocks, reuse of the longest cached prefix, LRU eviction of
unreferenced blocks only, prefill charged for uncached tokens only, vLLM-style KV events."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from llmd.backends.base import Delta, Sampling
from llmd.backends.fake import FakeBackend
from llmd.backends.fake_cache import FakePrefixCache, block_hash
from llmd.backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.config import FakeEngineConfig

TOK = TiktokenTokenizer.simple()
B = 16


def make(**cfg: float | bool) -> FakeBackend:
    conf = FakeEngineConfig(**{"step_ms": 0.0, "step_ms_per_seq": 0.0, "block_tokens": B, **cfg})
    return FakeBackend("fake-model", "v1", 1024, conf, TOK)


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


async def run(b: FakeBackend, rid: str, prompt: list[int], max_tokens: int = 8) -> list[Delta]:
    return [d async for d in b.generate(rid, b.render_completion(prompt), Sampling(max_tokens=max_tokens))]


def output_ids(ds: Sequence[Delta]) -> list[int]:
    return [t for d in ds for t in d.token_ids]


async def test_a_repeated_prompt_reuses_its_cached_blocks_and_reports_them_once() -> None:
    b = make()
    await b.start()
    try:
        first = await run(b, "a", ids(40))
        assert [d.cached_prompt_tokens for d in first] == [0] * len(first)
        again = await run(b, "b", ids(40))
        # 40 tokens: two full blocks are reused (the third holds the last token, always computed).
        assert again[0].cached_prompt_tokens == 2 * B and all(d.cached_prompt_tokens == 0 for d in again[1:])
        assert output_ids(again) == output_ids(first)  # the cache changes cost, never text
        assert (b.stats.prefix_queries, b.stats.prefix_hits) == (80, 2 * B)
    finally:
        await b.stop()


async def test_a_finished_requests_output_blocks_stay_cached() -> None:
    b = make()
    await b.start()
    try:
        out = await run(b, "a", ids(40), max_tokens=24)  # 64 tokens in all: four full blocks
        resumed = await run(b, "r", ids(40) + output_ids(out), max_tokens=4)
        assert resumed[0].cached_prompt_tokens == 3 * B  # 48 > the 40 prompt tokens: output was kept
    finally:
        await b.stop()


async def test_a_shared_beginning_is_reused_up_to_the_first_difference() -> None:
    b = make()
    await b.start()
    try:
        await run(b, "a", ids(2 * B) + ids(30, start=5000))
        part = await run(b, "b", ids(2 * B) + ids(30, start=7000))
        assert part[0].cached_prompt_tokens == 2 * B
        changed = ids(2 * B) + ids(30, start=5000)
        changed[3] = 9999  # an early token differs: every later block is another block
        assert (await run(b, "c", changed))[0].cached_prompt_tokens == 0
    finally:
        await b.stop()


async def test_prefix_caching_off_reuses_nothing() -> None:
    b = make(prefix_caching=False)
    events: list[KvEvent] = []
    b.kv_events = events.extend
    await b.start()
    try:
        await run(b, "a", ids(40))
        assert (await run(b, "b", ids(40)))[0].cached_prompt_tokens == 0
        assert events == [] and b.cache.cached_blocks() == 0
    finally:
        await b.stop()


async def test_prefill_is_charged_for_uncached_tokens_only() -> None:
    # No step time at all: what the cost model charges is the prefill alone, tokens / rate.
    b = make(prefill_tokens_per_s=1000.0, prefill_tokens_per_step=32)
    await b.start()
    try:
        await run(b, "a", ids(100))
        assert b.busy_s == pytest.approx(100 / 1000)
        assert sum(r.prefill_tokens for r in b.stats.history) == 100
        steps = len(b.stats.history)
        second = await run(b, "b", ids(100))
        cached = second[0].cached_prompt_tokens
        assert cached == 6 * B
        assert b.busy_s == pytest.approx((100 + 100 - cached) / 1000)
        assert [r.prefill_tokens for r in list(b.stats.history)[steps:] if r.prefill_tokens] == [100 - cached]
        assert b.step_seconds(3, 500) == pytest.approx(0.5)
    finally:
        await b.stop()


def test_eviction_takes_the_least_recently_used_unreferenced_blocks_only() -> None:
    c = FakePrefixCache(num_blocks=6, block_tokens=4)
    running = c.admit(ids(8, start=1))  # two blocks, still referenced
    assert running is not None
    c.commit(running, 8)
    old = c.admit(ids(8, start=50))
    assert old is not None
    c.commit(old, 8)
    c.free(old)  # cached, unreferenced
    recent = c.admit(ids(8, start=80))
    assert recent is not None
    c.commit(recent, 8)
    c.free(recent)
    assert c.occupied == 6 and c.usage() == pytest.approx(8 / 24)
    c.flush(None)
    newer = c.admit(ids(8, start=200))  # needs two blocks: `old`'s go, tail first
    assert newer is not None
    removed = c.flush(None)
    o0 = block_hash(None, ids(4, start=50))
    assert removed == [BlockRemoved((block_hash(o0, ids(4, start=54)), o0))]
    assert len(c.match([*ids(8, start=1), 0])) == 2  # the running sequence's blocks were not touched
    assert len(c.match([*ids(8, start=80), 0])) == 2
    # Every block is referenced now but `recent`'s two: a sequence needing three must wait...
    assert c.admit(ids(12, start=300)) is None
    assert len(c.match([*ids(8, start=80), 0])) == 2  # ...and a refused one evicts nothing
    # ...unless nothing else runs, when it takes them anyway (overcommitting, as one huge request does).
    c.free(running)
    c.free(newer)
    assert c.admit(ids(40, start=400), force=True) is not None and c.occupied > c.num_blocks


async def test_a_request_waits_for_kv_room_while_others_run() -> None:
    b = make(kv_blocks=4, step_ms=1.0)  # 64 tokens of KV
    await b.start()
    try:
        big = asyncio.create_task(run(b, "big", ids(40), max_tokens=20))  # 60 tokens: nearly all of it
        while not b.stats.steps:
            await asyncio.sleep(0.001)
        small = await run(b, "small", ids(30, start=3000), max_tokens=2)
        assert (await big)[-1].finish_reason == "length" and small[-1].finish_reason == "length"
        hist = list(b.stats.history)
        assert max(r.running for r in hist) == 1 and any(r.waiting == 1 for r in hist)
        assert max(r.kv_usage for r in hist) == pytest.approx(59 / 64)  # its last step but one
    finally:
        await b.stop()


async def test_kv_events_describe_what_was_stored_removed_and_cleared() -> None:
    b = make(kv_blocks=4)
    events: list[KvEvent] = []
    b.kv_events = events.extend
    await b.start()
    try:
        out = await run(b, "a", ids(40), max_tokens=8)  # 48 tokens: three full blocks
        stored = [e for e in events if isinstance(e, BlockStored)]
        chain: list[int] = []
        tokens: list[int] = []
        for e in stored:
            assert e.block_size == B and len(e.token_ids) == B * len(e.block_hashes)
            assert e.parent_block_hash == (chain[-1] if chain else None)
            chain += e.block_hashes
            tokens += e.token_ids
        assert tokens == ids(40) + output_ids(out)
        parent = None
        for i, h in enumerate(chain):  # each block's hash covers the prefix up to it
            parent = block_hash(parent, tokens[i * B:(i + 1) * B])
            assert h == parent
        events.clear()
        await run(b, "b", ids(50, start=4000), max_tokens=2)  # needs 4 blocks: evicts the 3 cached
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert sorted(removed) == sorted(chain)
        events.clear()
    finally:
        await b.stop()
    assert events == [AllBlocksCleared()]


async def test_a_failing_listener_does_not_kill_the_engine() -> None:
    b = make()

    def bad(_: Sequence[KvEvent]) -> None:
        raise RuntimeError("listener bug")

    b.kv_events = bad
    await b.start()
    try:
        assert (await run(b, "a", ids(40)))[-1].finish_reason == "length"
        assert b.healthy
    finally:
        await b.stop()


async def test_sleep_mode_discards_the_cache_as_vllms_does() -> None:
    b = make(sleep_mode=True)
    events: list[KvEvent] = []
    b.kv_events = events.extend
    await b.start()
    try:
        await run(b, "a", ids(40))
        assert await b.sleep() and events[-1] == AllBlocksCleared() and b.cache.cached_blocks() == 0
        await b.wake_up()
        assert (await run(b, "b", ids(40)))[0].cached_prompt_tokens == 0
    finally:
        await b.stop()
