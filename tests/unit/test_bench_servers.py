"""bench/lib/servers.py's process starts, as tests/ahead.py uses them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.lib.servers import inherit, spawn


def test_a_process_spawned_inside_inherit_gets_that_environment_not_the_live_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/ahead.py starts engine servers in a background thread while other tests run: a test's
    monkeypatched LLMD_HOME must not reach them, or they open an empty weight store."""
    monkeypatch.setenv("LLMD_HOME", str(tmp_path / "a test's own"))
    argv = [sys.executable, "-c", "import os; print(os.environ.get('LLMD_HOME'))"]
    with inherit({"LLMD_HOME": "/the/session's"}):
        spawn(argv, tmp_path / "inside.log").wait(30)
    spawn(argv, tmp_path / "outside.log").wait(30)
    assert (tmp_path / "inside.log").read_text().strip() == "/the/session's"
    assert (tmp_path / "outside.log").read_text().strip() == str(tmp_path / "a test's own")
