"""The OpenAI response bodies and stream chunks llmd sends, built as plain dicts."""

from __future__ import annotations

import time
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_choice(index: int, content: str | None, finish: str | None, logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_delta(index: int, delta: dict[str, Any], finish: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def text_choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chunk(rid: str, obj: str, model: str, created: int, choices: list[dict[str, Any]],
          usage_now: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stream chunk (`obj`: chat.completion.chunk or text_completion)."""
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_now is not None:
        out["usage"] = usage_now
    return out


def body(rid: str, obj: str, model: str, created: int, choices: list[dict[str, Any]],
         usage_all: dict[str, Any]) -> dict[str, Any]:
    """A whole response (`obj`: chat.completion or text_completion)."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": usage_all}


def created_now() -> int:
    return int(time.time())
