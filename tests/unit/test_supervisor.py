"""The engine supervisor over real HTTP with the official openai SDK and the fake backend: a
dead engine is rebuilt without restarting the server; queued and not-yet-started requests
run on the new engine in their places; a running stream resumes with the same text; where
resuming is impossible the stream ends with the terminal event; batch items are re-queued;
/health, /ready, metrics and one usage row per request say what happened."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmd.store import WeightStore
from tests.conftest import LiveServer, async_wait_until

TOML = """
[server]
default_deadline_s = 30
{db}
[[models]]
name = "fake"
backend = "fake"
{source}
max_output_tokens = 4096
default_max_tokens = 16
[models.engine]
max_model_len = 4096
restart_backoff_s = 0.05
{engine}
[models.fake]
step_ms = {step_ms}
step_ms_per_seq = 0.0
max_num_seqs = 8
start_s = {start_s}
[models.scheduling]
max_running = {max_running}
"""


def toml(step_ms: float = 5.0, max_running: int = 8, start_s: float = 0.0, engine: str = "", source: str = "",
         db: str = "") -> str:
    return TOML.format(step_ms=step_ms, max_running=max_running, start_s=start_s, engine=engine, source=source,
                       db=db)


def client(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0, timeout=30)


async def metrics(live: LiveServer) -> dict[str, float]:
    async with httpx.AsyncClient() as h:
        text = (await h.get(live.url + "/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("model") == "fake" and f.name.startswith(("llmd:engine", "llmd:requests_re"))}


async def state(live: LiveServer) -> tuple[int, int, dict[str, Any]]:
    async with httpx.AsyncClient() as h:
        health, ready = await h.get(live.url + "/health"), await h.get(live.url + "/ready")
    return health.status_code, ready.status_code, ready.json()["models"]["fake"]


async def usage_rows(live: LiveServer) -> list[dict[str, Any]]:
    return await live.node.ledger.rows(None, 1000)


async def stream_text(c: openai.AsyncOpenAI, kill_after: int | None = None, live: LiveServer | None = None,
                      **kw: Any) -> str:
    """The streamed text; kills the engine after `kill_after` chunks."""
    out: list[str] = []
    async for ch in await c.completions.create(model="fake", stream=True, temperature=0, **kw):
        out.append(ch.choices[0].text if ch.choices else "")
        if len(out) == kill_after and live is not None:
            live.backend().kill()
    return "".join(out)


async def killed_stream(c: openai.AsyncOpenAI, live: LiveServer, got: list[str]) -> None:
    """A long stream whose engine is killed after its third chunk; its chunks' text into `got`."""
    async for ch in await c.completions.create(model="fake", prompt="x", max_tokens=500, stream=True):
        got.append(ch.choices[0].text)
        if len(got) == 3:
            live.backend().kill()


async def test_running_streams_resume_with_the_same_text(make_server, records) -> None:
    live = await make_server(toml(step_ms=10))
    c = client(live)
    prompts = [f"tell me story number {i}" for i in range(3)]
    ref = [await stream_text(c, prompt=p, max_tokens=40) for p in prompts]
    first = live.backend()
    got = await asyncio.gather(stream_text(c, 5, live, prompt=prompts[0], max_tokens=40),
                               *(stream_text(c, prompt=p, max_tokens=40) for p in prompts[1:]))
    assert got == ref  # a pause, not an error: the text continues as if nothing happened
    assert live.backend() is not first and any(i.endswith("-r1") for i in live.backend().submitted)
    resumed = [r for r in records[3:] if r["resumed"]]
    assert len(resumed) == 3 and all(r["status"] == "ok" and r["output_tokens"] == 40 for r in resumed)
    rows = await usage_rows(live)
    assert len(rows) == 6 and len({r["request_id"] for r in rows}) == 6
    assert all(r["status"] == "ok" and r["output_tokens"] == 40 for r in rows)
    m = await metrics(live)
    assert m["llmd:engine_restarts_total"] == 1 and m["llmd:requests_resumed_total"] == 3
    assert m["llmd:engine_up"] == 1
    assert (await state(live))[:2] == (200, 200)


async def test_queued_and_unstarted_requests_run_on_the_new_engine_in_their_places(make_server, records) -> None:
    live = await make_server(toml(step_ms=100, max_running=2))
    c, be, rt = client(live), live.backend(), live.runtime()
    # The step that computes a prompt samples its first token (as vLLM's does): a long first step
    # keeps the two seated ones without a token while the other four queue behind them.
    be.cfg.step_ms = 3000
    calls = [c.completions.create(model="fake", prompt=f"request {i}", max_tokens=5, temperature=0) for i in range(6)]
    tasks = []
    for call in calls:  # one at a time, so they queue in this order
        tasks.append(asyncio.ensure_future(call))
        assert await async_wait_until(lambda: len(rt.queue) + len(be.submitted) == len(tasks))
    assert len(be.submitted) == 2 and len(rt.queue) == 4 and be.stats.generated_tokens == 0
    be.cfg.step_ms = 100  # the new engine's speed (whether or not it shares this config)
    be.kill()  # two seated in the engine, four in our queue: none has a token yet
    answers = await asyncio.gather(*tasks)
    assert all(a.usage.completion_tokens == 5 for a in answers)
    ref = [await c.completions.create(model="fake", prompt=f"request {i}", max_tokens=5, temperature=0)
           for i in range(6)]
    assert [a.choices[0].text for a in answers] == [r.choices[0].text for r in ref]
    new = live.backend()
    assert [i.endswith("-r1") for i in new.submitted[:6]] == [True, True, False, False, False, False]
    by_client = sorted(records[:6], key=lambda r: r["request_id"])
    assert sum(r["resumed"] for r in by_client) == 2
    rows = await usage_rows(live)
    assert len(rows) == 12 and all(r["status"] == "ok" and r["output_tokens"] == 5 for r in rows)
    m = await metrics(live)
    assert m["llmd:requests_requeued_total"] == 2 and m["llmd:requests_resumed_total"] == 0


async def test_a_deadline_too_close_ends_the_stream_with_the_terminal_event(make_server, records) -> None:
    live = await make_server(toml(step_ms=10, start_s=4.0))
    c = openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0, timeout=30,
                           default_headers={"X-Request-Timeout": "1.5"})
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        await killed_stream(c, live, got)
    assert err.value.code == "engine_dead" and len(got) >= 3
    health, ready, model = await state(live)
    assert (health, ready, model["engine"]) == (200, 503, "restarting")
    assert await async_wait_until(lambda: live.runtime().ready, 10)
    assert (await state(live))[:2] == (200, 200)
    rows = await usage_rows(live)
    assert len(rows) == 1 and rows[0]["status"] == "error" and rows[0]["output_tokens"] >= 3
    assert records[-1]["error_code"] == "engine_dead" and records[-1]["resumed"] == 0


async def test_requests_sent_while_rebuilding_wait_for_the_new_engine(make_server) -> None:
    live = await make_server(toml(start_s=1.0))
    c = client(live)
    first = live.backend()
    first.kill()  # an idle engine: the supervisor notices it by itself
    assert await async_wait_until(lambda: live.runtime().watch.state == "restarting", 5)
    health, ready, model = await state(live)
    assert (health, ready, model["ready"], model["engine"]) == (200, 503, False, "restarting")
    answer = await c.completions.create(model="fake", prompt="x", max_tokens=4)
    assert answer.usage.completion_tokens == 4 and live.backend() is not first
    health, ready, model = await state(live)
    assert (health, ready, model["engine"], model["restarts"]) == (200, 200, "up", 1)


async def test_an_engine_that_cannot_be_rebuilt_makes_the_node_unhealthy(make_server, tmp_path: Path,
                                                                          smollm2_path: Path) -> None:
    src, ws = tmp_path / "src", WeightStore(tmp_path / "home")
    src.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_path / f, src / f)
    (src / "model.safetensors").write_bytes(b"weights")
    stored = ws.add_hf_dir(src, "tiny", "test:0")
    live = await make_server(toml(step_ms=20, max_running=1, engine="restart_attempts = 2",
                                  source='source = "tiny"'), ws)
    c, rt = client(live), live.runtime()
    (stored.path / "model.safetensors").write_bytes(b"rotten")  # the weight store no longer verifies
    got: list[str] = []
    streaming = asyncio.ensure_future(read_stream(c, got))
    assert await async_wait_until(lambda: len(got) >= 2)
    waiting = asyncio.ensure_future(c.completions.create(model="fake", prompt="y", max_tokens=4))
    assert await async_wait_until(lambda: len(rt.queue) == 1)
    live.backend().kill()
    with pytest.raises(openai.APIError) as err:
        await streaming
    assert err.value.code == "engine_dead"
    with pytest.raises(openai.APIStatusError) as queued:  # not left to its deadline in a held queue
        await waiting
    assert queued.value.status_code == 503 and queued.value.code == "engine_dead"
    assert live.runtime().watch.state == "failed"
    health, ready, model = await state(live)
    assert (health, ready, model["engine"]) == (503, 503, "failed")
    with pytest.raises(openai.APIStatusError) as refused:
        await c.completions.create(model="fake", prompt="x", max_tokens=4)
    assert refused.value.status_code == 503 and refused.value.code == "engine_unhealthy"


async def read_stream(c: openai.AsyncOpenAI, got: list[str]) -> None:
    async for ch in await c.completions.create(model="fake", prompt="x", max_tokens=500, stream=True):
        got.append(ch.choices[0].text)  # noqa: PERF401 - as each chunk arrives


async def test_without_restarts_a_dead_engine_stays_dead_and_health_says_so(make_server) -> None:
    live = await make_server(toml(engine="restart_attempts = 0"))
    live.backend().kill()
    assert await async_wait_until(lambda: live.runtime().watch.state == "failed", 5)
    assert (await state(live))[:2] == (503, 503)
    assert (await metrics(live))["llmd:engine_restarts_total"] == 0


async def test_running_batch_items_are_requeued_not_failed(make_server, records) -> None:
    live = await make_server(toml(step_ms=20, max_running=2))
    c = client(live)
    lines = [f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/completions", "body": {{"model": "fake", '
             f'"prompt": "item {i}", "max_tokens": 12, "temperature": 0}}}}' for i in range(5)]
    f = await c.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    be = live.backend()
    assert await async_wait_until(lambda: be.stats.generated_tokens >= 3, 10)
    be.kill()
    for _ in range(300):
        batch = await c.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(0.05)
    assert batch.status == "completed" and batch.request_counts.failed == 0
    out = (await c.files.content(batch.output_file_id)).text.splitlines()
    assert len(out) == 5 and all('"status_code": 200' in line or '"status_code":200' in line for line in out)
    assert sum(r["resumed"] for r in records) >= 1
    rows = await usage_rows(live)
    assert len(rows) == 5 and all(r["status"] == "ok" and r["output_tokens"] == 12 for r in rows)


async def test_a_structured_output_already_sending_is_not_resumed(make_server) -> None:
    """Its grammar would restart at the resumed prompt's end and change the output: terminal event."""
    live = await make_server(toml(step_ms=10))
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)}}
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        await structured_stream(client(live), live, schema, got)
    assert err.value.code == "engine_dead" and len(got) >= 3
    assert await async_wait_until(lambda: live.runtime().ready, 10)  # the engine itself is rebuilt


async def structured_stream(c: openai.AsyncOpenAI, live: LiveServer, schema: dict[str, Any], got: list[str]) -> None:
    async for ch in await c.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=500,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}):
        got.append(ch.choices[0].delta.content or "" if ch.choices else "")
        if len(got) == 3:
            live.backend().kill()


SCRIPT = "The boats drift past the old mill while the town sleeps. " * 3 + "The end."


async def scripted_stream(c: openai.AsyncOpenAI, live: LiveServer, chat: bool) -> tuple[str, str | None, int]:
    """A `[[say:...]]` stream (logprobs on) whose engine is killed after its third chunk: its text,
    finish_reason and usage."""
    kw: dict[str, Any] = {"model": "fake", "max_tokens": 500, "stream": True, "temperature": 0,
                          "stream_options": {"include_usage": True}}
    prompt = f"Tell me about a city. [[say:{SCRIPT}]]"
    out = await (c.chat.completions.create(messages=[{"role": "user", "content": prompt}], logprobs=True,
                                           top_logprobs=2, **kw) if chat
                 else c.completions.create(prompt=prompt, logprobs=2, **kw))
    text, finish, usage, chunks = "", None, 0, 0
    async for ch in out:
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for x in ch.choices:
            text += (x.delta.content or "") if chat else x.text
            finish = x.finish_reason or finish
            chunks += 1
            if chunks == 3:
                live.backend().kill()
    return text, finish, usage


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_resumed_request_follows_its_prompt_on_the_rebuilt_engine(make_server, records, chat) -> None:
    """The resumed prompt reaches the new engine as token ids: it must read them as the old one
    did (the fake's `[[say:...]]` script, vLLM's text), not start over from default text."""
    live = await make_server(toml(step_ms=10))
    first = live.backend()
    text, finish, usage = await scripted_stream(client(live), live, chat)
    assert live.backend() is not first and records[-1]["resumed"] == 1
    assert (text, finish) == (SCRIPT, "stop")
    assert usage == records[-1]["output_tokens"] == -(-len(SCRIPT) // 3)


async def test_a_structured_answer_not_streamed_starts_over_on_the_rebuilt_engine(make_server, records) -> None:
    """Nothing of a non-streamed answer has left before its end, so an engine death does not fail
    it (its grammar cannot resume): it runs again from its start, billed for the answer alone."""
    live = await make_server(toml(step_ms=10))
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)},
              "required": [f"field_{i}" for i in range(20)]}
    first, lc = live.backend(), live.node.lifecycle
    call = asyncio.ensure_future(client(live).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=500,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}))
    assert await async_wait_until(lambda: any(r.output_tokens >= 5 for r in lc.in_flight.values()), 10)
    first.kill()
    answer = await call
    doc = json.loads(answer.choices[0].message.content or "")
    assert sorted(doc) == sorted(schema["properties"]) and answer.choices[0].finish_reason == "stop"
    assert live.backend() is not first and records[-1]["resumed"] == 1
    tokens = -(-len(json.dumps(doc)) // 3)  # the fake's instance, 3 characters a token
    assert answer.usage.completion_tokens == records[-1]["output_tokens"] == tokens
    (row,) = await usage_rows(live)
    assert row["status"] == "ok" and row["output_tokens"] == tokens
    m = await metrics(live)
    assert m["llmd:requests_requeued_total"] == 1 and m["llmd:requests_resumed_total"] == 0
