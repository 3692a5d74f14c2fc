"""What `vllm serve` clients rely on, through llmd on the real engine (SmolLM2), with the
official SDK: structured outputs, tool calls, logprobs that match `vllm serve`'s own for the
same request, n choices, and echo with prompt logprobs."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import EngineServer, PeerServer

pytestmark = pytest.mark.engine
MSG = [{"role": "user", "content": "Name a famous scientist and the year they were born."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}


class Scientist(BaseModel):
    """Bounded as a user's schema would be: at temperature 0.7 an unbounded string can run past any max_tokens."""

    name: str = Field(max_length=60)
    born: int = Field(ge=0, le=2100)


def client(srv: EngineServer | PeerServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=300)


async def test_json_schema_outputs_validate_100_of_100(engine_server: EngineServer) -> None:
    c = client(engine_server)
    schema = Scientist.model_json_schema()
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> dict:
        async with sem:
            r = await c.chat.completions.parse(model="smollm2", messages=MSG, response_format=Scientist,
                                               temperature=0.7, seed=i, max_tokens=300)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert isinstance(r.choices[0].message.parsed, Scientist)
        return json.loads(r.choices[0].message.content)

    got = await asyncio.gather(*(one(i) for i in range(100)))
    for obj in got:
        jsonschema.validate(obj, schema)
    assert len({json.dumps(o, sort_keys=True) for o in got}) > 1  # sampled, not one canned answer


async def test_a_bad_schema_is_a_400_naming_it(engine_server: EngineServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client(engine_server).chat.completions.create(
            model="smollm2", messages=MSG, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert e.value.body["param"] == "response_format" and "objekt" in e.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_tool_calls_parse_with_the_sdk(engine_server: EngineServer, stream: bool) -> None:
    c = client(engine_server)
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        if stream:
            async with c.beta.chat.completions.stream(model="smollm2", messages=ask, tools=[WEATHER],
                                                      tool_choice=choice, max_tokens=80, temperature=0) as s:
                r = await s.get_final_completion()
        else:
            r = await c.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER], tool_choice=choice,
                                                max_tokens=80, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


async def test_n_choices_and_usage_summed(engine_server: EngineServer) -> None:
    r = await client(engine_server).chat.completions.create(model="smollm2", messages=MSG, n=3, max_tokens=12,
                                                            temperature=1.0, seed=5, logprobs=True)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)
    assert len({ch.message.content for ch in r.choices}) > 1  # each choice its own sample


async def test_logprobs_match_vllm_serve(engine_server: EngineServer, vllm_server: PeerServer) -> None:
    """The same request, greedy, through llmd and through `vllm serve`: the same tokens with
    the same logprobs (float32 on a CPU: equal to within batch-order rounding)."""
    kw = {"model": "smollm2", "messages": MSG, "max_tokens": 12, "temperature": 0, "logprobs": True,
          "top_logprobs": 3}
    ours, theirs = await asyncio.gather(client(engine_server).chat.completions.create(**kw),
                                        client(vllm_server).chat.completions.create(**kw))
    a, b = ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content
    assert [e.token for e in a] == [e.token for e in b] and len(a) == 12
    for x, y in zip(a, b, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=2e-3)
        assert [t.token for t in x.top_logprobs][:1] == [t.token for t in y.top_logprobs][:1]
        assert [t.logprob for t in x.top_logprobs] == pytest.approx([t.logprob for t in y.top_logprobs], abs=2e-3)


async def test_echo_prompt_logprobs_match_vllm_serve(engine_server: EngineServer, vllm_server: PeerServer) -> None:
    """What lm-evaluation-harness sends for log-likelihood: token ids, echo, logprobs, max_tokens 1."""
    ids = [504, 3575, 282, 4649, 314, 7042]  # some SmolLM2 tokens
    kw = {"model": "smollm2", "prompt": [ids, ids[:4]], "max_tokens": 1, "temperature": 0, "echo": True,
          "logprobs": 1}
    ours, theirs = await asyncio.gather(client(engine_server).completions.create(**kw),
                                        client(vllm_server).completions.create(**kw))
    assert len(ours.choices) == 2
    for x, y in zip(ours.choices, theirs.choices, strict=True):
        assert x.text == y.text and x.logprobs.tokens == y.logprobs.tokens
        assert x.logprobs.token_logprobs[0] is None and y.logprobs.token_logprobs[0] is None
        assert x.logprobs.token_logprobs[1:] == pytest.approx(y.logprobs.token_logprobs[1:], abs=2e-3)
        assert x.logprobs.text_offset == y.logprobs.text_offset


async def test_a_seeded_request_whose_prefill_is_split_does_not_kill_the_engine(engine_server: EngineServer) -> None:
    """vLLM's CPU build rewinds a seeded request's generator when its prefill is split across
    steps, which a CPU generator cannot do: the engine died for everyone. Two ~700-token prompts
    in one 1024-token step split the second one's prefill."""
    c = client(engine_server)

    async def one(i: int) -> openai.types.Completion:
        prompt = f"Request {i}. " + " ".join(f"entry {k} of list {i}," for k in range(70))  # ~650 tokens
        return await c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0.8, seed=i)

    got = await asyncio.gather(*(one(i) for i in range(3)))
    assert all(r.choices[0].finish_reason == "length" for r in got)
    assert sum(r.usage.prompt_tokens for r in got[:2]) > 1024  # split, not fitted in one step
    async with httpx.AsyncClient() as h:
        ready = (await h.get(engine_server.url + "/ready")).json()
    assert ready["models"]["smollm2"]["restarts"] == 0 and ready["models"]["smollm2"]["engine"] == "up"
