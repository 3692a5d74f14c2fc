"""An interrupted `llmd plan search` keeps what it found: a real search process (the simulator,
as Python) is stopped with Ctrl-C (SIGINT) and then killed (SIGKILL) part way, each time once its
journal holds a few more evaluations; the same command then resumes from the journal and ends
with exactly the search an uninterrupted run gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmd.stepmodel import StepModel

ARGS = ("plan", "search", "--workload", "bursty", "--rate", "3", "--duration", "90", "--batch-share", "0.2",
        "--prompt", "lognormal:300:0.5:2048", "--output", "lognormal:100:0.6",
        "--itl-target-ms", "none,60", "--max-num-seqs", "16,64", "--json")


# SIGINT as a terminal delivers it: a suite started in the background (`make test &`) runs with
# it ignored, a child inherits that, and Python then never turns it into KeyboardInterrupt.
_DFL_INT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "os.execv(sys.executable, [sys.executable, '-m', 'llmd', *sys.argv[1:]])")


def _cmd(step: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", _DFL_INT, *ARGS, "--step-model", str(step), *extra]


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "LLMD_HOME": str(home), "LLMD_PLAN_COMPILED": "0"}


def _rows(journal: Path) -> int:
    """Whole evaluation lines in the journal (its header not counted)."""
    try:
        return max(0, journal.read_bytes().count(b"\n") - 1)
    except FileNotFoundError:
        return 0


def _interrupt(home: Path, step: Path, journal: Path, sig: int, more: int) -> subprocess.CompletedProcess[str]:
    """Start the search, wait for `more` new evaluations on disk, send `sig`."""
    start = _rows(journal)
    p = subprocess.Popen(_cmd(step, "--journal", str(journal)), env=_env(home), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while _rows(journal) < start + more and p.poll() is None:
            time.sleep(0.005)
        assert p.poll() is None, "the search ended before it could be interrupted"
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_an_interrupted_search_resumes_from_its_journal(tmp_path: Path) -> None:
    step = tmp_path / "step.json"
    step.write_text(StepModel(coef={"c_step": 0.02, "c_seq": 0.001, "c_tok": 5e-5, "c_kv": 1e-7}).to_json())
    home, journal = tmp_path / "home", tmp_path / "search.jsonl"
    stopped = _interrupt(home, step, journal, signal.SIGINT, 3)
    assert stopped.returncode == 130, stopped.stderr
    kept = _rows(journal)
    assert kept >= 3 and f"interrupted: {kept} evaluations kept in {journal}" in stopped.stderr
    killed = _interrupt(home, step, journal, signal.SIGKILL, 3)
    assert killed.returncode == -signal.SIGKILL
    assert f"resuming from {journal}: {kept} evaluations" in killed.stderr
    kept = _rows(journal)
    done = subprocess.run(_cmd(step, "--journal", str(journal)), env=_env(home), text=True,
                          capture_output=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert f"resuming from {journal}: {kept} evaluations" in done.stderr
    whole = subprocess.run(_cmd(step, "--journal", str(tmp_path / "other.jsonl")), env=_env(home),
                           text=True, capture_output=True, timeout=300, check=False)
    assert whole.returncode == 0, whole.stderr
    resumed, fresh = json.loads(done.stdout), json.loads(whole.stdout)
    assert resumed == fresh and resumed["evaluations"] > kept
    assert _rows(journal) == fresh["evaluations"]
