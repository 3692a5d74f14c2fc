"""`llmd plan calibrate --quick` on the real vLLM engine (a subprocess, about 2-3 minutes here):
the engine's per-step stats carry counts and durations for every step, and the fit is sane. No
timing thresholds: the box's speed varies 3-4x."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd.stepmodel import BASIS, StepModel
from tests import ahead
from tests.conftest import tmp

pytestmark = pytest.mark.engine


def _calibrate() -> tuple[subprocess.CompletedProcess[str], Path]:
    """The calibration's run (minutes, an engine of its own): started ahead of the engine tests
    (tests/ahead.py), in the session's environment."""
    out = tmp("calibrate") / "step.json"
    return subprocess.run([sys.executable, "-m", "llmd", "plan", "calibrate", "--quick", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, env=ahead.SESSION_ENV), out


ahead.STARTERS["calibrated"] = (_calibrate, lambda _: None)


@pytest.fixture
def calibrated(smollm2_path: Path) -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    yield ahead.take("calibrated")
    ahead.finish("calibrated")


def test_quick_calibration_on_the_engine(calibrated: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    r, out = calibrated
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


def test_a_gpu_shape_is_what_vllm_is_asked_for(smollm2_path: Path) -> None:
    """The shape's arguments reach vLLM's own engine arguments, as a GPU box would start them
    (the engine is not started: this box has no GPU for tensor parallel 4)."""
    from llmd.calibrate.cli import build
    from llmd.calibrate.shapes import shape_from_options

    shape = shape_from_options({"tp": 4, "weight_dtype": "fp8", "kv_cache_dtype": "fp8", "max_num_seqs": 256,
                                "max_model_len": "model", "max_num_batched_tokens": 8192, "cuda_graphs": True,
                                "gpu_memory_utilization": 0.92, "dtype": "bfloat16"}, smollm2_path)
    b, name = build("vllm", "smollm2", shape, None, None)
    args = b._engine_args()  # type: ignore[attr-defined]  # (a VllmBackend)
    assert name.startswith("smollm2@") and b.max_model_len == 8192  # SmolLM2's own context (config.json)
    assert (args.tensor_parallel_size, args.quantization, args.kv_cache_dtype, args.max_num_seqs, args.max_model_len,
            args.max_num_batched_tokens, args.enforce_eager, args.gpu_memory_utilization, args.dtype) == (
        4, "fp8", "fp8", 256, 8192, 8192, False, 0.92, "bfloat16")
    so = args.structured_outputs_config  # JSON modes write compact JSON (no whitespace to run away in)
    assert so.backend == "guidance" and so.disable_any_whitespace
