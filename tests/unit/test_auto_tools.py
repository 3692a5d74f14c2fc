"""`tool_choice: "auto"` through the model's configured tool parser, on the fake engine over real
HTTP with the official SDK. The fake's parser reads `<<name {json}>>` (llmd/backends/fake_tools.py);
a prompt's `[[say:...]]` makes the fake engine produce exactly that text, three characters a token."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from llmd.cli import main
from llmd.config import ConfigError, load_config
from llmd.node import build_node
from tests.conftest import LiveServer, fake_toml
from tests.unit.test_openai_features import FILTERED, TIME, WEATHER, batch_of_one

WITH_PARSER = fake_toml().replace("default_max_tokens = 16", 'default_max_tokens = 16\ntool_parser = "fake"')
PARIS = '<<get_weather {"city": "Paris", "days": 2}>>'
ROME = '<<get_time {"zone": "Europe/Rome"}>>'


def say(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"[[say:{text}]]"}]


def sdk(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key="unused", max_retries=0, timeout=30)


async def test_auto_reads_calls_and_text_whole(make_server) -> None:
    c = sdk(await make_server(WITH_PARSER))
    r = await c.chat.completions.create(model="fake", messages=say(f"Let me look. {PARIS}"), tools=[WEATHER, TIME],
                                        max_tokens=100)  # tool_choice unset: auto, as OpenAI's default
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me look."
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    # No call: the text is the answer, as without tools.
    r = await c.chat.completions.create(model="fake", messages=say("It is sunny."), tools=[WEATHER],
                                        tool_choice="auto", max_tokens=100)
    ch = r.choices[0]
    assert ch.message.content == "It is sunny." and not ch.message.tool_calls and ch.finish_reason == "stop"
    # Parallel calls; parallel_tool_calls false keeps the first.
    r = await c.chat.completions.create(model="fake", messages=say(PARIS + ROME), tools=[WEATHER, TIME],
                                        max_tokens=100)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    assert r.choices[0].message.content is None
    r = await c.chat.completions.create(model="fake", messages=say(PARIS + ROME), tools=[WEATHER, TIME],
                                        parallel_tool_calls=False, max_tokens=100)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]


async def test_auto_streams_tool_call_deltas(make_server) -> None:
    live = await make_server(WITH_PARSER)
    body = {"model": "fake", "messages": say(f"Sure. {PARIS}{ROME}"), "tools": [WEATHER, TIME], "max_tokens": 100,
            "stream": True}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/chat/completions", json=body)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "  # nothing of the calls leaks as text
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["index"], tc["type"], tc["function"]["name"]) for tc in calls] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(tc["id"].startswith("call_") for tc in calls)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The SDK accumulates the same deltas into the same calls.
    async with sdk(live).beta.chat.completions.stream(model="fake", messages=say(f"Sure. {PARIS}"),
                                                      tools=[WEATHER], max_tokens=100) as s:
        done = await s.get_final_completion()
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert done.choices[0].finish_reason == "tool_calls"
    # No call: plain content deltas (a `<` that could begin a call goes out once it does not) and stop.
    async with sdk(live).beta.chat.completions.stream(model="fake", messages=say("It is <sunny>."),
                                                      tools=[WEATHER], max_tokens=100) as s:
        done = await s.get_final_completion()
    assert done.choices[0].message.content == "It is <sunny>." and done.choices[0].finish_reason == "stop"
    assert not done.choices[0].message.tool_calls


async def test_each_of_n_choices_is_read_on_its_own(make_server) -> None:
    c = sdk(await make_server(WITH_PARSER))
    r = await c.chat.completions.create(model="fake", messages=say(PARIS), tools=[WEATHER], n=3, max_tokens=100)
    assert [ch.finish_reason for ch in r.choices] == ["tool_calls"] * 3
    ids = [ch.message.tool_calls[0].id for ch in r.choices]
    assert len(set(ids)) == 3
    stream = await c.chat.completions.create(model="fake", messages=say(PARIS), tools=[WEATHER], n=2,
                                             max_tokens=100, stream=True)
    named: dict[int, list[str]] = {0: [], 1: []}
    async for chunk in stream:
        for ch in chunk.choices:
            named[ch.index] += [tc.function.name for tc in ch.delta.tool_calls or () if tc.function.name]
    assert named == {0: ["get_weather"], 1: ["get_weather"]}


async def test_output_filters_screen_what_the_parser_reads(make_server) -> None:
    toml = FILTERED.replace("default_max_tokens = 16", 'default_max_tokens = 16\ntool_parser = "fake"')
    c = sdk(await make_server(toml))
    text = 'Mailing bob@example.com <<send {"to": "bob@example.com"}>>'
    r = await c.chat.completions.create(model="fake", messages=say(text), tools=[WEATHER], max_tokens=100)
    ch = r.choices[0]
    assert "bob@" not in ch.message.content and "[REDACTED" in ch.message.content
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"to": "[REDACTED:email]"}
    stream = await c.chat.completions.create(model="fake", messages=say(text), tools=[WEATHER], max_tokens=100,
                                             stream=True)
    said = [json.dumps(chunk.model_dump()) async for chunk in stream]
    assert "bob@" not in "".join(said) and "REDACTED:email" in "".join(said)


async def test_idempotent_replay_and_batch_take_auto(make_server) -> None:
    live = await make_server(WITH_PARSER)
    c = sdk(live)
    kw = {"model": "fake", "messages": say(PARIS), "tools": [WEATHER], "max_tokens": 100,
          "extra_headers": {"Idempotency-Key": "auto-tools"}}
    first = await c.chat.completions.create(**kw)
    again = await c.chat.completions.create(**kw)
    assert again.model_dump() == first.model_dump() and first.choices[0].message.tool_calls
    assert len(live.backend().submitted) == 1
    out = await batch_of_one(c, {"model": "fake", "messages": say(PARIS), "tools": [WEATHER], "max_tokens": 100})
    choice = out["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather")


async def test_auto_without_a_parser_is_a_400_that_says_how_to_configure_one(make_server) -> None:
    live = await make_server(fake_toml())
    with pytest.raises(openai.BadRequestError) as e:
        await sdk(live).chat.completions.create(model="fake", messages=say(PARIS), tools=[WEATHER])
    err = e.value.body
    assert err["param"] == "tool_choice" and err["code"] == "tool_choice_unsupported"
    assert "tool_parser" in err["message"] and "'fake'" in err["message"]
    assert live.backend().submitted == []  # refused before any engine time


async def test_auto_with_malformed_tools_is_a_400_naming_them(make_server) -> None:
    live = await make_server(WITH_PARSER)
    async with httpx.AsyncClient(base_url=live.base) as h:
        for tools in ([{"type": "function"}], [{"type": "function", "function": {"name": 3}}], "get_weather"):
            r = await h.post("/chat/completions", json={"model": "fake", "messages": say(PARIS), "tools": tools})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools"), (tools, r.text)
    assert live.backend().submitted == []


def test_an_unknown_tool_parser_is_a_start_up_error_naming_key_and_file(tmp_path: Path) -> None:
    p = tmp_path / "llmd.toml"
    p.write_text(WITH_PARSER.replace('tool_parser = "fake"', 'tool_parser = "hermes"'))
    with pytest.raises(ConfigError) as e:
        build_node(load_config(p))
    assert str(p) in str(e.value) and "models[0].tool_parser (model 'fake')" in str(e.value)
    assert "unknown tool parser 'hermes'" in str(e.value) and "has: fake" in str(e.value)
    r = CliRunner().invoke(main, ["serve", "--config", str(p)])
    assert r.exit_code != 0 and "models[0].tool_parser" in r.output and str(p) in r.output
    assert "Traceback" not in r.output
