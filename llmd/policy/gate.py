"""A FIFO gate bounding how many requests are inside one engine at once.

Waiting happens here, in our process, where a deadline can still be honoured
without spending engine time: a request whose deadline passes while it waits
never reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Gate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot; a waiter cancelled (deadline, disconnect) leaves the queue without one."""
        if self.inflight < self.limit and not self._waiters:
            self.inflight += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us just as we gave up
            else:
                fut.cancel()
                if fut in self._waiters:
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand our slot straight to the next waiter
                return
        self.inflight -= 1
