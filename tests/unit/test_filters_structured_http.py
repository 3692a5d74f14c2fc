"""Output filters under structured outputs, end to end on the fake engine with the official SDK:
whatever the filters do, a constrained response stays valid JSON that conforms (a redaction only
inside a free string value), or the choice stops with finish_reason content_filter (and, streamed,
the terminal event), never a byte of the match sent. Chat and completions, streamed and not, n=2,
named and required tools, the Batch API. A prompt's `[[say:...]]` makes the fake emit exact JSON
under the grammar (llmd/backends/fake_outputs.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import openai
import pydantic
import pytest

from tests.conftest import LiveServer, fake_toml

# The shipped config's output filters (config.toml), on the fake engine.
TOML = fake_toml().replace("[models.scheduling]", """[models.filters]
output = ["blocklist", "pii", "loops"]
holdback_tokens = 32
[models.scheduling]""") + """
[[filters]]
name = "blocklist"
type = "blocklist"
words = ["example banned phrase"]
[[filters]]
name = "pii"
type = "pii"
kinds = ["phone", "card", "secret"]
action = "redact"
[[filters]]
name = "loops"
type = "degenerate"
min_repeats = 8
"""
PHONE = "555-123-4567"


class City(pydantic.BaseModel):
    name: str
    population_millions: float
    kind: Literal["city", "town"]
    code: int = 0


SCHEMA = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True}}
GOOD = {"name": f"Call {PHONE} for tours", "population_millions": 8.3360001234, "kind": "city"}
WANT = {**GOOD, "name": "Call [REDACTED:phone] for tours"}


def sdk(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)


def say(doc: Any) -> list[dict[str, str]]:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    if text.endswith("]"):
        text += "\n"  # the marker ends at the first "]]"
    return [{"role": "user", "content": f"[[say:{text}]]"}]


async def streamed(stream: Any) -> tuple[dict[int, str], dict[int, str | None], list[str], BaseException | None]:
    """(text per choice, finish_reason per choice, every chunk as JSON, the terminal error)."""
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    raw: list[str] = []
    try:
        async for chunk in stream:
            raw.append(json.dumps(chunk.model_dump()))
            for c in chunk.choices:
                piece = c.delta.content if hasattr(c, "delta") else c.text
                text[c.index] = text.get(c.index, "") + (piece or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
    except openai.APIError as e:
        return text, finish, raw, e
    return text, finish, raw, None


async def test_parse_gets_valid_json_with_the_phone_redacted_and_the_float_kept(make_server, records) -> None:
    c = sdk(await make_server(TOML))
    r = await c.chat.completions.parse(model="fake", messages=say(GOOD), response_format=City, max_tokens=200, n=2)
    assert [ch.message.parsed for ch in r.choices] == [City(**WANT)] * 2
    assert [ch.finish_reason for ch in r.choices] == ["stop", "stop"]
    assert records[-1]["redacted"] == "pii/phone" and records[-1]["status"] == "ok"


async def test_streamed_json_is_redacted_in_place(make_server) -> None:
    c = sdk(await make_server(TOML))
    stream = await c.chat.completions.create(model="fake", messages=say(GOOD), response_format=SCHEMA,
                                             max_tokens=200, n=2, stream=True)
    text, finish, raw, err = await streamed(stream)
    assert err is None and finish == {0: "stop", 1: "stop"}
    assert [json.loads(text[i]) for i in (0, 1)] == [WANT, WANT] and len(raw) > 10  # streamed in pieces
    assert "8.3360001234" in text[0]


@pytest.mark.parametrize(("doc", "leak"), [
    ({"name": "x", "population_millions": 1.5, "kind": "city", "code": 5551234567}, '"code": 5'),  # an integer
    ({"name": "x", "population_millions": 1.5, "kind": PHONE}, '"kind": "5'),  # an enum: no replacement is valid
])
async def test_a_match_that_cannot_be_redacted_stops_the_choice(make_server, records, doc: dict[str, Any],
                                                                 leak: str) -> None:
    live = await make_server(TOML)
    c = sdk(live)
    r = await c.chat.completions.create(model="fake", messages=say(doc), response_format=SCHEMA, max_tokens=200)
    body = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "content_filter" and leak not in body and body.startswith('{"name": "x"')
    assert records[-1]["status"] == "filtered" and records[-1]["filter"] == "pii/phone"
    stream = await c.chat.completions.create(model="fake", messages=say(doc), response_format=SCHEMA,
                                             max_tokens=200, stream=True)
    text, finish, raw, err = await streamed(stream)
    assert finish == {0: "content_filter"} and json.dumps(leak)[1:-1] not in "".join(raw)
    assert text[0].startswith('{"name": "x"') and leak not in text[0]
    assert isinstance(err, openai.APIError) and err.body["code"] == "content_filter"  # the terminal event


async def test_completions_with_json_object(make_server) -> None:
    c = sdk(await make_server(TOML))
    doc = {"note": f"dial {PHONE}", "items": [{"v": 8.3360001234}, {"w": f"or {PHONE}"}]}
    r = await c.completions.create(model="fake", prompt=say(doc)[0]["content"], max_tokens=200,
                                   extra_body={"response_format": {"type": "json_object"}})
    assert json.loads(r.choices[0].text) == {"note": "dial [REDACTED:phone]",
                                             "items": [{"v": 8.3360001234}, {"w": "or [REDACTED:phone]"}]}
    stream = await c.completions.create(model="fake", prompt=say(doc)[0]["content"], max_tokens=200, stream=True,
                                        extra_body={"response_format": {"type": "json_object"}})
    text, finish, _, err = await streamed(stream)
    assert err is None and json.loads(text[0]) == json.loads(r.choices[0].text) and finish == {0: "stop"}


DIAL = {"type": "function", "function": {"name": "dial", "parameters": {
    "type": "object", "properties": {"note": {"type": "string"}, "minutes": {"type": "number"}},
    "required": ["note", "minutes"]}}}


async def test_named_and_required_tools_keep_their_arguments_valid(make_server) -> None:
    c = sdk(await make_server(TOML))
    args = {"note": f"ring {PHONE}", "minutes": 5551234.567}
    named = await c.chat.completions.create(model="fake", messages=say(args), tools=[DIAL], max_tokens=200,
                                            tool_choice={"type": "function", "function": {"name": "dial"}})
    call = named.choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"note": "ring [REDACTED:phone]", "minutes": 5551234.567}
    req = [{"name": "dial", "parameters": args}]
    required = await c.chat.completions.create(model="fake", messages=say(req), tools=[DIAL], max_tokens=200,
                                               tool_choice="required", stream=True)
    _, finish, raw, err = await streamed(required)
    calls = [tc for line in raw for ch in json.loads(line)["choices"] for tc in ch["delta"].get("tool_calls") or []]
    assert err is None and finish == {0: "tool_calls"}
    assert json.loads(calls[0]["function"]["arguments"]) == {"note": "ring [REDACTED:phone]", "minutes": 5551234.567}
    pinned = await c.chat.completions.create(model="fake", messages=say([{"name": PHONE, "parameters": args}]),
                                             tools=[DIAL], max_tokens=200, tool_choice="required")
    assert pinned.choices[0].finish_reason == "content_filter"  # a tool's name is an enum


async def test_the_batch_api_gets_the_same_arbiter(make_server) -> None:
    c = sdk(await make_server(TOML))
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "fake", "messages": say(GOOD), "response_format": SCHEMA, "max_tokens": 200, "n": 2}}
    f = await c.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for _ in range(400):
        b = await c.batches.retrieve(b.id)
        if b.status == "completed":
            break
        await asyncio.sleep(0.05)
    assert b.output_file_id, b
    out = json.loads((await c.files.content(b.output_file_id)).text)
    choices = out["response"]["body"]["choices"]
    assert [json.loads(ch["message"]["content"]) for ch in choices] == [WANT, WANT]


async def test_auto_tool_calls_have_their_arguments_screened_as_json(make_server) -> None:
    """`auto` (the fake's parser reads `<<name {json}>>`): the text around a call is redacted as any
    text, its arguments as JSON (a string in place, a quantity kept), an integer phone stops."""
    c = sdk(await make_server(TOML.replace("default_max_tokens = 16", 'default_max_tokens = 16\ntool_parser = "fake"')))
    text = f'Call {PHONE}. <<dial {{"note": "ring {PHONE}", "minutes": 8.3360001234}}>>'
    want = {"note": "ring [REDACTED:phone]", "minutes": 8.3360001234}
    for stream in (False, True):
        r = await c.chat.completions.create(model="fake", messages=say(text), tools=[DIAL], max_tokens=200,
                                            stream=stream)
        if stream:
            _, finish, raw, err = await streamed(r)
            deltas = [ch["delta"] for line in raw for ch in json.loads(line)["choices"]]
            content = "".join(d.get("content") or "" for d in deltas)
            args = "".join(tc["function"].get("arguments") or "" for d in deltas for tc in d.get("tool_calls") or [])
            assert err is None and finish == {0: "tool_calls"}
        else:
            msg = r.choices[0].message
            content, args = msg.content or "", msg.tool_calls[0].function.arguments
            assert r.choices[0].finish_reason == "tool_calls"
        assert content.strip() == "Call [REDACTED:phone]." and json.loads(args) == want
    r = await c.chat.completions.create(model="fake", messages=say('Sure. <<dial {"note": "x", "n": 5551234567}>>'),
                                        tools=[DIAL], max_tokens=200)
    assert r.choices[0].finish_reason == "content_filter" and "5551234567" not in json.dumps(r.model_dump())
