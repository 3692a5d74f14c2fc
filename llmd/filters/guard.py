"""The classifier filter's guard model, asked straight through its engine.

Outside the fair queue: a guard answer is a few tokens, and a prompt waiting on it holds
no seat. The engine is found through `backend_for`, so filters need no registry.

A prompt longer than the guard model's context is cut into overlapping windows of its tokens
(`windows`), each screened on its own: an unsafe span at a window's edge is whole in the next
one, and no part of a prompt reaches the model unscreened because the guard could not read it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

from llmd.backends.base import Backend, Prompt, PromptError, Sampling
from llmd.filters.builtin import GUARD_PROMPT
from llmd.policy.classes import ENGINE_PRIORITY, INTERACTIVE

ANSWER_TOKENS = 3  # the guard answers in a word
MARGIN_TOKENS = 16  # a window's text re-tokenized may come out a few tokens longer than its slice
MAX_OVERLAP_TOKENS = 256  # a window repeats this much (at most a quarter of it) of the one before


def _render(backend: Backend, text: str) -> Prompt:
    return backend.render_chat([{"role": "system", "content": GUARD_PROMPT}, {"role": "user", "content": text}])


class Guard:
    """`Ask` for classifier filters: (model, text, timeout_s) -> the guard model's answer;
    `windows` cuts a text to what the guard model can read."""

    def __init__(self, backend_for: Callable[[str], Backend]) -> None:
        self._backend_for = backend_for

    def windows(self, model: str, text: str) -> list[str]:
        """`text` whole if the guard model reads it in one prompt, else overlapping windows of its
        tokens that each fit (consecutive ones share a quarter window, at most 256 tokens).
        ValueError: the model's context leaves no room for text beside the guard's instructions."""
        backend = self._backend_for(model)
        room = backend.max_model_len - ANSWER_TOKENS
        try:
            if _render(backend, text).num_tokens <= room:
                return [text]
        except PromptError:  # vLLM refuses to render past the model's context: windows, then
            pass
        budget = room - _render(backend, "").num_tokens - MARGIN_TOKENS
        if budget < 4 * ANSWER_TOKENS:
            raise ValueError(f"the guard model {model!r} has a {backend.max_model_len}-token context: no room for "
                             "text beside its instructions")
        ids = backend.render_completion(text).token_ids
        overlap = min(budget // 4, MAX_OVERLAP_TOKENS)
        step = budget - overlap
        return [backend.decode(list(ids[i:i + budget])) for i in range(0, max(len(ids) - overlap, 1), step)]

    async def __call__(self, model: str, text: str, timeout_s: float) -> str:
        backend = self._backend_for(model)
        prompt = _render(backend, text)
        rid = f"guard-{uuid.uuid4().hex[:12]}"
        parts: list[str] = []
        gen = backend.generate(rid, prompt, Sampling(max_tokens=3, temperature=0.0), ENGINE_PRIORITY[INTERACTIVE])
        finished = False
        try:
            async with contextlib.aclosing(gen):
                async for d in gen:
                    parts.append(d.text)
                    finished = d.finish_reason is not None
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await backend.abort(rid)
        return "".join(parts)
