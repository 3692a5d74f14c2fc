"""Late last, over real HTTP (fake backend, the openai SDK): a request that has waited past the
model's first-token objective yields its turn to one still on time, and still runs after it.
The policy itself is stepped by hand in test_scheduler_core.py; this checks the wiring, from
[slo] ttft_p95_s (the default) and from `late_after_s`, through the node to the scheduler."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai

from tests.conftest import fake_toml

ONE_SEAT = fake_toml(max_running=1, step_ms=10.0)


async def _first_token_at(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[float, str]:
    stream = await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=max_tokens, stream=True)
    first, finish = 0.0, ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and not first:
            first = time.monotonic()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return first, finish


async def _old_and_new(live: Any) -> tuple[float, float]:
    """The seat is held for ~2.2 s; `old` queues at once, `new` 1.7 s later, so when the seat comes
    free `old` has waited ~2 s and `new` ~0.5 s: when each got its first token."""
    client = openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0)
    hog = asyncio.create_task(_first_token_at(client, 200))  # ~2.2 s of 10 ms steps
    await asyncio.sleep(0.1)
    old = asyncio.create_task(_first_token_at(client, 4))
    await asyncio.sleep(1.7)
    new = asyncio.create_task(_first_token_at(client, 4))
    (_, f_hog), (t_old, f_old), (t_new, f_new) = await asyncio.gather(hog, old, new)
    assert f_hog == f_old == f_new == "length"  # all three served whole, the late one too
    return t_old, t_new


async def test_a_request_past_the_ttft_objective_yields_to_one_on_time(make_server) -> None:
    live = await make_server(ONE_SEAT + "[slo]\nttft_p95_s = 1.0\n")
    t_old, t_new = await _old_and_new(live)
    assert t_new < t_old  # late (~2 s > 1 s) when the seat came free: `new` (~0.5 s) went first


async def test_late_after_zero_keeps_arrival_order(make_server) -> None:
    live = await make_server(ONE_SEAT.replace("[models.scheduling]\n", "[models.scheduling]\nlate_after_s = 0\n")
                             + "[slo]\nttft_p95_s = 1.0\n")
    t_old, t_new = await _old_and_new(live)
    assert t_old < t_new
