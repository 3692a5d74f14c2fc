"""vLLM's KV-cache events on the CPU engine: they arrive in this process (over ipc, or over a
published TCP port that other subscribers read too), and the adapter turns them into the
cluster's chained hashes of exactly the prompt's blocks.

The subscriber test uses a real ZMQ PUB socket with vLLM's own wire format; the engine test
builds VllmBackend in-process on the stored SmolLM2 model (one engine, about a minute here)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from llmd.backends.base import Delta, Sampling
from llmd.backends.kv_chains import KvChains
from llmd.backends.vllm_events import TOPIC, KvEventSubscriber
from llmd.config import EngineConfig
from tests.conftest import async_wait_until, free_port, wait_until
from tests.unit.test_kv_chains import Seen, chain

pytestmark = pytest.mark.engine


def _batch(*events: Any) -> bytes:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(events)))


def test_subscriber_reads_vllms_wire_format_counts_gaps_and_stops() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    got: list[list[Any]] = []
    sub = KvEventSubscriber(got.append)
    sub.start()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(sub.endpoint)
    stored = BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=list(range(128)), block_size=128,
                         lora_id=None, medium="GPU", lora_name=None)

    try:
        seqs = itertools.count()

        def send(payload: bytes, skip: int = 0) -> None:
            seq = [next(seqs) for _ in range(skip + 1)][-1]
            pub.send_multipart((TOPIC.encode(), seq.to_bytes(8, "big"), payload))

        # a SUB socket sees nothing until its connection is up (the engine's first step comes later)
        probe = BlockRemoved(block_hashes=[0], medium="GPU")
        assert wait_until(lambda: send(_batch(probe)) or bool(got), timeout=10)
        send(_batch(stored, BlockRemoved(block_hashes=[7], medium="GPU")))
        send(_batch(AllBlocksCleared()), skip=1)  # one batch lost
        pub.send_multipart((b"other-topic", (0).to_bytes(8, "big"), _batch(AllBlocksCleared())))  # not subscribed
        send(b"\xc1not msgpack")  # after it: once this is counted, everything before was read
        assert wait_until(lambda: sub.stats.undecodable == 1, timeout=10)
        got = [b for b in got if b != [probe]]
        assert [[type(e).__name__ for e in b] for b in got] == [["BlockStored", "BlockRemoved"], ["AllBlocksCleared"]]
        assert got[0][0].token_ids == list(range(128)) and got[0][0].block_hashes == [7]
        assert sub.stats.gaps == 1
    finally:  # a failed assertion must not leave the thread or the socket's folder behind
        sub.stop()
        pub.close(0)
    assert not sub.running and not Path(sub.endpoint.removeprefix("ipc://")).parent.exists()


def _outside(port: int, topic: str) -> zmq.Socket[bytes]:
    """Another subscriber on the published port (what llm-d's prefix-cache scorer does)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _drain(sock: zmq.Socket[bytes], wait_ms: int = 200) -> list[list[bytes]]:
    out = []
    while sock.poll(wait_ms):
        out.append(sock.recv_multipart())
    return out


def test_published_on_tcp_the_events_reach_this_process_and_any_other_subscriber() -> None:
    from vllm.distributed.kv_events import BlockRemoved

    port, topic = free_port(), "kv@10.0.0.7@smollm2"
    got: list[list[Any]] = []
    sub = KvEventSubscriber(got.append, endpoint=f"tcp://*:{port}", topic=topic)
    assert sub.config().endpoint == f"tcp://*:{port}" and sub.config().topic == topic
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(sub.endpoint)  # as vLLM's publisher does with a wildcard host
    other = _outside(port, topic)
    try:
        sub.start()
        probe = _batch(BlockRemoved(block_hashes=[1], medium="GPU"))
        seen: list[list[bytes]] = []

        def both_heard() -> bool:  # a SUB sees nothing until its connection is up: send until both have
            pub.send_multipart((topic.encode(), (0).to_bytes(8, "big"), probe))
            seen.extend(_drain(other, 10))
            return bool(got) and bool(seen)

        assert wait_until(both_heard, timeout=10)
        assert got[0][0].block_hashes == [1] and seen[0][0] == topic.encode()
    finally:
        sub.stop()
        pub.close(0)
        other.close(0)


@pytest.fixture(scope="module")
async def engine(smollm2_path: Path) -> AsyncIterator[Any]:
    from llmd.backends.vllm_engine import VllmBackend

    port, topic = free_port(), "kv@test@smollm2"
    cfg = EngineConfig(max_model_len=1024, kv_cache_gib=1, max_num_seqs=4, max_num_batched_tokens=1024,
                       dtype="float32", kv_events_endpoint=f"tcp://*:{port}", kv_events_topic=topic)
    assert cfg.kv_events  # publishing them turns them on
    backend = VllmBackend("smollm2", "v", smollm2_path, cfg)
    backend.events = []  # type: ignore[attr-defined]
    backend.kv_events = backend.events.append
    backend.outside = _outside(port, topic)  # type: ignore[attr-defined]
    await backend.start()
    yield backend
    backend.outside.close(0)  # type: ignore[attr-defined]
    await backend.stop()


async def _run(backend: Any, ids: list[int]) -> list[Delta]:
    from llmd.backends.base import Prompt

    return [d async for d in backend.generate(f"kv-{len(backend.events)}", Prompt(ids, {"prompt_token_ids": ids}),
                                              Sampling(max_tokens=2, temperature=0))]


def _stored(events: list[list[Any]]) -> list[Any]:
    return [e for batch in events for e in batch if type(e).__name__ == "BlockStored"]


@pytest.mark.timeout(600)
async def test_engine_publishes_its_prompt_blocks_and_a_shared_prefix_hits(engine: Any) -> None:
    assert [type(e).__name__ for e in engine.events[0]] == ["AllBlocksCleared"]  # a fresh engine holds nothing
    assert engine.kv_block_tokens == 128  # vLLM's CPU backend forces it (`llmd plan calibrate` stamps it)
    seen = Seen()
    chains = KvChains(chain, 64, seen)
    applied = 0

    def apply() -> None:
        nonlocal applied
        for batch in engine.events[applied:]:
            chains(batch)
        applied = len(engine.events)

    shared = engine.render_completion(" ".join(f"fact {i} is true." for i in range(70))).token_ids[:400]
    a = shared + engine.render_completion(" ".join(f"first {i}" for i in range(80))).token_ids[:200]
    b = shared + engine.render_completion(" ".join(f"other {i}" for i in range(80))).token_ids[:200]

    first = await _run(engine, a)
    assert first[-1].finish_reason == "length" and first[0].cached_prompt_tokens == 0
    assert await async_wait_until(lambda: _stored(engine.events), timeout=10)
    s = _stored(engine.events)
    assert s[0].parent_block_hash is None and s[0].block_size == 128
    held = [t for e in s for t in e.token_ids]
    assert held == a[:512]  # every full block of the prompt, in order
    # the same events on the published TCP port, for any other subscriber
    from vllm.distributed.kv_events import KVEventBatch

    outside = [msgspec.msgpack.decode(m[2], type=KVEventBatch) for m in _drain(engine.outside, 500)]
    assert [t for b in outside for e in b.events if type(e).__name__ == "BlockStored" for t in e.token_ids] == held
    apply()
    assert seen.calls[-1] == ("stored", chain(a)[:8])

    n = len(s)
    second = await _run(engine, b)
    assert second[0].cached_prompt_tokens == 384  # the 3 whole shared blocks of 128
    assert await async_wait_until(lambda: len(_stored(engine.events)) > n, timeout=10)
    new = _stored(engine.events)[n]
    assert new.parent_block_hash == s[0].block_hashes[2]  # b's own block hangs off the shared three
    assert new.token_ids == b[384:512]
    apply()
    assert seen.calls[-1] == ("stored", chain(b)[6:8])


async def test_stopping_the_engine_reports_its_cache_cleared(engine: Any) -> None:
    sub = engine._kv_sub
    await engine.stop()
    assert [type(e).__name__ for e in engine.events[-1]] == ["AllBlocksCleared"]
    assert not sub.running and engine._kv_sub is None
