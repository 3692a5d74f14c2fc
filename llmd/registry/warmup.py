"""Warming a version up out of rotation: first requests pay for cold caches and lazy
initialisation; better the registry pays than a user."""

from __future__ import annotations

import contextlib
import uuid

from llmd.backends.base import Sampling
from llmd.runtime import ModelRuntime

WARMUP_PROMPTS = ("Hello!", "Write one sentence about the sea.", "What is 2 + 2?")


async def warm_up(rt: ModelRuntime) -> None:
    """A few short generations straight to the engine, out of rotation (first requests pay
    for cold caches and lazy initialisation; better the registry pays than a user)."""
    backend = rt.backend
    for text in WARMUP_PROMPTS:
        rid = f"warmup-{uuid.uuid4().hex[:12]}"
        prompt = backend.render_chat([{"role": "user", "content": text}])
        gen = backend.generate(rid, prompt, Sampling(max_tokens=8, temperature=0.0), 0)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                pass
