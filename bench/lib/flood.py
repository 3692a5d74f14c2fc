"""The misbehaving tenant of bench/goodput.py: streams that ignore Retry-After and resubmit a
refused request after a fixed pause, run in a process of their own.

Its own process, and a lean HTTP/1.1 client on raw asyncio streams rather than httpx: on a
shared box the flood's client is the bench's cost, not the server's (httpx spends ~2 ms of CPU
per refused request here, several times what the server spends answering it), and in the
measuring client's event loop it would delay the very first tokens being timed. Outcomes go
back pickled; time.monotonic() is one clock for every process on Linux.

    python -m bench.lib.flood --url URL --headers JSON --streams 200 --seconds 60 --bodies F --out F
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pickle
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.lib.goodput_client import Outcome
from bench.lib.goodput_trace import Request
from bench.lib.streams import Stream, _error_code, _take

RESUBMIT_S = 0.2
ROOT = Path(__file__).resolve().parents[2]  # the child runs `-m bench.lib.flood` from here


class Conn:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads the answer as it comes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.r is None or self.w is None or self.w.is_closing():
            self.r, self.w = await asyncio.open_connection(self.host, self.port)
        return self.r, self.w

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.r = self.w = None

    async def post(self, path: str, body: bytes, headers: dict[str, str], s: Stream) -> None:
        """Send one request and record its answer into `s` (status, error code, SSE chunks)."""
        r, w = await self._open()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        w.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{head}"
                f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await w.drain()
        status_line, *lines = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        s.status = int(status_line.split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
        if "content-length" in fields:
            raw = await r.readexactly(int(fields["content-length"]))
            if s.status != 200:
                s.error = _error_code(raw, s.status)
            return
        await self._sse(r, s)

    async def _sse(self, r: asyncio.StreamReader, s: Stream) -> None:
        buf = b""
        while size := int((await r.readuntil(b"\r\n")).strip() or b"0", 16):
            buf += (await r.readexactly(size + 2))[:-2]
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                data = ev.removeprefix(b"data: ")
                if data == b"[DONE]":
                    s.done = True
                elif data.startswith(b"{"):
                    _take(s, json.loads(data), True)
        await r.readuntil(b"\r\n")  # the last chunk's trailer


async def one_request(conn: Conn, path: str, out: Outcome, headers: dict[str, str], end: float) -> None:
    """`out.req` resubmitted RESUBMIT_S after every refusal until it streams or `end` passes."""
    body = json.dumps({**out.req.body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    while time.monotonic() < end:
        s = Stream(out.req.tenant, time.monotonic())
        out.attempts += 1
        out.last = s
        try:
            async with asyncio.timeout(max(0.1, end - time.monotonic())):
                await conn.post(path, body, headers, s)
        except TimeoutError:
            s.timed_out = True
            conn.close()
            return
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            s.error = f"client:{type(e).__name__}"
            conn.close()
        if s.status in (429, 503):
            out.refusals += 1
        if s.error:
            out.codes.append(s.error)
        if s.ok or s.t_first is not None:
            return
        await asyncio.sleep(RESUBMIT_S)


async def flood(url: str, headers: dict[str, str], streams: int, seconds: float, bodies: list[Request],
                deadline_s: float) -> list[Outcome]:
    """`streams` misbehaving clients, each sending the next body when its last one ends, for `seconds`."""
    u = urlsplit(url)
    supply = iter(bodies)
    outs: list[Outcome] = []

    async def client() -> None:
        conn = Conn(u.hostname or "127.0.0.1", u.port or 80)
        try:
            for req in supply:
                o = Outcome(req, time.monotonic())
                outs.append(o)
                await one_request(conn, u.path, o, headers, o.t0 + deadline_s)
        finally:
            conn.close()

    tasks = [asyncio.create_task(client()) for _ in range(streams)]
    await asyncio.wait(tasks, timeout=seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--headers", default="{}")
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--deadline-s", type=float, default=120.0)
    p.add_argument("--bodies", type=Path, required=True, help="pickled list of bench.lib.goodput_trace.Request")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    bodies: list[Request] = pickle.loads(a.bodies.read_bytes())
    outs = asyncio.run(flood(a.url, json.loads(a.headers), a.streams, a.seconds, bodies, a.deadline_s))
    a.out.write_bytes(pickle.dumps(outs))


async def run_flood(url: str, headers: dict[str, str], streams: int, seconds: float, bodies: list[Request],
                    scratch: Path, deadline_s: float) -> list[Outcome]:
    """Run the flood in a child process for `seconds`; its outcomes."""
    import sys

    src, dst = scratch / "flood-bodies.pkl", scratch / "flood-out.pkl"
    src.write_bytes(pickle.dumps(bodies))
    dst.unlink(missing_ok=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.lib.flood", "--url", url, "--headers", json.dumps(headers), "--streams",
        str(streams), "--seconds", str(seconds), "--deadline-s", str(deadline_s), "--bodies", str(src),
        "--out", str(dst), cwd=ROOT)
    try:
        await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    if proc.returncode != 0 or not dst.exists():
        raise RuntimeError(f"the flood client exited with {proc.returncode}")
    out: list[Outcome] = pickle.loads(dst.read_bytes())
    return out


if __name__ == "__main__":
    main()
