"""Clients that hurt a server, over raw sockets, and the server's memory while they do.

Trickling clients (slowloris): a header or a body sent one byte at a time, or nothing at all;
each records when the server closed it. Stalled readers: a stream asked for and never read
(a tiny receive buffer, no reads). The RSS sampler reads /proc/<pid>/status of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("header", "body", "silent")  # what a trickling client sends slowly


@dataclass
class Trickler:
    kind: str
    t_open: float = 0.0
    t_closed: float | None = None
    answer: bytes = b""  # what the server sent before closing (a 408, or nothing)
    sent: int = 0

    @property
    def held_s(self) -> float | None:
        return None if self.t_closed is None else self.t_closed - self.t_open


async def open_socket(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=1 << 16)


def _opening(kind: str) -> tuple[bytes, bytes]:
    """(sent at once, then dripped a byte at a time) for each kind."""
    if kind == "header":
        return b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-Slow: abcdefgh\r\n"
    if kind == "body":
        return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n"), b'{"model": "fake", "prompt": "' + b"x" * 64
    return b"", b""


async def trickle(port: int, t: Trickler, drip_s: float, give_up_s: float) -> None:
    """One trickling client: its opening, then a byte every `drip_s`, until the server closes it."""
    first, drip = _opening(t.kind)
    try:
        reader, writer = await open_socket(port)
    except OSError:
        return
    t.t_open = time.monotonic()
    read = asyncio.ensure_future(reader.read(4096))
    try:
        if first:
            writer.write(first)
        while time.monotonic() - t.t_open < give_up_s:
            done, _ = await asyncio.wait({read}, timeout=drip_s)
            if done:
                chunk = read.result() if not read.exception() else b""
                t.answer += chunk
                if not chunk:
                    break
                read = asyncio.ensure_future(reader.read(4096))
                continue
            if drip:
                writer.write(drip[t.sent % len(drip):t.sent % len(drip) + 1])
                t.sent += 1
        else:
            return  # never closed: t_closed stays None
        t.t_closed = time.monotonic()
    except OSError:
        t.t_closed = time.monotonic()
    finally:
        read.cancel()
        writer.close()


async def trickle_many(port: int, n: int, drip_s: float, give_up_s: float, ramp_per_s: float = 200) -> list[Trickler]:
    """`n` trickling clients, the kinds in turn, opened at `ramp_per_s` (the server's listen
    backlog is 100: a burst would leave some waiting in it, their clock already running)."""
    clients = [Trickler(KINDS[i % len(KINDS)]) for i in range(n)]
    tasks = []
    for i, t in enumerate(clients):
        tasks.append(asyncio.ensure_future(trickle(port, t, drip_s, give_up_s)))
        if i % 20 == 19:
            await asyncio.sleep(20 / ramp_per_s)
    await asyncio.gather(*tasks)
    return clients


@dataclass
class Staller:
    t_sent: float = 0.0
    writer: asyncio.StreamWriter | None = None


async def stall(port: int, body: dict[str, object], deadline_s: float) -> Staller:
    """Ask for a stream with deadline `deadline_s` and never read it (a 4 KB receive buffer)."""
    raw = json.dumps(body).encode()
    _, writer = await open_socket(port, rcvbuf=4096)
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"X-Request-Timeout: {deadline_s}\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw)
    return Staller(time.monotonic(), writer)


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class RssSampler:
    """Samples a process's RSS every `every_s` while it runs, as (monotonic time, MiB)."""

    pid: int
    every_s: float = 0.5
    samples: list[tuple[float, float]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.samples.append((time.monotonic(), rss_mib(self.pid)))
            await asyncio.sleep(self.every_s)

    def start(self) -> RssSampler:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def peak(self) -> float:
        return max((m for _, m in self.samples), default=float("nan"))


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares growth of RSS over the samples, in MiB per minute."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mm = sum(m for _, m in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (m - mm) for t, m in samples) / var if var else float("nan")
