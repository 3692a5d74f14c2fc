"""The engine a calibration measures: its shape (tensor parallel size, dtype and quantization, KV
dtype, sequences, context, token budget, memory) and the grid scaled to it.

A step model prices the engine it was measured on, shape and all: a GPU box serves with TP, fp8
weights, hundreds of sequences and the model's whole context, and a grid made for a 2-core CPU
(batch ≤ 64, contexts ≤ 2k) would extrapolate to all of it. The default shape is that CPU's, and
its grid is exactly the FULL grid; any other shape extends the grid to the shape's limits:
batches doubling up to max_num_seqs, contexts up to the engine's max_model_len, prefill chunks up
to half the token budget (the other half for a mixed step's decodes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from llmd.calibrate.grid import Grid, Point
from llmd.config import EngineConfig
from llmd.plan.errors import PlanError

CPU_MAX_MODEL_LEN: Final = 3328  # the full grid's longest: 1024 cached + a 2048-token chunk + 1 (26 blocks of 128)
CPU_MAX_NUM_SEQS: Final = 128
CPU_BUDGET: Final = 4096
LONGEST_CONTEXT: Final = 32769  # decode points stop here: longer contexts add minutes, not information


@dataclass(frozen=True)
class EngineShape:
    """vLLM's arguments for the engine measured; the defaults are this CPU box's."""

    tp: int = 1  # tensor_parallel_size
    dtype: str = "float32"  # activations and unquantized weights ("auto": the model's)
    quantization: str | None = None  # vLLM's weight quantization: fp8, awq, gptq, ...
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = CPU_MAX_NUM_SEQS
    max_model_len: int = CPU_MAX_MODEL_LEN
    max_num_batched_tokens: int = CPU_BUDGET
    kv_cache_gib: int = 2  # the CPU engine's KV space
    gpu_memory_utilization: float | None = None  # a GPU engine's memory fraction (None: vLLM's 0.9)
    enforce_eager: bool = True  # False: CUDA graphs, as a GPU serves

    def engine_config(self, bind: str | None) -> EngineConfig:
        """llmd's engine config for this shape: the named fields, the rest through `extra`."""
        extra: dict[str, object] = {"enable_logging_iteration_details": True}
        if self.tp > 1:
            extra["tensor_parallel_size"] = self.tp
        if self.quantization is not None:
            extra["quantization"] = self.quantization
        if self.kv_cache_dtype != "auto":
            extra["kv_cache_dtype"] = self.kv_cache_dtype
        if self.gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = self.gpu_memory_utilization
        return EngineConfig.model_validate({
            "max_model_len": self.max_model_len, "kv_cache_gib": self.kv_cache_gib,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "dtype": self.dtype, "cpu_threads_bind": bind, "enforce_eager": self.enforce_eager, "extra": extra})

    def stamp(self) -> dict[str, str]:
        """What the fit is valid for beyond the model: the shape's fields, as strings."""
        out = {"tp": str(self.tp), "quantization": self.quantization or "none", "kv_cache_dtype": self.kv_cache_dtype,
               "max_num_seqs": str(self.max_num_seqs), "max_model_len": str(self.max_model_len),
               "max_num_batched_tokens": str(self.max_num_batched_tokens),
               "cuda_graphs": "off" if self.enforce_eager else "on"}
        if (gpu := accelerator()) is not None:
            out["accelerator"] = gpu
        return out


def model_context(model_dir: Path) -> int | None:
    """The model's own context (config.json's max_position_embeddings, or a text_config's)."""
    try:
        cfg: Any = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for d in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        if isinstance(d, dict) and isinstance(d.get("max_position_embeddings"), int):
            return int(d["max_position_embeddings"])
    return None


def accelerator() -> str | None:
    """This box's GPUs as nvidia-smi names them ("2 × NVIDIA H100 80GB HBM3"), None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)} × {names[0]}" if names else None


def shape_from_options(o: dict[str, Any], model_dir: Path | None) -> EngineShape:
    """The shape `llmd plan calibrate`'s options ask for. `--max-model-len model` (or 0) takes the
    model's own context from its config.json; `--weight-dtype fp8` is `--quantization fp8`."""
    q = o.get("quantization") or o.get("weight_dtype")
    if q in ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
        raise PlanError(f"--weight-dtype {q}: unquantized weights are served in --dtype; give --dtype instead")
    ctx = o.get("max_model_len")
    if ctx is not None and str(ctx).lower() in ("model", "0"):
        ctx = model_context(model_dir) if model_dir is not None else None
        if ctx is None:
            raise PlanError("--max-model-len model: the model's config.json has no max_position_embeddings")
    base = EngineShape()

    def get(key: str, default: Any) -> Any:
        return default if o.get(key) is None else o[key]

    try:
        shape = replace(base, tp=int(get("tp", 1)), dtype=str(get("dtype", base.dtype)), quantization=q,
                        kv_cache_dtype=str(get("kv_cache_dtype", "auto")),
                        max_num_seqs=int(get("max_num_seqs", base.max_num_seqs)),
                        max_model_len=int(ctx if ctx is not None else base.max_model_len),
                        max_num_batched_tokens=int(get("max_num_batched_tokens", base.max_num_batched_tokens)),
                        kv_cache_gib=int(get("kv_cache_gib", base.kv_cache_gib)),
                        gpu_memory_utilization=o.get("gpu_memory_utilization"),
                        enforce_eager=not o.get("cuda_graphs", False))
    except ValueError:
        raise PlanError(f"--max-model-len: {ctx!r} is not a number of tokens (or 'model')") from None
    _check(shape)
    return shape


def _check(s: EngineShape) -> None:
    for name, v in (("--tp", s.tp), ("--max-num-seqs", s.max_num_seqs), ("--max-model-len", s.max_model_len),
                    ("--max-num-batched-tokens", s.max_num_batched_tokens), ("--kv-cache-gib", s.kv_cache_gib)):
        if v < 1:
            raise PlanError(f"{name} must be at least 1, not {v}")
    if s.gpu_memory_utilization is not None and not 0 < s.gpu_memory_utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], not {s.gpu_memory_utilization:g}")
    if s.max_num_batched_tokens < s.max_num_seqs:
        raise PlanError(f"--max-num-batched-tokens ({s.max_num_batched_tokens}) must hold a step of "
                        f"--max-num-seqs ({s.max_num_seqs}) decodes")


def _beyond(have: set[int], start: int, top: int) -> set[int]:
    """`have` up to `top`, and doubling from `start` past its largest up to `top`."""
    out, v = {x for x in have if x <= top}, start
    while v <= top:
        if v > max(have, default=0):
            out.add(v)
        v *= 2
    return out


def grid_for(base: Grid, shape: EngineShape) -> Grid:
    """`base` scaled to the shape: its points that fit, and beyond its largest batch, context and
    chunk, doubling up to the shape's limits (the largest batch, max_num_seqs itself, in decode and
    mixed points). The default (CPU) shape keeps `base` as it is."""
    if shape == replace(EngineShape(), dtype=shape.dtype, kv_cache_gib=shape.kv_cache_gib):
        return base
    steps, top_b = base.decode_steps, shape.max_num_seqs
    top_ctx = min(shape.max_model_len - steps - 1, LONGEST_CONTEXT)
    dec = [p for p in base.points if p.kind == "decode"]
    batches = sorted(_beyond({p.batch for p in dec}, 1, top_b) | {top_b})
    contexts = sorted({c for c in {p.context for p in dec} if c <= top_ctx}
                      | {128 * m + 1 for m in _beyond({(p.context - 1) // 128 for p in dec}, 1, (top_ctx - 1) // 128)
                         if 128 * m + 1 > max(p.context for p in dec)})
    chunk_top = shape.max_num_batched_tokens // 2
    chunks = sorted(_beyond({p.chunk for p in base.points if p.kind == "prefill"}, 16, chunk_top))
    if not contexts or not chunks:
        raise PlanError(f"--max-model-len {shape.max_model_len} / --max-num-batched-tokens "
                        f"{shape.max_num_batched_tokens} are too small for a calibration grid")
    befores = sorted(k for k in {p.context for p in base.points if p.kind == "prefill"} | {4096, 16384}
                     if k + chunks[-1] + 1 <= shape.max_model_len)
    mixed = {(p.batch, p.context, p.chunk) for p in base.points if p.kind == "mixed"}
    big = max((b for b, _, _ in mixed), default=0)
    mixed |= {(top_b, p, c) for b, p, c in mixed if b == big and top_b > big}
    mixed = {(b, p, c) for b, p, c in mixed
             if b <= top_b and c <= shape.max_num_batched_tokens - b and p + c + 1 <= shape.max_model_len}
    pts = [Point("decode", b, c) for c in contexts for b in batches]
    pts += [Point("prefill", 0, k, c) for k in befores for c in chunks]
    pts += [Point("mixed", b, p, c) for b, p, c in sorted(mixed)]
    return Grid(f"{base.name} (B ≤ {top_b}, context ≤ {contexts[-1]}, chunk ≤ {chunks[-1]})", tuple(pts), steps,
                base.repeats)
