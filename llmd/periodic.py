"""A background job that runs every so often while a store is open (purging what expired), and
survives its own failures: a busy or failing disk only means the next round tries again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


class Periodic:
    """Runs `job` (it returns how many things it did) every `every_s`; logs `done` with that
    count as `unit` when it did any, `failed` with the traceback when it raised."""

    def __init__(self, name: str, every_s: float, job: Callable[[], Awaitable[int]], log: Any,
                 done: str, failed: str, unit: str) -> None:
        self.name, self.every_s, self.job, self.log = name, every_s, job, log
        self.done, self.failed, self.unit = done, failed, unit
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                if n := await self.job():
                    self.log.info(self.done, **{self.unit: n})
            except Exception:  # a busy or failing disk: the next round tries again
                self.log.exception(self.failed)
