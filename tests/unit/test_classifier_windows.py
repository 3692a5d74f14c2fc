"""A prompt longer than the classifier's guard model can read is screened in overlapping windows,
never passed unscreened: an unsafe span anywhere in it is found, a failed screening of a
windowed prompt refuses it whatever `on_error` says, and a guard whose context cannot hold any
text refuses it. The guard is a real fake-engine model served by the same llmd."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from llmd.backends.fake import FakeBackend
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.config import FakeEngineConfig
from llmd.filters.guard import ANSWER_TOKENS, Guard, _render

MARKER = "[[say:unsafe]]"  # in the guard's prompt, the fake engine answers "unsafe"
FILLER = "lorem "  # one token a word: a window's text decodes back exactly


def toml(guard_len: int = 256, timeout_ms: int = 30000, step_ms: int = 1) -> str:
    return f"""
[[models]]
name = "fake"
backend = "fake"
[models.engine]
max_model_len = 8192
[models.filters]
input = ["guard"]
[[models]]
name = "guard"
backend = "fake"
[models.engine]
max_model_len = {guard_len}
[models.fake]
step_ms = {step_ms}
[[filters]]
name = "guard"
type = "classifier"
model = "guard"
timeout_ms = {timeout_ms}
on_error = "open"
"""


def prompt(words: int, marker_at: int | None = None) -> str:
    parts = [FILLER] * words
    if marker_at is not None:
        parts.insert(marker_at, MARKER + " ")
    return "".join(parts)


async def ask(live: Any, content: str) -> Any:
    c = openai.AsyncOpenAI(base_url=live.base, api_key="x", max_retries=0, timeout=60)
    return await c.chat.completions.create(model="fake", messages=[{"role": "user", "content": content}],
                                           max_tokens=2)


def test_windows_fit_the_guard_and_every_short_span_is_whole_in_one() -> None:
    backend = FakeBackend("guard", "v", 256, FakeEngineConfig(), TiktokenTokenizer.simple())
    guard = Guard(lambda _: backend)
    assert guard.windows("guard", prompt(50)) == [prompt(50)]  # fits: asked whole
    for at in range(0, 1200, 37):
        parts = guard.windows("guard", prompt(1200, at))
        assert len(parts) > 1
        assert all(_render(backend, p).num_tokens <= 256 - ANSWER_TOKENS for p in parts)
        assert any(MARKER in p for p in parts), at  # wherever it lies, edges included
    tiny = FakeBackend("guard", "v", 48, FakeEngineConfig(), TiktokenTokenizer.simple())
    with pytest.raises(ValueError, match="no room for text"):
        Guard(lambda _: tiny).windows("guard", prompt(100))


async def test_an_unsafe_span_deep_in_a_long_prompt_is_found(make_server, records) -> None:
    live = await make_server(toml())
    for at in (0, 700, 1499):  # head, middle, tail of a prompt ~6x the guard's context
        with pytest.raises(openai.BadRequestError) as e:
            await ask(live, prompt(1500, at))
        assert e.value.code == "content_filter", at
    ok = await ask(live, prompt(1500))  # long and safe: every window asked, none unsafe
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert filtered(records) == ["guard/unsafe"] * 3


def filtered(records: list[dict[str, Any]]) -> list[str]:
    return [r["filter"] for r in records if r.get("status") == "filtered"]


async def test_a_windowed_prompt_whose_screening_fails_is_refused_even_open(make_server, records) -> None:
    live = await make_server(toml(timeout_ms=20, step_ms=500))  # every guard answer takes > 1 s
    ok = await ask(live, "a short prompt")  # one window: on_error = "open" lets it through
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        await ask(live, prompt(1500))
    assert e.value.code == "content_filter" and filtered(records) == ["guard/unavailable"]


async def test_a_guard_that_cannot_read_any_text_refuses_long_prompts(make_server, records) -> None:
    live = await make_server(toml(guard_len=64))
    with pytest.raises(openai.BadRequestError) as e:
        await ask(live, prompt(200))
    assert e.value.code == "content_filter" and filtered(records) == ["guard/unscreenable"]
