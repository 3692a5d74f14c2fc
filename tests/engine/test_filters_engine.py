"""The classifier filter with the real model: llmd asks SmolLM2 (served by itself) about a
prompt before admission; a guard's verdict blocks, a timeout applies the fail policy; output
filters work on the real engine's stream too. Tenants pick the filters, on the server these
tests share with test_matrix_engine.py (its config: tests/engine/conftest.py)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import EngineServer
from tests.engine.conftest import GUARD_KEYS, SharedServer

KEYS = GUARD_KEYS


@pytest.fixture(scope="module")
def guard_server(filters_server: SharedServer) -> EngineServer:
    return filters_server.srv


def records(srv: EngineServer) -> list[dict[str, Any]]:
    return [json.loads(line) for line in srv.log_lines() if line.startswith("{") and '"event": "request"' in line]


def ask(srv: EngineServer, tenant: str, content: str = "What is the capital of France?", **kw: Any) -> Any:
    c = openai.OpenAI(base_url=srv.base, api_key=KEYS[tenant], max_retries=0, timeout=120)
    return c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                     max_tokens=8, temperature=0, **kw)


def test_guard_model_answer_decides(guard_server: EngineServer) -> None:
    ok = ask(guard_server, "guarded")  # SmolLM2 does not call this unsafe
    assert ok.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        ask(guard_server, "always")
    assert e.value.code == "content_filter"
    recs = records(guard_server)
    guarded = next(r for r in recs if r["tenant"] == "guarded")
    assert guarded["screened"] == "guard" and guarded["status"] == "ok"
    always = next(r for r in recs if r["tenant"] == "always")
    # rule "unsafe" is set only from the model's answer (a failure would read "unavailable")
    assert always["filter"] == "guard-always/unsafe" and always["status"] == "filtered"
    assert always["output_tokens"] == 0 and always["screened"] == "guard-always"


def test_guard_timeout_fail_closed_and_open(guard_server: EngineServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(guard_server, "closed")
    assert e.value.code == "content_filter"
    ok = ask(guard_server, "open")
    assert ok.choices[0].finish_reason in ("stop", "length")
    recs = records(guard_server)
    closed = next(r for r in recs if r["tenant"] == "closed")
    assert closed["filter"] == "guard-closed/unavailable" and closed["screened"] == "guard-closed!timeout"
    opened = next(r for r in recs if r["tenant"] == "open")
    assert opened["screened"] == "guard-open!timeout" and opened["status"] == "ok"


def test_a_prompt_past_the_guards_context_is_screened_in_windows(guard_server: EngineServer) -> None:
    """~3000 tokens against SmolLM2's 2048: every window is read by the real guard (no `!error` in
    `screened`), and an unsafe verdict refuses it before the token limit is even looked at."""
    long = "The quick brown fox jumps over the lazy dog near the river bank. " * 230
    for tenant in ("guarded", "always"):
        with pytest.raises(openai.BadRequestError) as e:  # "guarded": the verdict is SmolLM2's, then the length
            ask(guard_server, tenant, long)
        assert tenant == "guarded" or e.value.code == "content_filter", e.value
    last = {r["tenant"]: r for r in records(guard_server)}  # each tenant's latest: the long prompt
    guarded, always = last["guarded"], last["always"]
    assert guarded["screened"] == "guard" and guarded["status"] != "ok", guarded  # not "guard!PromptError..."
    assert always["filter"] == "guard-always/unsafe" and always["screened"] == "guard-always", always


def test_output_redaction_on_the_real_stream(guard_server: EngineServer) -> None:
    """A few-shot list makes the model write an address; the stream and the plain response
    both come out redacted, whatever the tokens' boundaries."""
    prompt = ("Name: Alice Smith, Email: alice.smith@example.com\nName: Bob Jones, Email: bob.jones@example.com\n"
              "Name: Carol White, Email:")
    c = openai.OpenAI(base_url=guard_server.base, api_key=KEYS["plain"], max_retries=0, timeout=120)
    stream = c.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    chunks = [ch.choices[0].text for ch in stream if ch.choices]
    text = "".join(chunks)
    plain = c.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    assert text.count("[REDACTED:email]") == 2 and "@" not in text, text  # the 2nd is cut by max_tokens
    assert plain == text
    recs = [r for r in records(guard_server) if r["tenant"] == "plain" and r["endpoint"] == "/v1/completions"]
    assert len(recs) == 2 and all(r["redacted"] == "pii/email" and r["status"] == "ok" for r in recs)
