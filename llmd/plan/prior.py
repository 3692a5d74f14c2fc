"""A step model from datasheet figures, for a GPU nobody here can measure: same basis, priors for
the coefficients, stamped as a prior with a ±30 % band (what BLIS reports for datasheet-only
transfer: 13-16 %, doubled for our simpler basis; see shared planner notes).

    c_step = per-layer overhead × layers + weights ÷ (TP × BW × η_bw) + TP all-reduce (2 per layer)
    c_seq  = 4 µs (per-request bookkeeping, BLIS's fitted figure)
    c_tok  = 2 × params FLOPs ÷ (TP × peak × MFU)
    c_kv   = KV bytes per token ÷ (TP × BW × η_bw)
    c_attn = 4 × layers × heads × head_dim FLOPs ÷ (TP × peak × MFU)   per (query × key) pair

The weight read sits in c_step: a decode step reads every weight once, whatever its batch, until
the FLOPs term overtakes it (the basis is linear, so the prior is a sum where the roofline takes
a max: at most 2× high where both are equal, exact where one dominates).
"""

from __future__ import annotations

from datetime import UTC, datetime

from llmd.plan.errors import PlanError
from llmd.plan.gpus import Gpu
from llmd.plan.model import COMPUTE_DTYPE, ModelSpec, dtype_bytes

LAYER_OVERHEAD_S = 32e-6
SEQ_OVERHEAD_S = 4e-6
ALLREDUCE_S = 15e-6  # one collective between TP ranks (10-20 µs on NVLink)
BW_EFF = 0.7
MFU = 0.45
BAND = 0.30


def prior_model_coef(gpu: Gpu, model: ModelSpec, tp: int = 1, weight_dtype: str | None = None,
                     kv_dtype: str | None = None) -> dict[str, float]:
    """The prior coefficients (seconds per basis unit) for `model` on `tp` × `gpu`."""
    if tp < 1:
        raise PlanError(f"--tp must be at least 1; got {tp}")
    wd = (weight_dtype or model.dtype).lower()
    peak = gpu.peak_flops(COMPUTE_DTYPE.get(wd, "bf16"))
    if gpu.bandwidth is None or peak is None:
        raise PlanError(f"{gpu.name}: no datasheet bandwidth or FLOPs for {wd}; a prior needs both")
    bw, flops = tp * gpu.bandwidth * BW_EFF, tp * peak * MFU
    weights = model.params * dtype_bytes(wd)
    allreduce = 2 * model.layers * ALLREDUCE_S if tp > 1 else 0.0
    return {
        "c_step": LAYER_OVERHEAD_S * model.layers + weights / bw + allreduce,
        "c_seq": SEQ_OVERHEAD_S,
        "c_tok": 2 * model.params / flops,
        "c_kv": model.kv_bytes_per_token(kv_dtype) / bw,
        "c_attn": 4 * model.layers * model.heads * model.head_dim / flops,
        "c_ctx": 0.0,  # a GPU's decode attention spreads the longest sequence over its SMs: no datasheet term
    }


def prior_stamp(gpu: Gpu, model: ModelSpec, tp: int, weight_dtype: str | None) -> dict[str, str]:
    return {"kind": "prior", "engine": "datasheet", "device": gpu.name, "tp": str(tp), "model": model.name,
            "dtype": (weight_dtype or model.dtype).lower(), "band": f"±{BAND * 100:.0f}%",
            "assumptions": f"η_bw {BW_EFF}, MFU {MFU}, {LAYER_OVERHEAD_S * 1e6:.0f} µs/layer, "
                           f"{SEQ_OVERHEAD_S * 1e6:.0f} µs/seq, {ALLREDUCE_S * 1e6:.0f} µs/all-reduce",
            "source": gpu.source, "fitted_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
