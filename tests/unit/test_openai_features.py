"""What `vllm serve` clients send, on the fake engine: n choices, several prompts, logprobs,
echo, structured outputs, tools, continuous usage. The official SDK is the client; every
request still ends in exactly one ledger row."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import LiveServer, async_wait_until, fake_toml

MSG = [{"role": "user", "content": "hello there"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
FILTERED = fake_toml().replace("[models.scheduling]", """[models.filters]
output = ["pii"]
[models.scheduling]""") + """
[[filters]]
name = "pii"
type = "pii"
action = "redact"
"""


def sdk(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)


async def rows(live: LiveServer) -> list[dict]:
    await live.node.ledger.flush()
    return await live.node.ledger.rows(None, 1000, None)


async def test_n_choices_each_a_sequence_usage_summed(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    r = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=6, n=3, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.finish_reason == "length" for ch in r.choices) and r.usage.completion_tokens == 18
    assert len(live.backend().submitted) == 3  # each choice its own engine request
    stream = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=5, n=2, stream=True,
                                             stream_options={"include_usage": True})
    text: dict[int, str] = {0: "", 1: ""}
    finished = set()
    async for chunk in stream:
        for ch in chunk.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
        usage = chunk.usage
    assert finished == {0, 1} and all(text.values()) and usage is not None and usage.completion_tokens == 10
    got = await rows(live)
    assert [g["output_tokens"] for g in got] == [18, 10] or sorted(g["output_tokens"] for g in got) == [10, 18]


async def test_several_prompts_and_n_index_as_openai_does(make_server) -> None:
    live = await make_server(fake_toml())
    tok = live.backend().tokenizer
    r = await sdk(live).completions.create(model="fake", prompt=[tok.encode("one"), tok.encode("two three")],
                                           max_tokens=3, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tok.encode("one")) + len(tok.encode("two three"))  # each prompt once
    assert r.usage.completion_tokens == 12


async def test_chat_logprobs_one_per_token_with_alternatives(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    r = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == r.choices[0].message.content
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob for e in content)
    stream = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=5, logprobs=True, stream=True)
    streamed = [e async for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]


async def test_echo_with_logprobs_scores_the_prompt(make_server) -> None:
    """What log-likelihood harnesses send: token ids, echo, logprobs, max_tokens 1."""
    live = await make_server(fake_toml())
    ids = live.backend().tokenizer.encode("The capital of France is Paris")
    r = await sdk(live).completions.create(model="fake", prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                           temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert r.choices[0].text.startswith("The capital of France is Paris")
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len("The capital of France is Paris")


async def test_echo_with_max_tokens_0_scores_the_prompt_only(make_server) -> None:
    """vLLM's (and older OpenAI's) way to score a prompt: echo, logprobs, max_tokens 0."""
    live = await make_server(fake_toml())
    tok = live.backend().tokenizer
    ids = tok.encode("The capital of France is Paris")
    c = sdk(live)
    r = await c.completions.create(model="fake", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model="fake", prompt="x", max_tokens=0)
    assert "echo" in e.value.message


async def test_json_schema_output_validates(make_server) -> None:
    class City(BaseModel):
        name: str
        population: int
        capital: bool

    live = await make_server(fake_toml())
    c = sdk(live)
    parsed = await c.chat.completions.parse(model="fake", messages=MSG, response_format=City, max_tokens=200)
    assert isinstance(parsed.choices[0].message.parsed, City)
    r = await c.chat.completions.create(model="fake", messages=MSG, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:  # a schema the engine refuses: before any queueing
        await c.chat.completions.create(model="fake", messages=MSG, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})
    assert e.value.body["param"] == "response_format" and live.backend().submitted[-1:] != []
    assert len(live.backend().submitted) == 2


async def test_named_and_required_tool_calls(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    r = await c.chat.completions.create(model="fake", messages=MSG, tools=[WEATHER, TIME], max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = await c.chat.completions.create(model="fake", messages=MSG, tools=[WEATHER, TIME], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    # Streamed: the SDK accumulates the deltas into the same call.
    async with c.beta.chat.completions.stream(model="fake", messages=MSG, tools=[WEATHER], max_tokens=200,
                                              tool_choice={"type": "function",
                                                           "function": {"name": "get_weather"}}) as s:
        done = await s.get_final_completion()
    streamed = done.choices[0].message.tool_calls[0]
    assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments)["city"]
    # The conversation goes on with the tool's answer.
    asked = {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.function.arguments}}
    follow = [*MSG, {"role": "assistant", "content": None, "tool_calls": [asked]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = await c.chat.completions.create(model="fake", messages=follow, max_tokens=4)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"


async def test_continuous_usage_in_every_chunk(make_server) -> None:
    live = await make_server(fake_toml())
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 4, "stream": True,
                                               "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all("usage" in ch for ch in chunks)
    assert [ch["usage"]["completion_tokens"] for ch in chunks][-1] == 4


async def test_logprobs_never_say_what_a_filter_redacted(make_server) -> None:
    live = await make_server(FILTERED)
    r = await sdk(live).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "[[say:mail bob@example.com now]]"}], max_tokens=40,
        logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    assert "bob@" not in text and "[REDACTED" in text
    said = "".join(e.token + "".join(t.token for t in e.top_logprobs) for e in r.choices[0].logprobs.content)
    assert "bob" not in said and "example" not in said


async def test_quota_reserves_every_choice_and_cancel_aborts_them_all(make_server) -> None:
    live = await make_server(fake_toml(step_ms=20))
    c = sdk(live)
    stream = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=500, n=3, stream=True)
    await anext(aiter(stream))
    await stream.close()  # the client goes away
    assert await async_wait_until(lambda: len(live.backend().aborted) == 3)
    got = await rows(live)
    assert len(got) == 1 and got[0]["status"] == "cancelled"


async def batch_of_one(c: openai.AsyncOpenAI, body: dict) -> dict:
    """A Batch API run of one chat body, to completion; its output line."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    f = await c.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for _ in range(200):
        b = await c.batches.retrieve(b.id)
        if b.status == "completed":
            break
        await asyncio.sleep(0.05)
    assert b.output_file_id, b
    return json.loads((await c.files.content(b.output_file_id)).text)


async def test_batch_api_takes_the_same_bodies(make_server, tmp_path) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    out = await batch_of_one(c, {"model": "fake", "messages": MSG, "max_tokens": 3, "n": 2, "logprobs": True})
    assert len(out["response"]["body"]["choices"]) == 2 and out["response"]["body"]["usage"]["completion_tokens"] == 6


async def test_an_idempotent_retry_replays_the_same_choices(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    kw = {"model": "fake", "messages": MSG, "max_tokens": 4, "n": 3, "logprobs": True,
          "extra_headers": {"Idempotency-Key": "three-choices"}}
    first = await c.chat.completions.create(**kw)
    again = await c.chat.completions.create(**kw)
    assert again.model_dump() == first.model_dump() and len(again.choices) == 3
    assert len(live.backend().submitted) == 3  # generated once, three choices
    assert len(await rows(live)) == 1
