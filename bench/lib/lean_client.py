"""A lean keep-alive HTTP/1.1 load client (raw sockets on uvloop) in its own process.

Why not httpx: it needed about as much CPU per request as the server and capped the rate
near 300 req/s, which left the server idle part of the time. This client costs a few % of
the server's CPU per request, so one process saturates the server's core, and the server
alone decides the rate. Used by bench/metering.py's serving-cost A/B.

    python -m bench.lib.lean_client PORT SECONDS CONCURRENCY STREAM_TOKENS

prints "go" once every connection is warm and the clock starts, then "DONE CPU_SECONDS".
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


async def client_round(port: int, seconds: float, concurrency: int, stream_tokens: int,
                       on_start: Callable[[], None]) -> tuple[int, float]:
    """Requests the client completed against 127.0.0.1:`port` in `seconds`, and its CPU seconds.
    `on_start` runs when the client's clock starts (its connections are up by then)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.lib.lean_client", str(port), str(seconds), str(concurrency), str(stream_tokens),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None
    if (await proc.stdout.readline()).strip() != b"go":
        raise RuntimeError("load client did not start")
    on_start()
    last = await proc.stdout.readline()  # the client's clock has stopped
    if await proc.wait() != 0 or len(last.split()) != 2:
        raise RuntimeError(f"load client failed ({proc.returncode})")
    done, cpu = last.decode().split()
    return int(done), float(cpu)


def _request(port: int, stream_tokens: int) -> bytes:
    """stream_tokens 0: non-streaming, 16 tokens; else an SSE stream of that many tokens."""
    ask: dict[str, Any] = ({"max_tokens": 16} if not stream_tokens
                           else {"max_tokens": stream_tokens, "stream": True, "ignore_eos": True})
    body = json.dumps({"model": "fake", "prompt": "hello", **ask}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _one(req: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request on a kept-alive connection, its response read in full (an SSE stream chunk by chunk)."""
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status, _, rest = head.partition(b"\r\n")
    length, chunked = None, False
    for line in rest.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
        elif name.strip().lower() == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    if chunked:  # an SSE stream: read chunks up to the last, empty one
        parts = []
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")
        data = b"".join(parts)
        if b"[DONE]" not in data or b'"error"' in data:
            raise SystemExit(f"stream did not end well: {data[-300:]!r}")
    elif length is None:
        raise SystemExit(f"no Content-Length in the response: {head!r}")
    else:
        data = await reader.readexactly(length)
    if b" 200 " not in status:
        raise SystemExit(f"{status.decode()}: {data.decode(errors='replace')}")


def main(port: int, seconds: float, concurrency: int, stream_tokens: int) -> int:
    import uvloop

    req = _request(port, stream_tokens)
    cpu0 = [0.0]

    async def go() -> int:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
        await asyncio.gather(*(_one(req, r, w) for r, w in conns))  # every connection warm before the clock starts
        done = 0
        print("go", flush=True)
        cpu0[0], stop = time.process_time(), time.perf_counter() + seconds

        async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await _one(req, r, w)
                done += 1
            w.close()
        await asyncio.gather(*(worker(r, w) for r, w in conns))
        return done

    done = uvloop.run(go())
    print(done, time.process_time() - cpu0[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
