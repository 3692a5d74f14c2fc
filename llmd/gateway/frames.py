"""A streamed response's body frames, written straight to the connection once it has begun.

sanic's `response.send` is a stack of four coroutines per call, and unless TOUCHUP rewrote
it, a lifecycle signal dispatch that raises and catches two NotFound exceptions when nothing
listens. A stream sends one frame per token, tens of thousands a second on a GPU, and that
stack was the largest cost on the per-token path. So the first frame goes through sanic (it
carries the header and sets the response up); every later frame of a chunked response is
framed here and written to the transport, with sanic's own backpressure event, disconnect
check and response-timeout clock, as `HttpProtocol.send` does. The end (`response.eof`)
goes through sanic again, which closes the response and readies the connection for the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import monotonic
from typing import Any

from sanic.exceptions import RequestCancelled
from sanic.response import HTTPResponse


class Frames:
    """The body frames of one streamed response: `send` each (the first opens the response with
    `open_response`), then `end`."""

    __slots__ = ("_can_write", "_direct", "_open", "_protocol", "_response", "_transport", "_written")

    def __init__(self, open_response: Callable[[], Awaitable[HTTPResponse]]) -> None:
        self._open = open_response
        self._response: HTTPResponse | None = None
        self._direct = False  # the header is out and the body is chunked: frames bypass sanic
        self._protocol: Any = None
        self._transport: Any = None
        self._can_write: asyncio.Event | None = None
        self._written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._written.set_result(None)  # what `send` returns for a frame it wrote at once

    @property
    def started(self) -> bool:
        return self._response is not None

    def send(self, data: str | bytes) -> Awaitable[None]:
        """Not a coroutine: a frame that can go now is written before this returns, and what it
        returns is already done (a coroutine per token cost more than the rest of this); else
        the frame waits in the returned coroutine (the first frame, or a paused connection)."""
        if self._direct:
            transport = self._transport
            if self._can_write.is_set() and not transport.is_closing():  # type: ignore[union-attr]
                raw = data.encode() if isinstance(data, str) else data
                if raw:
                    transport.write(b"%x\r\n%b\r\n" % (len(raw), raw))
                self._protocol._time = monotonic()  # the response timeout counts from the last write, as sanic's
                return self._written
        return self._send(data)

    async def _send(self, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else data
        if self._response is None:
            self._response = await self._open()
        if not self._direct:
            await self._response.send(raw)
            self._go_direct(self._response)
            return
        if self._transport.is_closing():
            raise RequestCancelled
        await self._can_write.wait()  # type: ignore[union-attr]  # the client reads slower than we write
        if self._transport.is_closing():
            raise RequestCancelled
        await self.send(raw)  # writable and open now, with no await between: written at once

    def _go_direct(self, response: HTTPResponse) -> None:
        """After the first frame: write directly when sanic chose chunked encoding for the body
        (not a HEAD request's ignored body, not a body of known length)."""
        stream: Any = response.stream
        func = getattr(stream, "response_func", None) if stream is not None else None
        # Looked up on the class now, not at import: TOUCHUP (on under `llmd serve`) replaces it at start.
        if func is not None and getattr(func, "__func__", None) is getattr(type(stream), "http1_response_chunked", 0):
            self._protocol = stream.protocol
            self._transport = self._protocol.transport
            self._can_write = getattr(self._protocol, "_can_write", None)
            self._direct = self._transport is not None and self._can_write is not None

    async def end(self) -> None:
        """The response's end (opened first if no frame was sent)."""
        if self._response is None:
            self._response = await self._open()
        await self._response.eof()  # type: ignore[no-untyped-call]  # sanic leaves it unannotated
