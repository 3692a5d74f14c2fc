"""bench/plan_gpu.py and the GPU step timer it reads: the timer's rows are calibration samples,
and the report prices the stored H100 steps with the shipped prior, the first one and a held-out fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bench.plan_gpu as pg
from llmd.plan.fit import by_point, samples_from_json

ROOT = Path(__file__).resolve().parents[2]


def test_the_step_timer_writes_rows_the_calibrator_reads(tmp_path: Path) -> None:
    """The device script runs where llmd does not (torch only): its rows must be what
    llmd.plan.fit reads, each point's shape what its name says. Run on CPU with the tiny shape."""
    out = tmp_path / "steps.json"
    subprocess.run([sys.executable, str(ROOT / "bench/lib/gpu_steps.py"), "--config", "tiny", "--steps", "3",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    run = json.loads(out.read_text())["models"]["tiny"]
    assert run["errors"] == []
    points = by_point(samples_from_json(run["samples"], "tiny"))
    mixed = points["decode B=4 ctx=64 + prefill chunk=32"]
    assert len(mixed) == 3 and all(s.seconds > 0 for s in mixed)
    shape = mixed[0].shape
    assert (shape.decode_seqs, shape.prefill_tokens, shape.prefill_seqs, shape.context_tokens) == (4, 32, 1, 256)
    assert shape.prefill_attn == 32 * 32 / 2 and shape.longest_context == 64
    assert points["prefill chunk=128"][0].shape.decode_seqs == 0


def test_the_report_prices_every_stored_h100_step_three_ways() -> None:
    lines = pg.section(pg.DATA, "H100")
    rows = [ln for ln in lines if ln.startswith(("| llama", "| qwen"))]
    assert len(rows) == 69  # three model shapes x 23 steps; the smoke test's shape is left out
    assert lines[-1].endswith("PASS")  # the shipped prior within its band at 9 points in 10
    first = next(ln for ln in lines if ln.startswith("- all three"))
    assert "within ±30% at 18 of 69 points" in first  # the first prior, summing the roofline's terms
