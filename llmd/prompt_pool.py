"""The few threads that do admission's CPU-heavy steps off the event loop.

Rendering a chat template, tokenizing, decoding token-id prompts, screening a prompt with the
built-in filters and checking sampling (a structured-output grammar compiles there) all take
time that grows with the input. On the event loop, one huge prompt would stall every stream
for as long as it takes; here it waits for one of `server.prompt_workers` threads, and the
loop keeps serving (tokenizers release the GIL, and pure-Python work yields it every few ms).
Bounded: at most that many prompts are worked on at once; more wait their turn.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class PromptPool:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmd-prompt")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread; its exception is raised here. A caller that is
        cancelled while it waits leaves the thread to finish (its result is dropped)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
