"""The HTTP layer with the fake backend: real sanic over loopback, the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.conftest import LiveServer, async_wait_until, fake_toml

MSG = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def sdk(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)


async def test_chat_and_completion_shapes(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    r = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=7)
    assert r.object == "chat.completion" and r.model == "fake@fake-fake"  # name@version that served it
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == live.backend().render_chat([{"role": "user", "content": "hello there"}]).num_tokens
    again = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=7)
    assert again.choices[0].message.content == r.choices[0].message.content  # deterministic double
    cr = await c.completions.create(model="fake", prompt="say [[eos:3]]", max_tokens=50)
    assert cr.choices[0].finish_reason == "stop" and cr.usage.completion_tokens == 3
    # vLLM's extensions, as `vllm bench serve` sends them.
    cr = await c.completions.create(model="fake", prompt="say [[eos:3]]", max_tokens=50,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "top_k": -1})
    assert cr.choices[0].finish_reason == "length" and cr.usage.completion_tokens == 50


async def test_stream_with_usage(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    full = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=12)
    chunks = [ch async for ch in await c.chat.completions.create(
        model="fake", messages=MSG, max_tokens=12, stream=True, stream_options={"include_usage": True})]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


async def test_plain_stream_sends_only_data_lines(make_server) -> None:
    live = await make_server(fake_toml())
    async with httpx.AsyncClient(base_url=live.base) as h:
        r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 4, "stream": True})
    lines = [x for x in r.text.splitlines() if x]
    assert lines and all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"


async def test_models_health_ready(make_server) -> None:
    live = await make_server(fake_toml())
    async with httpx.AsyncClient(base_url=live.url) as h:
        assert (await h.get("/health")).json() == {"status": "ok"}
        ready = (await h.get("/ready")).json()
        assert ready["ready"] and ready["models"]["fake"]["ready"]
        assert [m["id"] for m in (await h.get("/v1/models")).json()["data"]] == ["fake"]
        r = await h.get("/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "fake", "messages": MSG, "n": 0}, "n", "invalid_value"),
        ({"model": "fake", "messages": MSG, "n": 99}, "n", "invalid_value"),
        ({"model": "fake", "messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function",
         "missing_required_parameter"),
        ({"model": "fake", "messages": MSG, "tools": [TOOL]}, "tool_choice", "tool_choice_unsupported"),
        ({"model": "fake", "messages": MSG, "tool_choice": "required"}, None, "invalid_value"),
        ({"model": "fake", "messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function",
          "function": {"name": "nope"}}}, None, "invalid_value"),
        ({"model": "fake", "messages": MSG, "top_logprobs": 3}, None, "invalid_value"),
        ({"model": "fake", "messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"model": "fake", "messages": MSG, "response_format": {"type": "json_schema"}}, "response_format",
         "invalid_value"),
        ({"model": "fake", "messages": MSG, "response_format": {"type": "xml"}}, "response_format.type",
         "invalid_value"),
        ({"model": "fake", "messages": MSG, "logit_bias": {"many": 1}}, "logit_bias", None),
        ({"model": "fake", "messages": MSG, "logit_bias": {"1": 500}}, "logit_bias.1", "invalid_value"),
        # Unknown fields: ignored by default, refused in strict mode (tests/unit/test_unknown_fields.py).
        ({"model": "fake", "messages": [{"role": "user", "content": "x", "frobnicate": 1}]}, "messages[0].frobnicate",
         "unknown_parameter"),
        ({"model": "fake", "messages": MSG, "max_tokens": "ten"}, "max_tokens", "invalid_value"),
        ({"model": "fake", "messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "fake", "messages": MSG, "temperature": "hot"}, "temperature", "invalid_value"),
        ({"model": "fake", "messages": MSG, "stream": "yes"}, "stream", "invalid_value"),
        ({"model": "fake", "messages": MSG, "stream_options": {"include_usage": True}}, "stream_options", None),
        ({"model": "fake", "messages": []}, "messages", "invalid_value"),
        ({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": MSG}, "model", "missing_required_parameter"),
        ({"model": "fake", "messages": MSG, "stop": list("abcdefghijklmnopq")}, "stop", "invalid_value"),
    ],
)
async def test_bad_parameters_get_clear_400s(make_server, body, param, code) -> None:
    live = await make_server(fake_toml())
    async with httpx.AsyncClient(base_url=live.base) as h:
        r = await h.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"
    assert err["message"]


async def test_malformed_requests(make_server) -> None:
    live = await make_server(fake_toml().replace("[server]", "[server]\nmax_body_bytes = 2000"))
    async with httpx.AsyncClient(base_url=live.url) as h:
        for raw in (b"", b"{not json", b"[1, 2]", b'"just a string"'):
            r = await h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json(), raw
        r = await h.post("/v1/completions", json={"model": "fake", "prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await h.get("/v1/nowhere")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        r = await h.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()
        r = await h.post("/v1/completions", json={"model": "fake", "prompt": ["a", ""]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
        r = await h.post("/v1/completions", json={"model": "fake", "prompt": "a", "best_of": 3})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        assert "n choices" in r.json()["error"]["message"]
        r = await h.post("/v1/completions", json={"model": "fake", "prompt": "a"},
                         headers={"X-Request-Timeout": "soon"})
        assert r.status_code == 400 and "X-Request-Timeout" in r.json()["error"]["message"]
        assert r.headers["x-request-id"].startswith("req-")


async def test_output_token_limits_reject_and_clamp(make_server) -> None:
    toml = fake_toml().replace("max_output_tokens = 4096", "max_output_tokens = 20")
    live = await make_server(toml)
    with pytest.raises(openai.BadRequestError) as e:
        await sdk(live).completions.create(model="fake", prompt="hi", max_tokens=21)
    assert e.value.code == "max_tokens_exceeded"
    live2 = await make_server(toml.replace('backend = "fake"', 'backend = "fake"\noutput_tokens_policy = "clamp"'))
    r = await sdk(live2).completions.create(model="fake", prompt="hi", max_tokens=500)
    assert r.usage.completion_tokens == 20


async def test_context_window_is_checked_before_the_engine(make_server) -> None:
    toml = (fake_toml().replace("max_model_len = 4096", "max_model_len = 64")
            .replace("max_output_tokens = 4096", "max_output_tokens = 60")
            .replace("default_max_tokens = 16", "default_max_tokens = 8"))
    live = await make_server(toml)
    c = sdk(live)
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model="fake", prompt="word " * 40, max_tokens=40)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model="fake", prompt="word " * 100)
    assert e.value.code == "context_length_exceeded"
    assert live.backend().submitted == []
    # Without max_tokens the default is cut to what still fits.
    r = await c.completions.create(model="fake", prompt="word " * 58)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 64


async def test_deadline_passed_while_waiting_never_reaches_engine(make_server, records) -> None:
    live = await make_server(fake_toml(max_running=1, step_ms=5))
    c = sdk(live)
    hog = asyncio.create_task(c.completions.create(model="fake", prompt="long", max_tokens=400))
    assert await async_wait_until(lambda: len(live.backend().submitted) == 1)
    async with httpx.AsyncClient(base_url=live.base) as h:
        r = await h.post("/completions", json={"model": "fake", "prompt": "quick", "max_tokens": 5},
                         headers={"X-Request-Timeout": "0.3", "X-Request-ID": "late-one"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert "not run" in r.json()["error"]["message"]
    late = next(r for r in records if r["client_request_id"] == "late-one")
    assert late["decision"] == "dropped:deadline" and late["status"] == "deadline"
    submitted = live.backend().submitted
    assert len(submitted) == 1 and not any(s.startswith(late["request_id"]) for s in submitted)
    assert len(live.runtime("fake").queue) == 0
    hog.cancel()


async def test_deadline_mid_stream_sends_terminal_error_event(make_server) -> None:
    live = await make_server(fake_toml(step_ms=10))
    body = {"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
    async with (
        httpx.AsyncClient(base_url=live.base, timeout=10) as h,
        h.stream("POST", "/completions", json=body, headers={"X-Request-Timeout": "0.5"}) as r,
    ):
        assert r.status_code == 200
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "deadline_exceeded"
    assert len(events) > 5  # tokens flowed before the deadline
    assert await async_wait_until(lambda: len(live.backend().aborted) == 1)


async def test_deadline_non_streaming_504(make_server) -> None:
    live = await make_server(fake_toml(step_ms=10))
    with pytest.raises(openai.APIStatusError) as e:
        await sdk(live).completions.create(model="fake", prompt="x", max_tokens=1000,
                                           extra_headers={"X-Request-Timeout": "0.3"})
    assert e.value.status_code == 504
    assert await async_wait_until(lambda: len(live.backend().aborted) == 1)


async def test_client_disconnect_aborts_engine_request(make_server) -> None:
    live = await make_server(fake_toml(step_ms=10))
    be = live.backend()
    body = {"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
    async with (
        httpx.AsyncClient(base_url=live.base, timeout=10) as h,
        h.stream("POST", "/completions", json=body) as r,
    ):
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n == 5:
                break
    assert await async_wait_until(lambda: len(be.aborted) == 1, 5)
    t_abort = time.time()
    await asyncio.sleep(0.2)
    assert be.stats.running == 0
    assert all(s.running == 0 for s in be.stats.history if s.t > t_abort)


async def test_engine_death_mid_stream_and_after(make_server) -> None:
    """With restarts off, a dead engine stays dead (tests/unit/test_supervisor.py: rebuilt)."""
    live = await make_server(fake_toml(step_ms=10, restart_attempts=0))
    be = live.backend()
    body = {"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}
    async with (
        httpx.AsyncClient(base_url=live.base, timeout=10) as h,
        h.stream("POST", "/completions", json=body) as r,
    ):
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    be.kill()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
    async with httpx.AsyncClient(base_url=live.url) as h:
        r = await h.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "engine_unhealthy"
        assert (await h.get("/ready")).status_code == 503
