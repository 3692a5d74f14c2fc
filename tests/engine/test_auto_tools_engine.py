"""tool_choice auto on the real engine, through vLLM's own tool parser. SmolLM2's chat template
knows no tools, so a few-shot conversation teaches it the pythonic format (`[name(arg="v")]`),
which vLLM's `pythonic` parser reads from the text alone: it needs no marker token in the
vocabulary (llama3_json's `<|python_tag|>` is not in SmolLM2's, and that parser refuses to load).
The shared engine config (tests/conftest.py) sets `tool_parser = "pythonic"`. At temperature 0
the 135M model copies the examples: a weather question becomes a call, anything else plain text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from llmd.backends import BackendError, unknown_tool_parser
from llmd.config import ModelConfig
from tests.conftest import EngineServer

pytestmark = pytest.mark.engine
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SYSTEM = ('You answer with a tool call when asked about the weather, written as a Python list: '
          '[get_weather(city="CITY")]. Anything else you answer in plain words.')
SHOTS = [("What is the weather in Paris?", '[get_weather(city="Paris")]'), ("Say hello.", "Hello!"),
         ("What is the weather in Rome?", '[get_weather(city="Rome")]'), ("Say thanks.", "Thanks!")]


def conversation(question: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for q, a in SHOTS:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [*msgs, {"role": "user", "content": question}]


def client(srv: EngineServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=300)


async def ask(srv: EngineServer, question: str, stream: bool) -> tuple[str | None, list[dict[str, Any]], str]:
    """(content, tool_calls as OpenAI dicts, finish_reason); a stream's deltas are checked and joined here."""
    kw: dict[str, Any] = {"model": "smollm2", "messages": conversation(question), "tools": [WEATHER],
                          "temperature": 0, "max_tokens": 40}
    c = client(srv)
    if not stream:
        ch = (await c.chat.completions.create(**kw)).choices[0]
        return ch.message.content, [t.model_dump() for t in ch.message.tool_calls or ()], ch.finish_reason
    content, calls, finish = "", {}, ""
    async for chunk in await c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                if tc.index not in calls:  # a call's first delta says who it is
                    assert tc.id and tc.type == "function" and tc.function and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "type": "function",
                                       "function": {"name": tc.function.name, "arguments": ""}}
                calls[tc.index]["function"]["arguments"] += (tc.function and tc.function.arguments) or ""
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_reads_the_models_call(engine_server: EngineServer, stream: bool) -> None:
    content, calls, finish = await ask(engine_server, "What is the weather in Tokyo?", stream)
    assert finish == "tool_calls" and not content  # nothing of the call comes back as text
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Tokyo"}


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_plain_answer_is_content(engine_server: EngineServer, stream: bool) -> None:
    content, calls, finish = await ask(engine_server, "Say good night.", stream)
    assert (content, calls, finish) == ("Good night!", [], "stop")


def test_the_names_and_the_vocabulary_are_checked(smollm2_path: Path) -> None:
    from llmd.backends.vllm_tools import checked_parser

    cfg = ModelConfig(name="smollm2", source="smollm2", tool_parser="pythonic")
    assert unknown_tool_parser(cfg) is None
    why = unknown_tool_parser(cfg.model_copy(update={"tool_parser": "pythonik"}))
    assert why is not None and "unknown tool parser 'pythonik'" in why and "pythonic" in why
    with pytest.raises(BackendError, match=r"tool_parser 'llama3_json'.*<\|python_tag\|>"):
        checked_parser("llama3_json", str(smollm2_path), False, "smollm2")
