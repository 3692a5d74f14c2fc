"""The issue's slow-client demonstrations against a real `llmd serve` (fake backend), full size:
1,000 trickling sockets (header, body, silent) all closed within their limits with the server's
RSS growing < 50 MiB, and 256 stalled SSE readers whose engine seats are free within their
deadline + 1 s. bench/hostile.py runs the same and writes the figures to docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import hostile
from bench.lib.servers import stop


@pytest.mark.timeout(600)
async def test_a_thousand_trickling_sockets_are_closed_within_the_limit(tmp_path: Path) -> None:
    args = hostile.parse_args(["--no-write"])
    srv = hostile.serve(args, tmp_path)
    try:
        s = await hostile.slowloris(srv, 1000, args.drip, args.header_timeout, args.body_timeout)
    finally:
        stop(srv.proc)
    failed = [claim for claim, ok in hostile.slowloris_verdicts(s) if not ok]
    assert not failed, (failed, s)


@pytest.mark.timeout(600)
async def test_256_stalled_sse_readers_free_their_seats_by_the_deadline(tmp_path: Path) -> None:
    args = hostile.parse_args(["--no-write"])
    srv = hostile.serve(args, tmp_path)
    try:
        st = await hostile.stalled(srv, 256, args.deadline)
    finally:
        stop(srv.proc)
    failed = [claim for claim, ok in hostile.stalled_verdicts(st) if not ok]
    assert not failed, (failed, st)
