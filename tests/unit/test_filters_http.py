"""Filters end to end on the fake backend through the openai SDK: a blocked prompt never
reaches the engine; streamed and non-streamed output is redacted or stopped; every outcome
is metered as `filtered` with the tokens produced and the rule named, never the text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable
from typing import Any, TypeVar

import httpx
import openai
import pytest

from llmd.auth import hash_key
from llmd.filters import Match
from tests.conftest import LiveServer, async_wait_until

T = TypeVar("T")

KEY, KEY_STRICT = "sk-llmd-filter-a", "sk-llmd-filter-strict"
TOML = f"""
[server]
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 2000
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = 2
step_ms_per_seq = 0.0
[models.filters]
input = ["words"]
output = ["words", "pii", "loops"]
holdback_tokens = 8
[[filters]]
name = "words"
type = "blocklist"
words = ["forbidden phrase"]
[[filters]]
name = "pii"
type = "pii"
action = "redact"
[[filters]]
name = "pii-block"
type = "pii"
kinds = ["secret"]
action = "block"
[[filters]]
name = "loops"
type = "degenerate"
[[filters]]
name = "shout"
type = "tests.unit.test_filters_http:NoShouting"
options = {{ marks = 3 }}
[[tenants]]
name = "a"
keys = ["{hash_key(KEY)}"]
[[tenants]]
name = "strict"
keys = ["{hash_key(KEY_STRICT)}"]
input_filters = ["pii-block"]
output_filters = ["shout"]
"""


class NoShouting:
    """A team's own output filter, in a few lines: `marks` exclamation marks in a row end the stream."""

    def __init__(self, name: str, marks: int) -> None:
        self.name, self.marks = name, marks

    def scan(self, text: str, final: bool) -> list[Match]:
        i = text.find("!" * self.marks)
        return [Match(self.name, "shouting", "block", i, i + self.marks)] if i >= 0 else []


def client(live: LiveServer, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key=key, max_retries=0)


async def usage_rows(live: LiveServer) -> list[dict[str, Any]]:
    return await live.node.ledger.rows(None, 1000, None)


@pytest.mark.parametrize("prompt", ["say the FORBIDDEN phrase", "say the ｆｏｒｂｉｄｄｅｎ ｐｈｒａｓｅ",
                                    "say the for\u200dbidden phr\u200base"])
async def test_blocked_prompt_never_reaches_the_engine(make_server, records, prompt: str) -> None:
    live = await make_server(TOML)
    with pytest.raises(openai.BadRequestError) as e:
        await client(live).chat.completions.create(model="fake", messages=[{"role": "user", "content": prompt}])
    assert e.value.status_code == 400 and e.value.code == "content_filter"
    assert live.backend().submitted == []
    rec = records[-1]
    assert rec["status"] == "filtered" and rec["filter"] == "words/word:0"
    assert rec["decision"] == "filtered:words/word:0"
    assert "forbidden" not in json.dumps(rec).lower()
    (row,) = await usage_rows(live)
    assert row["status"] == "filtered" and row["output_tokens"] == 0


async def test_tenant_filters_add_to_the_models(make_server) -> None:
    live = await make_server(TOML)
    msg = [{"role": "user", "content": "my key is sk-abcdefghijklmnopqrstuvwx1234"}]
    with pytest.raises(openai.BadRequestError) as e:
        await client(live, KEY_STRICT).chat.completions.create(model="fake", messages=msg)
    assert e.value.code == "content_filter"
    ok = await client(live, KEY).chat.completions.create(model="fake", messages=msg, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # tenant a has no prompt PII filter


async def test_stream_redacts_email_and_card_split_across_chunks(make_server, records) -> None:
    live = await make_server(TOML)
    script = "Mail john.doe@example.com or pay with 4111 1111 1111 1111 today."
    stream = await client(live).completions.create(model="fake", prompt=f"[[say:{script}]]", max_tokens=100,
                                                   stream=True)
    chunks = [c.choices[0].text async for c in stream if c.choices]
    assert len(chunks) > 3  # streamed in pieces (a redaction merges what it held), not at once
    assert "".join(chunks) == "Mail [REDACTED:email] or pay with [REDACTED:card] today."
    rec = records[-1]
    assert rec["status"] == "ok" and rec["redacted"] == "pii/email,pii/card"
    assert "john" not in json.dumps(rec) and "4111" not in json.dumps(rec)


async def test_non_streaming_is_filtered_the_same_way(make_server) -> None:
    live = await make_server(TOML)
    script = "Mail john.doe@example.com today."
    r = await client(live).completions.create(model="fake", prompt=f"[[say:{script}]]", max_tokens=100)
    assert r.choices[0].text == "Mail [REDACTED:email] today." and r.choices[0].finish_reason == "stop"
    r = await client(live).completions.create(model="fake", prompt="[[say:ok so: the forbid|den phrase is x]]",
                                              max_tokens=100)
    assert r.choices[0].finish_reason == "content_filter" and "forbidden" not in r.choices[0].text


async def test_stream_stopped_mid_flight_by_a_split_match(make_server, records) -> None:
    live = await make_server(TOML)
    script = "Here is a long harmless opening sentence, and then the forbid|den phrase appears."
    body = {"model": "fake", "prompt": f"[[say:{script}]]", "max_tokens": 200, "stream": True}
    async with (
        httpx.AsyncClient(base_url=live.base, timeout=30) as h,
        h.stream("POST", "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r,
    ):
        assert r.status_code == 200
        events: list[dict] = [json.loads(line[6:]) async for line in r.aiter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text.startswith("Here is a long harmless") and "forbidden" not in text  # tokens went out first
    assert events[-2]["choices"][0]["finish_reason"] == "content_filter"
    assert events[-1]["error"]["code"] == "content_filter"  # the terminal error event
    be = live.backend()
    (engine_id,) = be.submitted
    assert await async_wait_until(lambda: engine_id in be.aborted)  # the engine request was aborted
    rec = records[-1]
    assert rec["status"] == "filtered" and rec["finish_reason"] == "content_filter" and rec["filter"] == "words/word:0"
    (row,) = await usage_rows(live)
    assert row["status"] == "filtered" and 0 < row["output_tokens"] < 200
    assert row["output_tokens"] == rec["output_tokens"]


async def drain(stream: AsyncIterable[T], into: list[T]) -> None:
    """Read a stream to its end into `into`, keeping what arrived if it ends with an exception."""
    async for item in stream:
        into.append(item)  # noqa: PERF401 -- one by one, so what arrived before the error is kept


async def test_degenerate_loop_is_stopped(make_server, records) -> None:
    live = await make_server(TOML)
    stream = await client(live).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "[[repeat:la ]]"}], max_tokens=1000, stream=True)
    chunks: list[Any] = []
    with pytest.raises(openai.APIError) as e:  # the SDK raises the terminal error event
        await drain(stream, chunks)
    assert e.value.body["code"] == "content_filter"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["content_filter"]
    assert records[-1]["filter"] == "loops/repeat:3" and records[-1]["output_tokens"] < 100


async def test_a_teams_own_filter_from_config(make_server, records) -> None:
    live = await make_server(TOML)
    r = await client(live, KEY_STRICT).completions.create(model="fake", prompt="[[say:calm down!!! now]]",
                                                          max_tokens=50)
    assert r.choices[0].finish_reason == "content_filter" and "!!!" not in r.choices[0].text
    assert records[-1]["filter"] == "shout/shouting"
    r = await client(live, KEY).completions.create(model="fake", prompt="[[say:calm down!!! now]]", max_tokens=50)
    assert r.choices[0].text == "calm down!!! now"  # tenant a does not run it


async def test_token_id_prompts_are_screened_by_decoding_them(make_server) -> None:
    """lm-evaluation-harness sends token ids, often several prompts at once: the screen reads
    them decoded, so a blocked phrase is refused as text would be, and a clean one runs."""
    live = await make_server(TOML)
    tok = live.backend().tokenizer
    bad, fine = tok.encode("tell me the FORBIDDEN phrase"), tok.encode("a calm question")
    with pytest.raises(openai.BadRequestError) as e:
        await client(live).completions.create(model="fake", prompt=bad, max_tokens=2)
    assert e.value.code == "content_filter" and live.backend().submitted == []
    with pytest.raises(openai.BadRequestError) as e:
        await client(live).completions.create(model="fake", prompt=[fine, bad], max_tokens=2)
    assert e.value.code == "content_filter" and live.backend().submitted == []
    r = await client(live).completions.create(model="fake", prompt=[fine, fine], max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 4


async def test_a_forced_length_runs_without_the_loop_detector_but_with_the_safety_filters(make_server) -> None:
    """Load generators send ignore_eos and want every token: a loop is theirs to keep; an
    address is still redacted."""
    live = await make_server(TOML)
    c = client(live)
    loop = "[[repeat:la la ]]"
    stopped = await c.completions.create(model="fake", prompt=loop, max_tokens=40)
    assert stopped.choices[0].finish_reason == "content_filter"
    forced = await c.completions.create(model="fake", prompt=loop, max_tokens=40, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 40
    mail = await c.completions.create(model="fake", prompt="[[say:write to bob@example.com please]]", max_tokens=40,
                                      extra_body={"ignore_eos": True})
    assert "bob@" not in mail.choices[0].text
