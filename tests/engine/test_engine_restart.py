"""The engine supervisor on the real engine: SIGKILL vLLM's EngineCore (a child process of
`llmd serve`) while streams run and requests queue; the node rebuilds the engine in the same
process, the streams resume with the text of a run never killed (temperature 0), the queued
requests complete, each request has one usage row, and the node is ready again.

bench/engine_death.py runs the same scenario ten times over with 16 streams and 50 queued
(tests/reliability/test_engine_death.py, `make reliability`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import engine_death
from bench.lib.servers import stop
from tests import ahead

pytestmark = pytest.mark.engine

ARGS = ["--kills", "1", "--streams", "4", "--queued", "4", "--max-tokens", "96", "--kill-after", "5", "--no-write"]
ahead.STARTERS["doomed_engine"] = (lambda: engine_death.start(engine_death.parse_args(ARGS)),
                                   lambda started: stop(started[0].proc))


@pytest.fixture
def doomed_engine(smollm2_path: Path) -> Iterator[Any]:
    """Started ahead of the engine tests (tests/ahead.py); the run stops it."""
    yield ahead.take("doomed_engine")
    ahead.finish("doomed_engine")


@pytest.mark.timeout(900)  # two engine builds and a round each side of the kill
def test_engine_killed_mid_stream_is_rebuilt_and_streams_resume(doomed_engine: Any) -> None:
    args = engine_death.parse_args(ARGS)
    r = engine_death.run(args, started=doomed_engine)
    # The engine can run ahead of the client (deltas coalesce when the reader lags): with 40
    # tokens a stream was once done on the engine before the kill, and nothing was resumed.
    assert r["running_at_kill"] == [4], r["running_at_kill"]
    c = r["counts"]
    assert r["reference_ok"]
    assert c.get("resumed_same", 0) == 4 and c.get("lost", 0) == 0, c  # none ended: all resumed, same text
    assert c.get("queued_ok", 0) == 4
    assert [ok for _, ok in engine_death.verdicts(args, r)] == [True] * 5, engine_death.verdicts(args, r)
    assert len(r["restart_s"]) == 1 and len(r["ready_s"]) == 1
    assert r["ledger"]["resumed"].get(1, 0) >= 4  # the record names the resume
