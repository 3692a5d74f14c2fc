"""Logprobs in OpenAI's two shapes: chat's `content` entries, and the completions API's
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) that
log-likelihood harnesses read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmd.backends.base import TokenLogprob


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob if e.logprob is not None else -9999.0,
                         "bytes": _bytes(e.token),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top]}
                        for e in entries]}


def completion(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """`offset`: where the first entry's text starts in the choice's text (echo puts the prompt
    first). A token nothing scored (a prompt's first) has None for its logprob and its top."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top.append(dict(e.top) if e.logprob is not None else None)
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
