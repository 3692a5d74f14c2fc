"""Input that would hurt other clients, refused or contained, over real HTTP on the fake backend:
bounded seed and top_k, neutral-only fields checked by type, the prompt's byte size checked
before anything tokenizes it, refused requests spending the tenant's request rate, and the
prompt's rendering and screening off the event loop (a blocked one stalls no one else)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import openai
import pytest

from llmd.auth import hash_key
from llmd.filters import Match
from tests.conftest import LiveServer, fake_toml

MSG = [{"role": "user", "content": "hello there"}]
KEY_A, KEY_B = "sk-llmd-hostile-a", "sk-llmd-hostile-b"
INT64_MAX = 2**63 - 1


def sdk(live: LiveServer, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key=key, max_retries=0, timeout=60)


async def refused(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        await call
    return e.value


def error_of(e: openai.APIStatusError) -> dict[str, Any]:
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)


async def test_seed_is_bounded_to_int64_like_vllms_own_server(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    for seed in (INT64_MAX, -(2**63), -1, 0):
        r = await c.chat.completions.create(model="fake", messages=MSG, max_tokens=2, seed=seed, n=2)
        assert len(r.choices) == 2  # the second choice's seed (seed + 1) stays within int64
    for seed in (2**63, -(2**63) - 1, 10**30):
        e = await refused(c.chat.completions.create(model="fake", messages=MSG, max_tokens=2, seed=seed))
        assert e.status_code == 400 and error_of(e)["param"] == "seed", error_of(e)
    e = await refused(c.completions.create(model="fake", prompt="x", max_tokens=2, seed=2**64))
    assert e.status_code == 400 and error_of(e)["param"] == "seed"
    assert len(live.backend().submitted) == 8  # the refused ones never reached the engine


async def test_top_k_is_off_or_within_the_vocabulary(make_server) -> None:
    live = await make_server(fake_toml())
    c = sdk(live)
    vocab = live.backend().tokenizer.n_vocab
    for k in (-1, 0, 1, vocab):
        r = await c.completions.create(model="fake", prompt="x", max_tokens=2, extra_body={"top_k": k})
        assert r.choices[0].text
    for k in (-2, vocab + 1, 2**31, 2**70):
        e = await refused(c.completions.create(model="fake", prompt="x", max_tokens=2, extra_body={"top_k": k}))
        assert e.status_code == 400 and error_of(e)["param"] == "top_k", (k, error_of(e))


@pytest.mark.parametrize(("field", "value"), [("n", True), ("best_of", True), ("suffix", False), ("echo", 1),
                                             ("functions", True), ("function_call", True), ("max_tokens", True),
                                             ("seed", True), ("stream", 0), ("logprobs", True)])
async def test_fields_are_checked_by_type_not_by_equality(make_server, field: str, value: Any) -> None:
    """`true == 1` in Python: a field accepted only at its neutral value (best_of 1) or an integer
    must not take a boolean. The SDK sends these as given."""
    live = await make_server(fake_toml())
    c = sdk(live)
    if field in ("functions", "function_call"):
        call = c.chat.completions.create(model="fake", messages=MSG, max_tokens=2, extra_body={field: value})
    else:
        call = c.completions.create(model="fake", prompt="x", max_tokens=2, extra_body={field: value})
    e = await refused(call)
    assert e.status_code == 400 and error_of(e)["param"] == field, error_of(e)


BYTES_TOML = fake_toml().replace("default_max_tokens = 16", "default_max_tokens = 16\nmax_prompt_bytes = 1000")


async def test_prompt_byte_size_is_refused_before_anything_tokenizes_it(make_server) -> None:
    live = await make_server(BYTES_TOML)
    backend = live.backend()
    rendered: list[int] = []
    for name in ("render_chat", "render_completion"):
        inner = getattr(backend, name)

        def counting(*a: Any, _inner: Any = inner, **k: Any) -> Any:
            rendered.append(1)
            return _inner(*a, **k)
        setattr(backend, name, counting)
    c = sdk(live)
    ok = await c.completions.create(model="fake", prompt="a" * 1000, max_tokens=1)
    assert ok.choices and rendered == [1]
    rendered.clear()
    cases = [
        (c.completions.create(model="fake", prompt="a" * 1001, max_tokens=1), "prompt"),
        (c.completions.create(model="fake", prompt="€" * 334, max_tokens=1), "prompt"),  # 334 chars, 1002 bytes
        (c.completions.create(model="fake", prompt=["ok", "b" * 5000], max_tokens=1), "prompt[1]"),
        (c.chat.completions.create(model="fake", max_tokens=1,
                                   messages=[{"role": "user", "content": "c" * 600},
                                             {"role": "user", "content": "d" * 600}]), "messages"),
    ]
    for call, param in cases:
        e = await refused(call)
        err = error_of(e)
        assert e.status_code == 400 and err["param"] == param and err["code"] == "context_length_exceeded", err
        assert "max_prompt_bytes" in err["message"]
    assert rendered == []  # nothing was rendered or tokenized for any of them


async def test_the_default_byte_limit_is_eight_bytes_per_token_of_the_prompt_limit(make_server) -> None:
    live = await make_server(fake_toml())  # max_model_len 4096: prompt limit 4095 tokens, 32760 bytes
    c = sdk(live)
    e = await refused(c.completions.create(model="fake", prompt="z" * (8 * 4095 + 1), max_tokens=1))
    err = error_of(e)
    assert e.status_code == 400 and err["code"] == "context_length_exceeded" and "32760" in err["message"]


RATE_TOML = fake_toml() + f"""
[[tenants]]
name = "a"
keys = ["{hash_key(KEY_A)}"]
requests_per_minute = 3
[[tenants]]
name = "b"
keys = ["{hash_key(KEY_B)}"]
requests_per_minute = 3
"""


async def test_refused_requests_spend_the_tenants_request_rate(make_server, records) -> None:
    live = await make_server(RATE_TOML)
    a, b = sdk(live, KEY_A), sdk(live, KEY_B)
    for _ in range(3):  # three bad requests: each a 400, each one of the three a minute
        e = await refused(a.completions.create(model="fake", prompt="x", max_tokens=2, seed=2**64))
        assert e.status_code == 400
    e = await refused(a.completions.create(model="fake", prompt="x", max_tokens=2))
    assert e.status_code == 429 and error_of(e)["code"] == "rate_limit_exceeded" and "refused" in error_of(e)["message"]
    assert e.response.headers.get("retry-after")
    # Refused before it is even parsed: a body that is not JSON gets the same 429.
    async with httpx.AsyncClient(base_url=live.base, headers={"Authorization": f"Bearer {KEY_A}"}) as h:
        r = await h.post("/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    ok = await b.completions.create(model="fake", prompt="x", max_tokens=2)  # another tenant is untouched
    assert ok.choices
    assert [r["http_status"] for r in records if r.get("tenant") == "a"] == [400, 400, 400, 429, 429]


async def test_an_admitted_request_is_counted_once(make_server) -> None:
    live = await make_server(RATE_TOML)
    a = sdk(live, KEY_A)
    for _ in range(3):
        assert (await a.completions.create(model="fake", prompt="x", max_tokens=2)).choices
    e = await refused(a.completions.create(model="fake", prompt="x", max_tokens=2))
    assert e.status_code == 429


# -- off the event loop ---------------------------------------------------------------
RELEASE = threading.Event()
IN_SCREEN = threading.Event()


class BlockingScreen:
    """An input filter whose plain `screen` blocks until the test releases it (a stand-in for a
    screen that takes long on a huge prompt)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def screen(self, text: str) -> Match | None:
        if "block-me" in text:
            IN_SCREEN.set()
            RELEASE.wait(60)
        return None

    async def check_prompt(self, text: str) -> Match | None:
        return self.screen(text)


SCREEN_TOML = fake_toml() + """
[[filters]]
name = "slow"
type = "tests.unit.test_hostile_input:BlockingScreen"
[models.filters]
input = ["slow"]
"""


async def _others_finish_while(live: LiveServer, blocked: Any, entered: threading.Event) -> None:
    """`blocked` is held in a worker thread; a stream of another request runs to its end meanwhile."""
    RELEASE.clear()
    entered.clear()
    c = sdk(live)
    first = asyncio.ensure_future(blocked)
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        chunks = [ch async for ch in await c.completions.create(model="fake", prompt="other", max_tokens=20,
                                                                   stream=True)]
        assert len(chunks) >= 20 and not first.done()  # served in full while the other is still held
    finally:
        RELEASE.set()
    assert (await first).choices


async def test_a_slow_prompt_screen_does_not_stall_other_streams(make_server) -> None:
    live = await make_server(SCREEN_TOML)
    await _others_finish_while(live, sdk(live).completions.create(model="fake", prompt="block-me", max_tokens=2),
                               IN_SCREEN)


async def test_a_slow_render_does_not_stall_other_streams(make_server) -> None:
    live = await make_server(fake_toml())
    backend, entered = live.backend(), threading.Event()
    inner = backend.render_chat

    def slow_render(messages: list[dict[str, Any]], tools: Any = None) -> Any:
        if "block-me" in messages[-1]["content"]:
            entered.set()
            RELEASE.wait(60)
        return inner(messages, tools)
    backend.render_chat = slow_render
    call = sdk(live).chat.completions.create(model="fake", messages=[{"role": "user", "content": "block-me"}],
                                             max_tokens=2)
    await _others_finish_while(live, call, entered)
