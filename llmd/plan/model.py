"""A model as the planner sees it, read from a Hugging Face `config.json`.

Only what sizes memory and work: layers, attention and KV heads, head size, hidden and MLP
widths, vocabulary and dtype. The parameter count is estimated from those (embeddings, attention,
gated MLP, norms; biases ignored) unless given, because configs rarely state it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmd.plan.errors import PlanError

# Bytes per element of each dtype name a config or an option may use.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "int8": 1, "int4": 0.5,
}
# The dtype whose peak FLOPs a GPU table row is read at, for each weight dtype.
COMPUTE_DTYPE: dict[str, str] = {"float32": "bf16", "fp32": "bf16", "float16": "bf16", "fp16": "bf16",
                                 "half": "bf16", "bfloat16": "bf16", "bf16": "bf16", "float8": "fp8",
                                 "fp8": "fp8", "float8_e4m3fn": "fp8", "int8": "fp8", "int4": "fp8"}


def dtype_bytes(name: str) -> float:
    """Bytes per element of `name`; a PlanError names the known ones."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class ModelSpec:
    """The fields of a config.json that size a deployment, and the parameter count."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    dtype: str
    params: int
    params_estimated: bool = True

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """K and V, for every layer and KV head: 2 × layers × kv_heads × head_dim × bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(kv_dtype or self.dtype)

    def kv_formula(self, kv_dtype: str | None = None) -> str:
        b = dtype_bytes(kv_dtype or self.dtype)
        return (f"2 × {self.layers} layers × {self.kv_heads} KV heads × {self.head_dim} head_dim"
                f" × {b:g} B ({kv_dtype or self.dtype})")

    def with_params(self, params: float) -> ModelSpec:
        return replace(self, params=int(params), params_estimated=False)


def estimate_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                    layers: int, vocab: int, tied: bool) -> int:
    """Embeddings (twice unless tied) + per layer: Q, K, V, O projections, a gated MLP (gate, up,
    down) and two norms; + the final norm. Good to ~1 % for Llama-family decoders."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def _int(cfg: dict[str, Any], key: str, where: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise PlanError(f"{where}: {key} is {'missing' if v is None else repr(v)}; a positive integer is needed")
    return v


def from_config(cfg: dict[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    """A ModelSpec from a parsed config.json; a PlanError names the file and the field."""
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the decoder here
        cfg = {**cfg, **cfg["text_config"]}
    layers = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    kv_heads = _int(cfg, "num_key_value_heads", where) if "num_key_value_heads" in cfg else heads
    head_dim = _int(cfg, "head_dim", where) if cfg.get("head_dim") is not None else hidden // heads
    intermediate = _int(cfg, "intermediate_size", where) if "intermediate_size" in cfg else 4 * hidden
    vocab = _int(cfg, "vocab_size", where)
    tied = bool(cfg.get("tie_word_embeddings", False))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    dtype_bytes(dtype)
    params = estimate_params(hidden, heads, kv_heads, head_dim, intermediate, layers, vocab, tied)
    return ModelSpec(name=name, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     hidden=hidden, intermediate=intermediate, vocab=vocab, tied_embeddings=tied,
                     dtype=dtype, params=params)


def load_model(path: Path) -> ModelSpec:
    """Read `path` (a config.json, or a model directory holding one)."""
    p = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{p}: no such file (give a model's config.json or its directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"{p}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{p}: not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{p}: not a config.json (a JSON object is expected)")
    name = str(cfg.get("_name_or_path") or cfg.get("_model_name_or_path") or p.parent.name)
    return from_config(cfg, name, str(p))
