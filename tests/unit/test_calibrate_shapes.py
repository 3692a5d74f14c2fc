"""`llmd plan calibrate` measures the engine a GPU box serves with: tensor parallel size, weight
quantization and KV dtype, hundreds of sequences, the model's own context, a token budget; the
grid grows to those limits. The default shape is this CPU box's, and its grid the FULL grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from llmd.calibrate.grid import FULL, QUICK
from llmd.calibrate.shapes import CPU_MAX_MODEL_LEN, EngineShape, grid_for, model_context, shape_from_options
from llmd.cli import main
from llmd.plan.errors import PlanError
from llmd.stepmodel import StepModel

GPU_OPTIONS: dict[str, Any] = {"tp": 4, "weight_dtype": "fp8", "kv_cache_dtype": "fp8", "max_num_seqs": 256,
                               "max_model_len": "model", "max_num_batched_tokens": 8192, "cuda_graphs": True,
                               "gpu_memory_utilization": 0.92, "dtype": "bfloat16"}


def _model_dir(tmp_path: Path, context: int = 8192) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": context, "num_hidden_layers": 32}))
    return tmp_path


def test_the_default_shape_is_the_cpu_boxs_and_keeps_the_full_grid() -> None:
    shape = shape_from_options({"dtype": "float32"}, None)
    assert shape == EngineShape()
    assert grid_for(FULL, shape) is FULL and grid_for(QUICK, shape) is QUICK
    cfg = shape.engine_config(None)
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_gib) == (
        CPU_MAX_MODEL_LEN, 128, 4096, 2)
    assert cfg.extra == {"enable_logging_iteration_details": True} and cfg.enforce_eager


def test_a_gpu_shape_reaches_the_engine_and_grows_the_grid(tmp_path: Path) -> None:
    shape = shape_from_options(GPU_OPTIONS, _model_dir(tmp_path))
    assert shape.max_model_len == 8192 and shape.quantization == "fp8"  # --max-model-len model: config.json's
    cfg = shape.engine_config(None)
    assert cfg.extra == {"enable_logging_iteration_details": True, "tensor_parallel_size": 4, "quantization": "fp8",
                         "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.92}
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens, cfg.dtype, cfg.enforce_eager) == (
        256, 8192, 8192, "bfloat16", False)
    st = shape.stamp()
    assert (st["tp"], st["quantization"], st["kv_cache_dtype"], st["max_num_seqs"], st["cuda_graphs"]) == (
        "4", "fp8", "fp8", "256", "on")
    g = grid_for(FULL, shape)
    decode = [p for p in g.points if p.kind == "decode"]
    assert sorted({p.batch for p in decode}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert max(p.context for p in decode) == 4097 and g.longest() <= shape.max_model_len
    assert max(p.chunk for p in g.points if p.kind == "prefill") == 4096  # half the token budget
    assert max(p.batch for p in g.points if p.kind == "mixed") == 256
    assert set(FULL.points) <= set(g.points)  # the CPU grid's points stay: the fits compare


def test_a_long_context_and_an_odd_batch_limit(tmp_path: Path) -> None:
    shape = shape_from_options({**GPU_OPTIONS, "max_num_seqs": 300, "max_num_batched_tokens": 16384},
                               _model_dir(tmp_path, 131072))
    g = grid_for(FULL, shape)
    assert max(p.batch for p in g.points) == 300  # max_num_seqs itself, beside the powers of two
    assert max(p.context for p in g.points if p.kind == "decode") == 32769  # capped: minutes, not information
    assert max(p.chunk for p in g.points) == 8192
    small = shape_from_options({"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": "1200"}, None)
    g = grid_for(FULL, small)
    assert max(p.batch for p in g.points) == 16 and g.longest() <= 1200
    assert max(p.chunk for p in g.points if p.kind == "prefill") == 256


@pytest.mark.parametrize(("options", "says"), [
    ({"tp": 0}, "--tp must be at least 1"),
    ({"weight_dtype": "bf16"}, "unquantized weights are served in --dtype"),
    ({"max_model_len": "long"}, "--max-model-len: 'long' is not a number"),
    ({"max_model_len": "model"}, "no max_position_embeddings"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in (0, 1]"),
    ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "must hold a step of --max-num-seqs (512) decodes"),
])
def test_bad_shapes_are_refused(options: dict[str, Any], says: str, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=None) as e:
        shape_from_options(options, tmp_path)  # tmp_path: a model directory without a config.json
    assert says in str(e.value)
    assert model_context(tmp_path) is None


def test_the_fake_backend_calibrates_hundreds_of_sequences(tmp_path: Path) -> None:
    """The shape reaches the engine measured: the fake backend seats 256 sequences in a step and
    the fit's samples carry those steps."""
    truth = tmp_path / "truth.json"
    truth.write_text(StepModel({"c_step": 0.0005, "c_seq": 0.00001, "c_tok": 0.000001}).to_json())
    out = tmp_path / "fit.json"
    r = CliRunner().invoke(main, ["plan", "calibrate", "--backend", "fake", "--quick", "--fake-step-model", str(truth),
                                  "--max-num-seqs", "256", "--max-num-batched-tokens", "1024", "--max-model-len",
                                  "1100", "--steps", "4", "--no-reference", "--out", str(out)])
    assert r.exit_code == 0, r.output
    m = StepModel.load(out)
    assert m.stamp["max_num_seqs"] == "256" and m.stamp["max_model_len"] == "1100"
    assert m.stamp["grid"].startswith("quick (steps 4, repeats 2) (B ≤ 256")
    rows = json.loads(out.with_suffix(".points.json").read_text())["samples"]
    assert max(row[1] for row in rows) == 256  # a measured step decoded 256 sequences
    assert "decode B=256 ctx=1025" in {p["point"] for p in json.loads(out.with_suffix(".points.json").read_text())
                                       ["points"]}
