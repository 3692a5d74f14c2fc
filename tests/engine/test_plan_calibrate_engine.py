"""`llmd plan calibrate --quick` on the real vLLM engine (a subprocess, about 2-3 minutes here):
the engine's per-step stats carry counts and durations for every step, and the fit is sane. No
timing thresholds: the box's speed varies 3-4x."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmd.stepmodel import BASIS, StepModel

pytestmark = pytest.mark.engine


def test_quick_calibration_on_the_engine(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    r = subprocess.run([sys.executable, "-m", "llmd", "plan", "calibrate", "--quick", "--out", str(out)],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = StepModel.load(out)
    assert m.stamp["kind"] == "measured" and m.stamp["engine"] == "vllm" and m.stamp["dtype"] == "float32"
    assert m.stamp["model"].startswith("smollm2@") and m.stamp["engine_version"]
    assert set(m.coef) == set(BASIS) and all(v >= 0 for v in m.coef.values())
    assert m.coef["c_step"] > 0 and m.coef["c_tok"] > 0  # a step costs something; tokens cost more
    assert m.error["points"] == 10 and m.error["median"] >= 0
    points = json.loads(out.with_suffix(".points.json").read_text())["points"]
    # Every grid point got measured steps, prefill-only ones included (their duration is known now).
    assert len(points) == 10 and all(p["steps"] >= 1 and p["measured_s"] > 0 for p in points)
    assert any(p["point"].startswith("prefill") for p in points)
    assert float(m.stamp["period_gap_ms"]) >= 0
    # Every visit was bracketed by timed reference steps (the engine gave their periods) and scaled.
    assert m.stamp["reference"].startswith("decode B=1 ctx=64")
    rows = json.loads(out.with_suffix(".points.json").read_text())["samples"]
    assert rows and all(row[7] > 0 for row in rows) and any(row[7] != 1.0 for row in rows)
    assert "held-out over 10 points" in r.stdout
