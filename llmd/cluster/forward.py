"""The ingress's side of a forwarded choice: a signed POST to the chosen node, its deltas read
back as they come. A proxy, not a redirect: the ingress keeps the client's connection, meters
the request, and can resume it elsewhere if the node fails.

`PeerLost` means "this node will not finish it; try another": the connection failed or broke,
the node answered that it does not hold the version, a line came back not signed by it for
this call, or gossip declared it dead (or suspect and silent) while we waited for its next
line. Closing the stream (the client went away) closes the connection, and the executor
aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Iterator

import httpx

from llmd.backends.base import Delta
from llmd.cluster.signing import HEADER_NONCE, Signer
from llmd.cluster.wire import RUN_PATH, RunRequest, error_from, parse_line
from llmd.errors import APIError

SUSPECT_STALL_S = 2.0  # a suspect node that sends nothing this long is given up on


class PeerLost(Exception):
    """The node will not finish this choice (`started`: it had sent deltas)."""

    def __init__(self, node: str, why: str, started: bool = False) -> None:
        super().__init__(f"node {node}: {why}")
        self.node, self.why, self.started = node, why, started


class Forwarder:
    def __init__(self, signer: Signer, client: httpx.AsyncClient) -> None:
        self._signer = signer
        self._client = client
        self._waiting: dict[str, set[asyncio.Timeout]] = {}  # node -> reads waiting on it now
        self._suspect: set[str] = set()
        self.forwarded = 0
        self.lost = 0

    # -- gossip's news, applied to every read waiting on that node -------------------------------
    def node_suspect(self, node: str, suspect: bool) -> None:
        (self._suspect.add if suspect else self._suspect.discard)(node)
        when = asyncio.get_running_loop().time() + SUSPECT_STALL_S if suspect else None
        for t in self._waiting.get(node, ()):
            t.reschedule(when)

    def node_lost(self, node: str) -> None:
        """Declared dead, or it left: every read waiting on it fails over now."""
        now = asyncio.get_running_loop().time()
        for t in self._waiting.get(node, ()):
            t.reschedule(now)

    @contextlib.contextmanager
    def _watch(self, node: str, t: asyncio.Timeout) -> Iterator[None]:
        waiting = self._waiting.setdefault(node, set())
        waiting.add(t)
        try:
            yield
        finally:
            waiting.discard(t)

    async def stream(self, node: str, url: str, req: RunRequest) -> AsyncGenerator[Delta, None]:
        body = req.model_dump_json().encode()
        headers = self._signer.headers("POST", RUN_PATH, body, to=node) | {"content-type": "application/json"}
        nonce, index = headers[HEADER_NONCE], 0  # each line back is signed for this call, in order
        started = False
        self.forwarded += 1
        try:
            async with self._client.stream("POST", url.rstrip("/") + RUN_PATH, content=body, headers=headers) as resp:
                if resp.status_code != 200:
                    await self._refused(node, resp)
                lines = resp.aiter_lines()
                while True:
                    async with asyncio.timeout(self._first_wait(node)) as t:
                        with self._watch(node, t):
                            line = await anext(lines)
                    if not line:
                        continue
                    opened = self._signer.open_line(nonce, index, line.encode())
                    if opened is None:
                        raise ValueError("a line not signed for this call")  # injected or reordered: not this node's
                    index += 1
                    item = parse_line(opened)
                    if isinstance(item, Delta):
                        started = True
                        yield item
                    elif item.get("end"):
                        return
                    else:
                        raise error_from(item)
        except (httpx.TransportError, StopAsyncIteration, TimeoutError, ValueError) as e:
            self.lost += 1
            raise PeerLost(node, type(e).__name__, started) from None

    def _first_wait(self, node: str) -> float | None:
        """How long a read may wait: unbounded (the request's own deadline bounds it) unless the
        node is suspect already."""
        if node in self._suspect:
            return SUSPECT_STALL_S
        return None

    async def _refused(self, node: str, resp: httpx.Response) -> None:
        """A status other than 200: the node cannot run it here (try another) or the request is
        wrong (the same everywhere: the client's error)."""
        raw = await resp.aread()
        try:
            err = error_from({"status": resp.status_code} | _json(raw))
        except ValueError:
            err = APIError(resp.status_code, raw.decode(errors="replace")[:200], "server_error")
        if resp.status_code == 404 or resp.status_code >= 500 or resp.status_code == 401:
            raise PeerLost(node, f"{resp.status_code} {err.code or err.message}")
        raise err


def _json(raw: bytes) -> dict[str, object]:
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("not an object")
    return d
