"""Connections: a cap on how many are open, and total-time limits on reading a request.

sanic's REQUEST_TIMEOUT starts again with every byte received, and a request's body is read
under RESPONSE_TIMEOUT (minutes), so a client that trickles its header or body a byte at a
time (slowloris) holds a socket, a task and its buffers as long as it likes, and a thousand
such clients hold the server. Here every request is read against a clock that does not
restart: its header must arrive whole within `header_timeout_s` of its first byte (of the
connection, for its first request, so a socket that sends nothing is cut too); its body
within `body_timeout_s` more, plus one second per `body_min_rate` bytes received (a large
upload at a decent rate is never cut, a trickle always is), as Apache's mod_reqtimeout does.
A request over its time is answered 408 and its connection closed.

At most `max_connections` are open: one more first closes an idle keep-alive connection,
else it is answered 503 and closed at once. sanic has no such limit, so `GuardedProtocol`
(sanic's own HTTP protocol, counted) is what `llmd serve` and the tests serve with.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import json
import ssl
from collections.abc import Iterable
from time import monotonic
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sanic.exceptions import RequestTimeout
from sanic.http import Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from llmd.telemetry import log

TICK_S = 0.25  # how often open connections are checked against their limits
ABORT_AFTER_S = 1.0  # a cut connection still open this long after its 408 is aborted

_BODY = json.dumps({"error": {"message": "too many open connections; retry shortly", "type": "server_error",
                              "param": None, "code": "too_many_connections"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class ConnectionGuard:
    """The open connections of one app, checked every TICK_S; counts what it refused and cut."""

    def __init__(self, max_connections: int, header_timeout_s: float, body_timeout_s: float,
                 body_min_rate: int) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.body_min_rate = body_min_rate
        self.live: set[GuardedProtocol] = set()
        self.refused = 0  # connections answered 503: over max_connections
        self.reclaimed = 0  # idle keep-alive connections closed to make room
        self.cut = 0  # requests answered 408: read too slowly
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="llmd-connection-guard")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def admit(self, conn: GuardedProtocol) -> bool:
        if len(self.live) >= self.max_connections and not self._reclaim():
            self.refused += 1
            return False
        self.live.add(conn)
        return True

    def _reclaim(self) -> bool:
        """Close one idle keep-alive connection (between requests), if there is one."""
        idle = next((c for c in self.live if c.idle), None)
        if idle is None:
            return False
        self.live.discard(idle)
        idle.close()
        self.reclaimed += 1
        return True

    def limit_s(self, body: bool, received: int) -> float:
        """How long reading a request may take from its first byte: its header, or all of it."""
        if not body:
            return self.header_timeout_s
        return self.header_timeout_s + self.body_timeout_s + received / self.body_min_rate

    def collect(self) -> Iterable[Metric]:
        """For /metrics (registered in the node's metrics registry by the app)."""
        yield GaugeMetricFamily("llmd:connections_open", "HTTP connections open now", value=len(self.live))
        yield CounterMetricFamily("llmd:connections_refused", "connections refused: over server.max_connections",
                                  value=self.refused)
        yield CounterMetricFamily("llmd:connections_reclaimed", "idle keep-alive connections closed to make room",
                                  value=self.reclaimed)
        yield CounterMetricFamily("llmd:requests_read_timeout", "requests cut off (408): header or body too slow",
                                  value=self.cut)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = monotonic()
            for conn in list(self.live):
                try:
                    if conn.enforce(self, now):
                        self.cut += 1
                except Exception:  # one odd connection must not end the watch over all the others
                    log.exception("connection_guard_error")


class GuardedProtocol(HttpProtocol):
    """sanic's HTTP/1.1 protocol, admitted by the app's ConnectionGuard (`app.ctx.connections`)
    and timed from each request's first byte."""

    __slots__ = ("_cut_at", "_guard", "_handling", "_raw", "_reading_since", "_received", "_refused")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._guard: ConnectionGuard | None = None
        self._refused = False
        self._raw: Any = None  # under TLS: the socket's transport, admitted at accept (`accepted`)
        self._reading_since: float | None = None  # first byte of the request being read; None: none is
        self._received = 0  # bytes received since then
        self._handling = False  # its header is read: the handler runs (and reads the body first)
        self._cut_at: float | None = None
        super().__init__(*args, **kwargs)

    def _setup(self) -> None:
        super()._setup()  # type: ignore[no-untyped-call]
        inner = self.request_handler

        async def handle(request: Any) -> Any:
            self._handling = True
            try:
                return await inner(request)
            finally:
                self._handling, self._reading_since = False, None

        self.request_handler = handle

    def accepted(self, raw: Any) -> bool:
        """Admit the connection as the socket is accepted (under TLS, before the handshake);
        False: over the cap. Its first request's clock starts now."""
        self._raw = raw
        self._guard = getattr(self.app.ctx, "connections", None)
        self._reading_since, self._received = monotonic(), 0
        if self._guard is not None and not self._guard.admit(self):
            self._refused = True
            return False
        return True

    def released(self) -> None:
        if self._guard is not None:
            self._guard.live.discard(self)

    def connection_made(self, transport: Any) -> None:
        if self._raw is None and not self.accepted(transport):  # plain HTTP: admitted here, at accept
            transport.write(BUSY)
            transport.close()
            return
        super().connection_made(transport)  # type: ignore[no-untyped-call]

    def connection_lost(self, exc: Exception | None) -> None:
        self.released()
        if not self._refused:
            super().connection_lost(exc)  # type: ignore[no-untyped-call]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_since is None:
            self._reading_since, self._received = monotonic(), 0
        self._received += len(data)
        super().data_received(data)

    @property
    def idle(self) -> bool:
        """Between requests on a kept-alive connection: nothing is being read or answered."""
        http = self._conn_http()
        return (self._reading_since is None and not self._handling and http is not None
                and http.stage is Stage.IDLE and not self.recv_buffer)

    def _conn_http(self) -> Any:
        """sanic's Http for this connection; None until its connection task has set it up."""
        return getattr(self, "_http", None)

    def enforce(self, guard: ConnectionGuard, now: float) -> bool:
        """Cut the request being read if it is over its time (True: it was cut now)."""
        if self._cut_at is not None:
            if now - self._cut_at > ABORT_AFTER_S:
                self.abort()  # type: ignore[no-untyped-call]
            return False
        since = self._reading_since
        if since is None:
            return False
        if getattr(self, "transport", None) is None:  # still in its TLS handshake (not ours yet)
            if now - since > guard.limit_s(False, 0) and self._raw is not None:
                self._cut_at = now
                self._raw.abort()
                return True
            return False
        http = self._conn_http()
        if self._handling and not (http is not None and http.request_body):
            self._reading_since = None  # read whole: from here its deadline governs, not these limits
            return False
        if now - since <= guard.limit_s(self._handling, self._received):
            return False
        self._cut_at = now
        task = self._task
        if http is not None and task is not None:
            # As sanic's own timeouts do: the connection task ends with a 408 and closes.
            http.exception = RequestTimeout("the request was not received in time")
            http.request_body = None  # or sanic, after the 408, reads the rest of the body: trickled
            task.cancel()
        else:
            self.abort()  # type: ignore[no-untyped-call]
        return True


class _CountedHandshake(asyncio.sslproto.SSLProtocol):
    """asyncio's TLS layer over one `GuardedProtocol`, counted by the guard at accept: the
    connection holds its place from its first byte, and a handshake has `header_timeout_s`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, inner: GuardedProtocol, context: ssl.SSLContext,
                 handshake_s: float) -> None:
        super().__init__(loop, inner, context, None, server_side=True,  # type: ignore[arg-type]
                         ssl_handshake_timeout=handshake_s)  # type: ignore[arg-type]
        self._inner = inner

    def connection_made(self, transport: Any) -> None:
        inner = self._inner
        if not inner.accepted(transport):
            transport.abort()  # over the cap before any TLS: nothing to answer in, so just closed
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._inner.released()  # also when the handshake never finished (the inner never saw it)
        if not self._inner._refused:
            super().connection_lost(exc)


def tls_protocol(context: ssl.SSLContext, handshake_s: float) -> type[GuardedProtocol]:
    """The protocol `llmd serve` runs with `[server.tls]` (sanic then gets `ssl=None`): TLS is
    layered inside it, so the connection cap and the header clock start at accept, not after
    asyncio's handshake (whose own default timeout is 60 s)."""

    class TLSGuardedProtocol(GuardedProtocol):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # sanic builds it with its partial()
            inner = GuardedProtocol(*args, **kwargs)
            return _CountedHandshake(kwargs["loop"], inner, context, handshake_s)

    return TLSGuardedProtocol
