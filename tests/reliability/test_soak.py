"""The issue's soak: 2,000 concurrent streams through a real `llmd serve` (fake backend) for
ten minutes (LLMD_SOAK_S to change it): every stream completes and the server's RSS stays
flat (< 1 MiB/min after the warm-up; a run under about five minutes is all warm-up and
checks completion only); the ITL clients saw is printed. bench/soak.py runs the
same and writes the figures to docs/benchmarks.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import soak
from bench.lib.servers import stop

SECONDS = float(os.environ.get("LLMD_SOAK_S", "600"))


@pytest.mark.timeout(SECONDS + 600)
async def test_2000_streams_for_ten_minutes_all_complete_with_flat_memory(tmp_path: Path) -> None:
    args = soak.parse_args(["--no-write", "--seconds", str(SECONDS)])
    srv = soak.serve(args, tmp_path)
    try:
        s = await soak.soak(srv, args.streams, args.seconds, args.tokens)
    finally:
        stop(srv.proc)
    print("\n".join(soak.section(args, s)))
    failed = [claim for claim, ok in soak.verdicts(s) if not ok]
    assert not failed, failed
