"""A streamed response's body frames, written straight to the connection once it has begun.

sanic's `response.send` is a stack of four coroutines per call, and unless TOUCHUP rewrote
it, a lifecycle signal dispatch that raises and catches two NotFound exceptions when nothing
listens. A stream sends one frame per token, tens of thousands a second on a GPU, and that
stack cost a third of the gateway's CPU per token. So the first frame goes through sanic (it
carries the header and sets the response up); every later frame of a chunked response is
framed here and written to the transport, with sanic's own backpressure event, disconnect
check and response-timeout clock, as `HttpProtocol.send` does. The end (`response.eof`)
goes through sanic again, which closes the response and readies the connection for the next.
"""

from __future__ import annotations

from time import monotonic
from typing import Any

from sanic.exceptions import RequestCancelled
from sanic.response import HTTPResponse


class Frames:
    """The body frames of one streamed response (`send` each, then `end`)."""

    __slots__ = ("_direct", "_protocol", "_response", "_transport")

    def __init__(self, response: HTTPResponse) -> None:
        self._response = response
        self._direct = False  # the header is out and the body is chunked: frames bypass sanic
        self._protocol: Any = None
        self._transport: Any = None

    async def send(self, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else data
        if not self._direct:
            await self._response.send(raw)
            self._go_direct()
            return
        protocol, transport = self._protocol, self._transport
        if transport.is_closing():
            raise RequestCancelled
        can_write = protocol._can_write
        if not can_write.is_set():  # the client reads slower than we write: wait as sanic would
            await can_write.wait()
            if transport.is_closing():
                raise RequestCancelled
        if raw:
            transport.write(b"%x\r\n%b\r\n" % (len(raw), raw))
        protocol._time = monotonic()  # the response timeout counts from the last write, as sanic's

    def _go_direct(self) -> None:
        """After the first frame: write directly when sanic chose chunked encoding for the body
        (not a HEAD request's ignored body, not a body of known length)."""
        stream: Any = self._response.stream
        func = getattr(stream, "response_func", None) if stream is not None else None
        # Looked up on the class now, not at import: TOUCHUP (on under `llmd serve`) replaces it at start.
        if func is not None and getattr(func, "__func__", None) is getattr(type(stream), "http1_response_chunked", 0):
            self._protocol = stream.protocol
            self._transport = self._protocol.transport
            self._direct = self._transport is not None and hasattr(self._protocol, "_can_write")

    async def end(self) -> None:
        await self._response.eof()  # type: ignore[no-untyped-call]  # sanic leaves it unannotated
