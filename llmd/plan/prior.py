"""A step model from datasheet figures, for a GPU nobody here can measure: the roofline of each
step over an engine's operating range, projected onto the calibrated model's basis.

A step's roofline time, on `tp` GPUs of the datasheet's bandwidth and dense peak:

    max(bytes ÷ (TP × BW × η_bw), FLOPs ÷ (TP × peak × MFU))
      + per-layer overhead × layers + 2 all-reduces per layer (TP > 1) + per-sequence overhead × seqs

    bytes = the weights a step reads (all but an untied input embedding, which is gathered row by
            row) + the KV of every token the step attends over or writes
    FLOPs = 2 × those weights' parameters × tokens + 4 × layers × heads × head_dim × (decode
            context tokens + prefill query × key pairs)

The basis (llmd/stepmodel.py) is linear and the roofline takes a max: below the ridge (a few
hundred tokens a step on an H100) a decode step's GEMMs hide under its weight read, above it they
do not. The first prior summed the two terms, up to 2× high where they meet: against a GPU it read
−21 to +86 % (median 34-51 % over three model shapes on an H100, bench/plan_gpu.py). The
coefficients are therefore fitted, by the calibrator's own NNLS on relative error, to the roofline
at a fixed grid of the steps an engine runs (decode 1-256 sequences at 256-4,096 tokens of
context, prefill chunks of 64-8,192 tokens, mixed steps), as a calibration fits them to measured
steps. Against the same H100 steps it read median 10-11 %, worst 31 % (docs/benchmarks.md, plan
(a1)). η_bw, MFU and the overheads are the pre-measurement constants below, not fitted to it.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from llmd.plan.errors import PlanError
from llmd.plan.fit import Sample, fit_coef
from llmd.plan.gpus import Gpu
from llmd.plan.model import COMPUTE_DTYPE, ModelSpec, dtype_bytes
from llmd.stepmodel import StepShape

LAYER_OVERHEAD_S = 32e-6
SEQ_OVERHEAD_S = 4e-6
ALLREDUCE_S = 15e-6  # one collective between TP ranks (10-20 µs on NVLink)
BW_EFF = 0.7
MFU = 0.45
BAND = 0.30


def prior_grid() -> list[tuple[str, StepShape]]:
    """The steps the prior is fitted over: what an engine with vLLM's defaults (256 sequences,
    8,192 batched tokens) runs: decode-only, prefill-only (from position 0 and after 2,048 cached
    tokens) and mixed."""
    out = [(f"decode B={b} ctx={ctx}", StepShape(b, context_tokens=b * ctx, longest_context=ctx))
           for b, ctx in itertools.product((1, 2, 4, 8, 16, 32, 64, 128, 256), (256, 1024, 4096))]
    out += [(f"prefill chunk={c} after {pre}", StepShape(0, c, 1, prefill_attn=c * (pre + c / 2)))
            for c, pre in itertools.product((64, 128, 256, 512, 1024, 2048, 4096, 8192), (0, 2048))]
    out += [(f"decode B={b} ctx=1024 + prefill chunk={c}",
             StepShape(b, c, 1, b * 1024, c * c / 2, 1024)) for b, c in itertools.product((16, 64), (256, 1024, 2048))]
    return out


class Roofline:
    """One model on `tp` × `gpu` at datasheet figures: a step's time by the roofline."""

    def __init__(self, gpu: Gpu, model: ModelSpec, tp: int = 1, weight_dtype: str | None = None,
                 kv_dtype: str | None = None) -> None:
        if tp < 1:
            raise PlanError(f"--tp must be at least 1; got {tp}")
        wd = (weight_dtype or model.dtype).lower()
        peak = gpu.peak_flops(COMPUTE_DTYPE.get(wd, "bf16"))
        if gpu.bandwidth is None or peak is None:
            raise PlanError(f"{gpu.name}: no datasheet bandwidth or FLOPs for {wd}; a prior needs both")
        self.bw, self.flops = tp * gpu.bandwidth * BW_EFF, tp * peak * MFU
        self.read_params = model.params - (0 if model.tied_embeddings else model.vocab * model.hidden)
        self.weight_bytes = self.read_params * dtype_bytes(wd)
        self.kv_bytes = model.kv_bytes_per_token(kv_dtype)
        self.attn_flops = 4 * model.layers * model.heads * model.head_dim  # per query × key pair
        self.fixed = LAYER_OVERHEAD_S * model.layers + (2 * model.layers * ALLREDUCE_S if tp > 1 else 0.0)

    def seconds(self, s: StepShape) -> float:
        moved = self.weight_bytes + self.kv_bytes * (s.context_tokens + s.prefill_tokens)
        work = 2 * self.read_params * s.tokens + self.attn_flops * (s.context_tokens + s.prefill_attn)
        return max(moved / self.bw, work / self.flops) + self.fixed + SEQ_OVERHEAD_S * s.seqs


def prior_model_coef(gpu: Gpu, model: ModelSpec, tp: int = 1, weight_dtype: str | None = None,
                     kv_dtype: str | None = None) -> dict[str, float]:
    """The prior coefficients (seconds per basis unit) for `model` on `tp` × `gpu`: the basis
    fitted to the roofline over `prior_grid()`."""
    roof = Roofline(gpu, model, tp, weight_dtype, kv_dtype)
    return fit_coef([Sample(point, shape, roof.seconds(shape)) for point, shape in prior_grid()])


def prior_stamp(gpu: Gpu, model: ModelSpec, tp: int, weight_dtype: str | None) -> dict[str, str]:
    return {"kind": "prior", "engine": "datasheet", "device": gpu.name, "tp": str(tp), "model": model.name,
            "dtype": (weight_dtype or model.dtype).lower(), "band": f"±{BAND * 100:.0f}%",
            "assumptions": f"roofline fitted over {len(prior_grid())} engine steps; η_bw {BW_EFF}, MFU {MFU}, "
                           f"{LAYER_OVERHEAD_S * 1e6:.0f} µs/layer, {SEQ_OVERHEAD_S * 1e6:.0f} µs/seq, "
                           f"{ALLREDUCE_S * 1e6:.0f} µs/all-reduce",
            "source": gpu.source, "fitted_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
