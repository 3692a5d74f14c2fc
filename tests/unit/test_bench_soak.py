"""bench/soak.py's server config: the fake engine gets a fixed KV pool that every stream fits
in, so its prefix cache stops growing once the pool is full, as a real engine's does."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench import soak
from llmd.backends.base import Sampling
from llmd.backends.fake import FakeBackend
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.config import load_config


def _engine(tmp_path: Path, streams: int, tokens: int) -> FakeBackend:
    args = soak.parse_args(["--streams", str(streams), "--tokens", str(tokens), "--no-write"])
    path = tmp_path / "config.toml"
    path.write_text(soak.config(args).format(port=8000, db=tmp_path / "llmd.db"))
    model = load_config(path).models[0]
    assert model.fake is not None
    fast = model.fake.model_copy(update={"step_ms": 0.0})
    return FakeBackend("fake", "v1", model.engine.max_model_len, fast, TiktokenTokenizer.simple())


async def test_the_soak_engine_keeps_a_fixed_kv_pool_however_many_streams_ran(tmp_path: Path) -> None:
    be = _engine(tmp_path, streams=8, tokens=64)
    seats = be.cfg.max_num_seqs
    assert seats == 10 and be.cfg.kv_blocks == be.cache.num_blocks == soak.kv_blocks(seats, 64) == 100
    await be.start()
    try:
        async def stream(i: int) -> int:
            sampling = Sampling(max_tokens=64, ignore_eos=True)
            return sum([d.num_tokens async for d in be.generate(f"s{i}", be.render_completion(f"soak {i} 0"),
                                                                   sampling)])

        for wave in range(6):  # 60 streams of 4 full blocks each: 240 blocks cached without a bound
            assert await asyncio.gather(*(stream(wave * seats + i) for i in range(seats))) == [64] * seats
            assert be.cache.occupied <= be.cache.num_blocks
        # Full, less the last wave's partial blocks: each new stream evicted old blocks (60 x 4 were cached).
        assert be.cache.num_blocks - seats == be.cache.cached_blocks() == be.cache.occupied
    finally:
        await be.stop()
