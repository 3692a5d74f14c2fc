"""The ITL target over HTTP with the fake engine: a flood brings the seat limit down to what
the step-time model, fitted on the engine's own steps, predicts meets the target."""

from __future__ import annotations

import asyncio

import openai
import pytest

from llmd.policy.saturation import StepModelITL
from tests.conftest import LiveServer, async_wait_until

# Each step takes 20 ms + 4 ms per sequence: 276 ms with all 64 seats, over twice the target.
TOML = """
[server]
default_deadline_s = 120
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = 20
step_ms_per_seq = 4
max_num_seqs = 64
[models.scheduling]
target_itl_ms = 120
target_itl_margin = 1.0
"""


def flood(live: LiveServer, n: int) -> list[asyncio.Task[object]]:
    c = openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0, timeout=120)
    return [asyncio.create_task(c.completions.create(model="fake", prompt=f"x {i}", max_tokens=3000))
            for i in range(n)]


async def test_a_flood_brings_the_seat_limit_to_the_step_models_value(make_server) -> None:
    live = await make_server(TOML)
    rt = live.runtime("fake")
    ctl = rt.scheduler.core.detector.itl
    assert isinstance(ctl, StepModelITL) and rt.scheduler.seat_limit == 64
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks = flood(live, 80)
    try:
        # Cold: the first steps all run 64 sequences, so plain AIMD cuts first (to 32); its steps
        # show the model a second batch size, and from then on the model sizes the seats. The
        # first fits, on a dozen steps that all carry the flood's prefills, may still credit the
        # prefills with the batch's cost: judged once the fit has two dozen steps.
        def sized() -> bool:
            fit = ctl.model.fit
            return (ctl.engine_aim is not None and fit is not None and fit.samples >= 24
                    and abs(ctl.seat_limit - fit.seats_for(ctl.engine_aim, 1, 64)) <= 2
                    and len(rt.scheduler.running) <= ctl.seat_limit)

        assert await async_wait_until(sized, timeout=30.0), ctl.describe()
        took = loop.time() - t0
        fit = ctl.model.fit
        assert fit is not None
        # The fit recovers the fake's own step model; whatever the event loop adds to a step
        # (this process also serves 80 streams) shows in the intercept, not the slope.
        assert fit.b == pytest.approx(0.004, rel=0.25), ctl.describe()
        assert 0.015 <= fit.a <= 0.040, ctl.describe()
        # 20 + 4n ms <= 120 ms: n <= 25, less the noise margin and the event loop's share.
        assert 12 <= ctl.seat_limit <= 25, ctl.describe()
        assert took < 15.0  # a generous bound: timings belong to benchmarks
        # The engine follows once the sequences over the limit were preempted (their aborts land
        # within a step): its steps then run about the limit, each reporting its duration.
        await asyncio.sleep(1.0)
        last = rt.backend.stats.history[-1].t
        steps = [s for s in rt.backend.stats.history if s.t >= last - 0.5]
        assert all(s.duration > 0 for s in steps) and max(s.running for s in steps) <= ctl.seat_limit + 2
        print(f"sized after {took:.2f} s: {ctl.describe()}")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await async_wait_until(lambda: not rt.scheduler.running and not len(rt.queue))


async def test_only_interactive_streams_feed_the_itl_controller(make_server) -> None:
    """A batch stream's gaps include the seat it yields by design (minutes, when preempted):
    they would cut the interactive class's seats. Only interactive streams' gaps are fed."""
    live = await make_server(TOML)
    rt = live.runtime("fake")
    c = openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0, timeout=60)
    await c.completions.create(model="fake", prompt="batch", max_tokens=20,
                               extra_headers={"X-Priority-Class": "batch"})
    assert len(rt.gaps) == 0
    await c.completions.create(model="fake", prompt="interactive", max_tokens=20)
    assert len(rt.gaps) == 19  # a gap per token after the first
