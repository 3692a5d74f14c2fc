"""One step composition for the fake backend and the simulator (llmd.stepplan): decodes first,
then prefill chunks from what is left of the step's token budget, in admission order; a prompt's
last chunk samples its first token. The same requests on the fake backend and on the simulator's
engine give the same steps."""

from __future__ import annotations

import asyncio

import pytest

from llmd.backends.base import Sampling
from llmd.backends.fake import FakeBackend
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.config import FakeEngineConfig
from llmd.plan.sim.engine import Engine
from llmd.plan.sim.metrics import Recorder
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import EngineSpec
from llmd.policy.queue import QueuedRequest
from llmd.stepmodel import StepModel, StepShape
from llmd.stepplan import chunk_attention, decode_context, prefill_chunks

BUDGET = 64
PROMPTS = (20, 150, 30)  # tokens; the second takes three steps of the budget
OUTPUT = 4
STEP = StepModel(coef={"c_step": 0.002})


def test_decodes_first_then_chunks_in_order_from_what_is_left() -> None:
    assert prefill_chunks(0, [20, 150, 30], 64) == [20, 44]  # the third waits: nothing left
    assert prefill_chunks(3, [20, 150, 30], 64) == [20, 41]
    assert prefill_chunks(0, [20, 150, 30], 400) == [20, 150, 30]
    assert prefill_chunks(0, [20, 150, 30], 400, kv_room=100) == [20, 80]  # the KV room bounds them too
    assert prefill_chunks(64, [20], 64) == []  # decodes took the whole budget
    assert prefill_chunks(0, [], 64) == []


def test_decode_context_and_chunk_attention() -> None:
    assert decode_context(100, 1) == 101  # the first token's KV is written by the first decode step
    assert chunk_attention(10, 30) == 10 * 35


async def _fake_steps() -> list[tuple[int, int, int]]:
    cfg = FakeEngineConfig(max_num_seqs=8, prefill_tokens_per_step=BUDGET, prefix_caching=False)
    be = FakeBackend("m", "v", 1024, cfg, TiktokenTokenizer.simple())
    be.pricer.model = STEP
    await be.start()
    try:
        async def one(i: int, n: int) -> int:
            p = be.render_completion([1000 * (i + 1) + k for k in range(n)])
            return sum([d.num_tokens async for d in be.generate(f"r{i}", p, Sampling(max_tokens=OUTPUT,
                                                                                        ignore_eos=True))])
        assert await asyncio.gather(*(one(i, n) for i, n in enumerate(PROMPTS))) == [OUTPUT] * len(PROMPTS)
    finally:
        await be.stop()
    return [(r.prefill_tokens, r.prefill_seqs, r.decode_seqs) for r in be.stats.history]


def _sim_steps() -> list[tuple[int, int, int]]:
    spec = EngineSpec(max_num_seqs=8, max_num_batched_tokens=BUDGET, kv_tokens=8192, prefix_caching=False)
    eng = Engine(spec, STEP, Recorder(("t",), 0.0, 0.0), 16)
    for i, n in enumerate(PROMPTS):
        eng.add(Req(i, 0, 0, n, OUTPUT, -1, 0, 0.0, QueuedRequest(str(i), "t", "interactive", n, OUTPUT, 1e9), True))
    steps: list[tuple[int, int, int]] = []
    now, done = 0.0, 0
    while (end := eng.plan(now)) is not None:
        if eng.seg is not None:  # a decode segment: one step of it, as the fake backend runs them
            end = eng.cut(now)
        chunks = [c for _, c in eng.mixed] if eng.mixed is not None else []
        steps.append((sum(chunks), len(chunks), len(eng.decoding)))
        now = end
        done += len(eng.complete(now)[1])
    assert done == len(PROMPTS)
    return steps


async def test_the_fake_backend_and_the_simulator_compose_the_same_steps() -> None:
    fake, sim = await _fake_steps(), _sim_steps()
    # The long prompt's chunks shrink by the decodes that go first; first tokens come with the last chunk.
    assert fake[:3] == [(64, 2, 0), (63, 1, 1), (63, 2, 1)]
    assert fake == sim
    assert sum(p for p, _, _ in fake) == sum(PROMPTS)
    assert sum(d for _, _, d in fake) == len(PROMPTS) * (OUTPUT - 1)


def test_the_fake_prices_the_shape_the_simulator_prices() -> None:
    """Same StepShape for a mixed step: the fake's pricer and the simulator's engine agree."""
    spec = EngineSpec(max_num_seqs=8, max_num_batched_tokens=BUDGET, kv_tokens=8192, prefix_caching=False)
    model = StepModel(coef={"c_step": 0.01, "c_seq": 0.001, "c_tok": 1e-4, "c_kv": 1e-6, "c_attn": 1e-8})
    eng = Engine(spec, model, Recorder(("t",), 0.0, 0.0), 16)
    eng.add(Req(0, 0, 0, 100, 8, -1, 0, 0.0, QueuedRequest("0", "t", "interactive", 100, 8, 1e9), True))
    end = eng.plan(0.0)
    assert end is not None
    eng.complete(end)  # 64 of 100 computed
    assert eng.plan(end) == pytest.approx(end + model.seconds(StepShape(0, 36, 1, 0, chunk_attention(36, 64))))
