"""The classifier filter's guard model, asked straight through its engine.

Outside the fair queue: a guard answer is a few tokens, and a prompt waiting on it holds
no seat. The engine is found through `backend_for`, so filters need no registry.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

from llmd.backends.base import Backend, Sampling
from llmd.filters.builtin import GUARD_PROMPT
from llmd.policy.classes import ENGINE_PRIORITY, INTERACTIVE


class Guard:
    """`Ask` for classifier filters: (model, text, timeout_s) -> the guard model's answer."""

    def __init__(self, backend_for: Callable[[str], Backend]) -> None:
        self._backend_for = backend_for

    async def __call__(self, model: str, text: str, timeout_s: float) -> str:
        backend = self._backend_for(model)
        prompt = backend.render_chat([{"role": "system", "content": GUARD_PROMPT}, {"role": "user", "content": text}])
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
