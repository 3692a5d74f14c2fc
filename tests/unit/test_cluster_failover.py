"""A node dies (kill -9) or stops (SIGSTOP) with streams running on it: real llmd processes
(fake engines) on loopback. Every stream finishes through its ingress with all its tokens and
the text of an undisturbed run, each request has one ledger row on its ingress and none on
the dead node. bench/cluster_faults.py runs the same trial at scale and times it."""

from __future__ import annotations

from pathlib import Path

from bench.cluster_faults import MAX_TOKENS, trial


def check(t: dict[str, object], n: int) -> None:
    assert t["complete"] == n, t
    assert t["same_text"] == n, t
    assert t["rows"] == t["distinct_rows"] == t["rows_ok"] == n, t
    assert t["victim_rows"] == 0, t
    assert t["failovers_s"], t  # they did fail over (the streams ran on the victim)


async def test_kill_9_of_the_node_running_the_streams_loses_nothing(tmp_path: Path) -> None:
    t = await trial(tmp_path, 8, "kill")
    check(t, 8)
    assert t["first_declared_s"] is not None  # the others declared it dead


async def test_a_stopped_node_is_suspected_and_its_streams_finish_elsewhere(tmp_path: Path) -> None:
    t = await trial(tmp_path, 6, "stop")
    check(t, 6)
    assert t["back_alive"], t  # SIGCONT: it is alive again
    assert MAX_TOKENS > 0
