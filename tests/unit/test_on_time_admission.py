"""On-time admission (`max_wait_s`): an interactive request that would wait longer for a seat is
refused at once (503 too_late, Retry-After), not queued; batch work and a light tenant whom fair
queueing seats ahead of a neighbour's backlog are still let in."""

from __future__ import annotations

import asyncio

import openai
import pytest

from llmd.auth import hash_key
from tests.conftest import async_wait_until

KEY_A, KEY_B = "sk-llmd-late-a", "sk-llmd-late-b"
TOML = """
[server]
default_deadline_s = 60
[[models]]
name = "m"
backend = "fake"
max_output_tokens = 4096
[models.fake]
step_ms = 20
step_ms_per_seq = 0.0
[models.scheduling]
max_running = 1
prior_tokens_per_s = 50
{max_wait}
[slo]
ttft_p95_s = 1.0
[[tenants]]
name = "a"
keys = ["{key_a}"]
[[tenants]]
name = "b"
keys = ["{key_b}"]
"""


def toml(max_wait: str = "") -> str:
    return TOML.format(max_wait=max_wait, key_a=hash_key(KEY_A), key_b=hash_key(KEY_B))


def clients(live) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    return (openai.AsyncOpenAI(base_url=live.base, api_key=KEY_A, max_retries=0, timeout=60),
            openai.AsyncOpenAI(base_url=live.base, api_key=KEY_B, max_retries=0, timeout=60))


async def test_a_request_that_would_wait_past_max_wait_is_refused_now(make_server, records) -> None:
    live = await make_server(toml("max_wait_s = 1.0"))
    a, _ = clients(live)
    rt = live.runtime("m")
    # One seat at ~50 tokens/s, a 128-token answer expected per request: one queued is ~2.6 s.
    first = [asyncio.create_task(a.completions.create(model="m", prompt="x", max_tokens=200)) for _ in range(2)]
    assert await async_wait_until(lambda: len(rt.queue) >= 1)
    with pytest.raises(openai.InternalServerError) as e:
        await a.completions.create(model="m", prompt="x", max_tokens=5)
    assert e.value.status_code == 503 and e.value.body["code"] == "overloaded"
    assert "1s bound on an interactive request's wait" in e.value.body["message"]
    assert int(e.value.response.headers["retry-after"]) >= 2
    late = [r for r in records if r.get("decision") == "shed:too_late"]
    assert len(late) == 1 and late[0]["tenant"] == "a"
    await cancel(first)


async def test_batch_work_and_a_light_tenant_still_get_in(make_server, records) -> None:
    live = await make_server(toml("max_wait_s = 6"))
    a, b = clients(live)
    rt = live.runtime("m")
    flood = [asyncio.create_task(a.completions.create(model="m", prompt="x", max_tokens=200)) for _ in range(5)]
    assert await async_wait_until(lambda: len(rt.queue) >= 3)
    # Batch work has no time-to-first-token objective: it waits its turn.
    queued = asyncio.create_task(a.completions.create(model="m", prompt="x", max_tokens=5,
                                                      extra_headers={"X-Priority-Class": "batch"}))
    assert await async_wait_until(lambda: rt.queue.depth("batch") == 1)
    # Tenant b is seated ahead of most of a's backlog by fair queueing: its wait is short enough.
    r = await b.completions.create(model="m", prompt="x", max_tokens=5)
    assert r.usage.completion_tokens == 5
    await cancel([*flood, queued])


async def cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
