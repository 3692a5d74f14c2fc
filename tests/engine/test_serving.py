"""The serving path on the real vLLM engine and the stored SmolLM2 model, through the
official openai SDK over loopback HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import TypeVar

import httpx
import openai
import pytest

from tests.conftest import EngineServer, wait_until

pytestmark = pytest.mark.engine

T = TypeVar("T")

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(engine_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.base, api_key="unused", max_retries=0, timeout=60)


def test_chat_answers_a_factual_question(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.role == "assistant"
    assert r.model.startswith("smollm2@")  # name@version that served it
    # 37 = SmolLM2's chat template with its default system prompt around this question.
    assert r.usage.prompt_tokens == 37
    assert 0 < r.usage.completion_tokens < 30
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=30)
    stream = client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=30,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            if c.delta.role:
                roles.append(c.delta.role)
    assert text == full.choices[0].message.content
    assert finish == "stop" and roles == ["assistant"]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == 37


def test_completion_length_and_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert "Paris" in r.choices[0].text
    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_vllm_extensions_pass_through(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=40,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "top_k": -1})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40


def test_stop_string(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", temperature=0, max_tokens=30, stop=[" 6"])
    assert r.choices[0].finish_reason == "stop"
    assert " 6" not in r.choices[0].text and "5" in r.choices[0].text


def test_models_list_and_unknown_model(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CAPITAL)
    assert e.value.code == "model_not_found"


def test_over_long_prompt_is_refused_before_the_engine(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        # 1,300 tokens in 7,800 bytes: under the byte bound (8 per token of the limit), over the tokens
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hello " * 1300}])
    assert e.value.code == "context_length_exceeded"
    assert "1000 tokens" in e.value.message  # the configured max_prompt_tokens, counted by the model's tokenizer
    with pytest.raises(openai.BadRequestError) as e:  # far over: refused on its bytes, before any tokenizing
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hello " * 2000}])
    assert e.value.code == "context_length_exceeded" and "8000 bytes" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="hi", max_tokens=5000)
    assert e.value.code == "max_tokens_exceeded"


def test_bad_json_and_bad_types(engine_server: EngineServer, client: openai.OpenAI) -> None:
    url = engine_server.base + "/chat/completions"
    r = httpx.post(url, content=b'{"model": "smollm2", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json" and r.headers["x-request-id"]
    r = httpx.post(url, json={"model": "smollm2", "messages": CAPITAL, "max_tokens": "ten"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url, json={"model": "smollm2", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=CAPITAL, n=10_000)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=5)
    assert e.value.param == "temperature"


def _running_steps(stats: dict) -> list[dict]:
    return [h for h in stats["history"] if h["running"] > 0]


def test_disconnect_mid_stream_stops_the_engine_within_two_steps(engine_server: EngineServer) -> None:
    assert wait_until(lambda: engine_server.engine_stats()["running"] == 0, 30)
    t_start = time.time()
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 800, "temperature": 0, "stream": True}
    got = 0
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", engine_server.base + "/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 10:
                    break
        t_close = time.time()
    time.sleep(1.5)
    before = _running_steps(engine_server.engine_stats(since=t_start))
    assert len([s for s in before if s["t"] < t_close]) >= 5, "the engine's own stats show it was computing"
    # What the step-time model reads: the step that finished the prompt's prefill counts its
    # tokens, and each decode step its duration (the engine core's own time between tokens).
    assert any(s["prefill_tokens"] > 0 for s in before)
    durations = sorted(s["duration"] for s in before if s["duration"] > 0)
    assert len(durations) >= 5 and 0.001 < durations[len(durations) // 2] < 2.0
    after = _running_steps(engine_server.engine_stats(since=t_close))
    assert len(after) <= 2, f"engine kept computing for {len(after)} steps after the disconnect"
    assert engine_server.engine_stats()["running"] == 0
    # The request log records it as cancelled with the tokens actually produced.
    recs = [json.loads(line) for line in engine_server.log_lines() if '"event": "request"' in line]
    last = [r for r in recs if r["status"] == "cancelled"][-1]
    assert last["http_status"] == 499 and 10 <= last["output_tokens"] < 800


def test_disconnect_non_streaming_aborts_too(engine_server: EngineServer) -> None:
    assert wait_until(lambda: engine_server.engine_stats()["running"] == 0, 30)
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 800, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(engine_server.base + "/completions", json=body, timeout=1.0)
    t_close = time.time()
    time.sleep(1.5)
    assert len(_running_steps(engine_server.engine_stats(since=t_close))) <= 2


def drain(stream: Iterable[T], into: list[T]) -> None:
    """Read a stream to its end into `into`, keeping what arrived if it ends with an exception."""
    for item in stream:
        into.append(item)  # noqa: PERF402 -- one by one, so what arrived before the error is kept


def test_deadline_mid_stream_ends_with_error_event(engine_server: EngineServer, client: openai.OpenAI) -> None:
    chunks: list[openai.types.Completion] = []
    t0 = time.monotonic()
    stream = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=1000,
                                       temperature=0, stream=True, extra_headers={"X-Request-Timeout": "1.5"})
    with pytest.raises(openai.APIError) as e:
        drain(stream, chunks)
    assert time.monotonic() - t0 < 10
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text, "tokens were delivered before the deadline"
    assert "deadline" in str(e.value.message)
    assert wait_until(lambda: engine_server.engine_stats()["running"] == 0, 5)


def test_deadline_non_streaming_is_504(engine_server: EngineServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=1000, temperature=0,
                                  extra_headers={"X-Request-Timeout": "1"})
    assert e.value.status_code == 504 and e.value.code == "deadline_exceeded"
    assert wait_until(lambda: engine_server.engine_stats()["running"] == 0, 5)


def test_request_id_and_log_record(engine_server: EngineServer) -> None:
    r = httpx.post(engine_server.base + "/chat/completions", headers={"X-Request-ID": "trace-abc-123"},
                   json={"model": "smollm2", "messages": CAPITAL, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc-123"
    version = httpx.get(engine_server.url + "/ready").json()["models"]["smollm2"]["version"]
    assert r.headers["x-llmd-model-version"] == version
    assert wait_until(lambda: any("trace-abc-123" in line for line in engine_server.log_lines()), 5)
    rec = next(json.loads(line) for line in engine_server.log_lines() if "trace-abc-123" in line)
    for key in ("request_id", "model", "version", "prompt_tokens", "output_tokens", "queue_time_s", "ttft_s",
                "total_time_s", "finish_reason", "status"):
        assert key in rec
    assert rec["output_tokens"] == 5 and rec["finish_reason"] == "length" and rec["status"] == "ok"
    assert rec["ttft_s"] is not None and rec["ttft_s"] <= rec["total_time_s"]
