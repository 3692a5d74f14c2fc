"""What a node tells the others (llmd/cluster/load.py): the state's encoding (round trip, one
datagram whatever the tenants and prefix delta, garbage refused) and a served version's load
read off a real runtime on the fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from llmd.backends.base import Sampling, StepRecord
from llmd.backends.fake import FakeBackend
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.cluster.load import (
    MAX_STATE_BYTES,
    NodeState,
    StateError,
    VersionLoad,
    decode,
    encode,
    kv_capacity_tokens,
    recent_rates,
    version_load,
)
from llmd.config import ModelConfig, TenantConfig
from llmd.policy import placement
from llmd.policy.homes import Shared
from llmd.policy.queue import QueuedRequest
from llmd.runtime import ModelRuntime, build_runtime
from tests.conftest import async_wait_until

TOK = TiktokenTokenizer.simple()


def vload(i: int, **kw: object) -> VersionLoad:
    return VersionLoad(model=f"model-{i}", version=os.urandom(32).hex(), kv_capacity_tokens=262_144,
                       kv_free_tokens=100_000 + i, running=40 + i, running_tokens=150_000, waiting_prefill_tokens=9_000,
                       prefill_tps=12_345.5, decode_tps=1_024.25, **kw)  # type: ignore[arg-type]


def state(tenants: int = 3, delta: int = 40, seq: int = 17, stored: int = 2) -> NodeState:
    versions = (vload(0, tokenizer=os.urandom(8).hex()), vload(1, draining=True), vload(2, standby=True),
                vload(3, tokenizer="simple"))
    return NodeState(node="node-a.example", http_url="https://10.0.0.17:8443", seq=seq, versions=versions,
                     prefix_seq=123_456, prefix_delta=os.urandom(delta),
                     tenant_tokens={f"tenant-{i:03d}": 10**9 + i for i in range(tenants)},
                     registry_rev=42, stored=tuple(v.version for v in versions[:stored]))


def test_version_load_is_the_policys_record() -> None:
    assert VersionLoad is placement.VersionLoad


def test_round_trip() -> None:
    s = state()
    assert decode(encode(s)) == s
    empty = NodeState("n", "http://h:1", 0, (), 0, b"")
    assert decode(encode(empty)) == empty
    odd = NodeState("nöde", "http://h:1", 2**40, (vload(0, draining=False),), 7, b"", {"A-b.c": 0},
                    stored=("ABCDEF", "abc"))  # not lowercase hex / odd length: sent as text
    assert decode(encode(odd)) == odd


def test_prefix_traffic_goes_out_quantized_and_the_least_busy_make_room_first() -> None:
    traffic = tuple(Shared(2**63 + k * 7919, 40.0 - k, 64_000.0 - 1000 * k, 1500 + k) for k in range(16))
    s = state()
    got = decode(encode(NodeState(s.node, s.http_url, s.seq, s.versions, s.prefix_seq, s.prefix_delta,
                                  s.tenant_tokens, s.registry_rev, s.stored, traffic))).traffic
    assert [e.key for e in got] == [e.key for e in traffic] and [e.size for e in got] == [e.size for e in traffic]
    assert all(abs(g.requests / e.requests - 1) <= 0.045 and abs(g.tokens / e.tokens - 1) <= 0.045
               for g, e in zip(got, traffic, strict=True))
    assert decode(encode(replace(s, traffic=got))).traffic == got  # what HomeTable.export gives (on the grid): exact
    assert len(encode(replace(s, traffic=traffic))) - len(encode(s)) == 16 * 12  # 8-byte key, 2 levels, size
    full = state(tenants=32, delta=400, stored=4)  # tenants and the delta fill the datagram
    out = encode(NodeState(full.node, full.http_url, full.seq, full.versions, full.prefix_seq, full.prefix_delta,
                           full.tenant_tokens, full.registry_rev, full.stored, traffic))
    assert len(out) <= MAX_STATE_BYTES
    assert [e.key for e in decode(out).traffic] == [e.key for e in traffic][:len(decode(out).traffic)]


def test_small_with_four_versions() -> None:
    """Four versions with full sha256 ids, a URL, three tenants: well under a datagram."""
    assert len(encode(state(tenants=3, delta=0, stored=4))) < 500


def test_size_bound_trims_tenants_then_delta_never_versions() -> None:
    big = state(tenants=32, delta=400, stored=4)
    out = encode(big)
    assert len(out) <= MAX_STATE_BYTES
    got = decode(out)
    assert got.versions == big.versions and got.stored == big.stored
    assert got.prefix_delta == big.prefix_delta  # the delta fits whole; tenants make room for it
    assert 0 < len(got.tenant_tokens) < 32
    assert all(big.tenant_tokens[t] == n for t, n in got.tenant_tokens.items())
    # tenants rotate with seq: over a few pushes every one is sent
    heard: set[str] = set()
    for seq in range(64):
        heard |= set(decode(encode(state(tenants=32, delta=400, seq=seq, stored=4))).tenant_tokens)
    assert len(heard) == 32
    # a delta that cannot fit is left out whole (the receiver sees a gap and fetches a snapshot)
    huge = decode(encode(state(tenants=32, delta=1100, stored=4)))
    assert huge.prefix_delta == b"" and huge.prefix_seq == 123_456


@pytest.mark.parametrize("seed", range(20))
def test_never_over_a_datagram(seed: int) -> None:
    rng = random.Random(seed)
    s = state(tenants=rng.randrange(0, 200), delta=rng.randrange(0, 1200), seq=rng.randrange(10**6),
              stored=rng.randrange(0, 5))
    s = NodeState(s.node, s.http_url, s.seq, s.versions, s.prefix_seq, s.prefix_delta, s.tenant_tokens,
                  s.registry_rev, s.stored * rng.randrange(1, 40))
    out = encode(s)
    assert len(out) <= MAX_STATE_BYTES
    assert decode(out).versions == s.versions


def test_versions_that_cannot_fit_are_refused() -> None:
    many = tuple(vload(i) for i in range(30))
    with pytest.raises(StateError):
        encode(NodeState("n", "http://h:1", 0, many, 0, b""))


def test_garbage_is_rejected() -> None:
    good = encode(state())
    bad = [b"", b"junk", b"L\x02", good[:-1], good + b"\0", good[:len(good) // 2],
           b"L\x01" + good[2:],  # the format before versions carried their tokenizer: refused, never misread
           b"L\x02" + b"\xff" * 20, good[:2] + b"\x03\xff\xfe\xfd" + good[6:], good + os.urandom(2000)]
    for b in bad:
        with pytest.raises(StateError):
            decode(b)
    rng = random.Random(0)
    for _ in range(500):  # any flip either decodes to a state or raises StateError, nothing else
        b = bytearray(good)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        with contextlib.suppress(StateError):
            decode(bytes(b))
    assert issubclass(StateError, ValueError)


def test_recent_rates_from_steps() -> None:
    assert recent_rates([]) == (0.0, 0.0)
    steps = [StepRecord(t=10.0 + i * 0.01, running=4, waiting=0, kv_usage=0.1, generated_tokens=4, duration=0.01,
                        prefill_tokens=100 if i < 5 else 0) for i in range(50)]
    prefill, decode_ = recent_rates(steps)
    assert prefill == pytest.approx(10_000)
    assert decode_ == pytest.approx(400)
    # vLLM reports no duration for a step with nothing decoding: the time since the step before
    pure = [StepRecord(t=1.0, running=1, waiting=0, kv_usage=0, generated_tokens=0),
            StepRecord(t=1.05, running=1, waiting=0, kv_usage=0, generated_tokens=0, prefill_tokens=500),
            StepRecord(t=9.0, running=1, waiting=0, kv_usage=0, generated_tokens=0, prefill_tokens=500)]  # idle before
    assert recent_rates(pure) == (pytest.approx(10_000), 0.0)


def test_kv_capacity_sources() -> None:
    assert kv_capacity_tokens(SimpleNamespace(kv_capacity_tokens=5000, max_model_len=10)) == 5000
    blocks = SimpleNamespace(cfg=SimpleNamespace(kv_blocks=100, block_tokens=16, max_num_seqs=4), max_model_len=10)
    assert kv_capacity_tokens(blocks) == 1600
    seqs = SimpleNamespace(cfg=SimpleNamespace(kv_blocks=None, max_num_seqs=4), max_model_len=512)
    assert kv_capacity_tokens(seqs) == 2048


async def _runtime(max_num_seqs: int, max_running: int) -> ModelRuntime:
    cfg = ModelConfig(name="fake-model", backend="fake", fake={"step_ms": 2.0, "step_ms_per_seq": 0.0,
                                                               "max_num_seqs": max_num_seqs},
                      scheduling={"max_running": max_running, "reserved_seats": 0})
    backend = FakeBackend(cfg.name, "ab" * 32, cfg.engine.max_model_len, cfg.fake, TOK)
    await backend.start()
    return build_runtime(cfg, backend, [TenantConfig(name="t")])


async def _run(rt: ModelRuntime, i: int, prompt: str, max_tokens: int, seen: list[VersionLoad]) -> None:
    p = rt.backend.render_completion(prompt)
    req = QueuedRequest(f"r{i}", "t", "interactive", p.num_tokens, max_tokens, deadline=1e12)
    n = 0
    await rt.scheduler.wait_turn(req, abort=lambda: asyncio.sleep(0))
    try:
        async for d in rt.backend.generate(f"r{i}", p, Sampling(max_tokens=max_tokens), 0):
            k = len(d.token_ids) if d.token_ids else 1
            rt.scheduler.on_output(req, k)  # as dispatch.account does
            n += k
            if i == 0 and n == 30:
                seen.append(version_load(rt))
    finally:
        rt.scheduler.finished(req, n)


def idle_figures(v: VersionLoad) -> tuple[int, int, int, int]:
    return v.running, v.running_tokens, v.kv_free_tokens, v.waiting_prefill_tokens


async def test_version_load_of_a_fake_backend_runtime() -> None:
    rt = await _runtime(max_num_seqs=2, max_running=4)  # 2 run in the engine, 2 wait in it, the rest in llmd's queue
    try:
        idle = version_load(rt, draining=True)
        cap = kv_capacity_tokens(rt.backend)
        assert (idle.model, idle.version, idle.draining, idle.standby) == ("fake-model", "ab" * 32, True, False)
        assert (idle.kv_capacity_tokens, idle.kv_free_tokens, idle.running, idle.waiting_prefill_tokens) == (
            cap, cap, 0, 0)
        prompt = "word " * 200
        tokens = rt.backend.render_completion(prompt).num_tokens
        seen: list[VersionLoad] = []
        tasks = [asyncio.create_task(_run(rt, i, prompt, 60, seen)) for i in range(6)]
        await asyncio.gather(*tasks)
        busy = seen[0]
        assert busy.running == 2 and 0 < busy.running_tokens == cap - busy.kv_free_tokens
        assert busy.waiting_prefill_tokens == 4 * tokens  # 2 waiting in the engine + 2 in llmd's queue
        assert busy.prefill_tps > 0 and busy.decode_tps > 0
        after = version_load(rt, standby=True)
        assert idle_figures(after) == (0, 0, cap, 0)
        assert after.standby and after.prefill_tps > 0  # the rates stay: how fast it is when busy
        stats = rt.backend.stats  # an engine that stopped stepping keeps its last step's figures
        stats.running, stats.waiting, stats.kv_usage = 3, 2, 0.5
        stale = version_load(rt)
        assert idle_figures(stale) == (0, 0, cap, 0)
    finally:
        await rt.stop()


async def test_prompts_seated_during_a_long_prefill_step_count_as_waiting() -> None:
    """The engine's figures are as of its last step: four prompts seated on an idle engine go
    into one long prefill step, and until it ends the engine says nothing waits. Counted from
    what llmd seated with no output yet, the node does not look idle meanwhile (its peers would
    all send their work there: the herd onto a freshly promoted warm-pool node)."""
    cfg = ModelConfig(name="fake-model", backend="fake",
                      fake={"step_ms": 2.0, "step_ms_per_seq": 0.0, "max_num_seqs": 8,
                            "prefill_tokens_per_s": 5.0, "prefill_tokens_per_step": 100000},
                      scheduling={"max_running": 8, "reserved_seats": 0})
    backend = FakeBackend(cfg.name, "ab" * 32, cfg.engine.max_model_len, cfg.fake, TOK)
    await backend.start()
    rt = build_runtime(cfg, backend, [TenantConfig(name="t")])
    prompt = "word " * 200
    tokens = backend.render_completion(prompt).num_tokens
    tasks = [asyncio.create_task(_run(rt, i, prompt, 4, [])) for i in range(4)]
    try:
        assert await async_wait_until(lambda: len(rt.scheduler.running) == 4 and backend.stats.waiting == 0)
        await asyncio.sleep(0.05)
        load = version_load(rt)
        assert load.waiting_prefill_tokens == 4 * tokens and load.running == 0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await rt.stop()
