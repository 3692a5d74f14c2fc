"""The envelope itself: workload → replicas, and model + GPU → memory per replica.

Each function writes its lines to the sheet in the order they are derived and returns nothing
the sheet does not hold, so the printed derivation is the computation.
"""

from __future__ import annotations

import math

from llmd.plan.errors import PlanError
from llmd.plan.gpus import GIB
from llmd.plan.inputs import Plan
from llmd.plan.model import dtype_bytes
from llmd.plan.sheet import Sheet, num

KIB = 1024


def replica_lines(s: Sheet, plan: Plan, decode: tuple[float, str], prefill: tuple[float, str]) -> None:
    """Output and prompt tokens/s at peak, then the replicas each needs, then the fleet."""
    w, d = plan.workload, plan.deploy
    s.section = "Workload → replicas"
    out = s.add("output_tps", "output tokens/s", f"{num(w.rate)} req/s × {num(w.output_tokens)} tok",
                w.rate * w.output_tokens, "tok/s")
    s.add("decode_tps", "decode tokens/s per replica", decode[1], decode[0], "tok/s")
    dec = s.add("decode_replicas", "decode replicas", f"⌈{num(out)} ÷ {num(decode[0])} = {num(out / decode[0])}⌉",
                math.ceil(out / decode[0] - 1e-9), "")
    pin = s.add("prompt_tps", "prompt tokens/s", f"{num(w.rate)} req/s × {num(w.prompt_tokens)} tok",
                w.rate * w.prompt_tokens, "tok/s")
    s.add("prefill_tps", "prefill tokens/s per replica", prefill[1], prefill[0], "tok/s")
    pre = s.add("prefill_replicas", "prefill replicas",
                f"⌈{num(pin)} ÷ {num(prefill[0])} = {num(pin / prefill[0])}⌉", math.ceil(pin / prefill[0] - 1e-9), "")
    tot = s.add("replicas_at_peak", "replicas busy at peak", f"{num(dec)} + {num(pre)}", dec + pre, "")
    note = (f"headroom: each replica planned at {d.peak_util:.1%} of its rate, +{1 / d.peak_util - 1:.1%} replicas"
            " for bursts, failures and rollouts")
    if plan.seed:
        note += ("; the seed states no formula for its ~80: this is the reading that gives 80 exactly"
                 f" (70 × 1.15 = {70 * 1.15:g} is the same within rounding)")
    s.add("fleet_replicas", "fleet with headroom", f"⌈{num(tot)} ÷ {d.peak_util:g} = {num(tot / d.peak_util)}⌉",
          math.ceil(tot / d.peak_util - 1e-9), "replicas", note)


def _choose_tp(plan: Plan, weights: float) -> tuple[int, str]:
    d = plan.deploy
    usable = d.gpu.hbm_gib * GIB * d.mem_util - d.reserve_gib * GIB
    if d.tp is not None:
        return d.tp, "given"
    for tp in (1, 2, 4, 8):
        if weights <= 0.5 * tp * usable:
            return tp, "the fewest of 1, 2, 4, 8 whose usable memory is at least twice the weights"
    raise PlanError(f"{weights / GIB:,.0f} GiB of weights do not fit 8 × {d.gpu.name} with room for KV; "
                    "give --tp or a smaller --weight-dtype")


def memory_lines(s: Sheet, plan: Plan) -> None:
    """Parameters → weight bytes → GPUs per replica; KV per token → KV memory → sequences."""
    m, w, d = plan.model, plan.workload, plan.deploy
    s.section = "Memory per replica"
    how = "given" if not m.params_estimated else (
        f"embeddings {num(m.vocab)} × {num(m.hidden)} × {1 if m.tied_embeddings else 2} + {m.layers} layers × "
        f"(attention {num(2 * m.hidden * m.head_dim * (m.heads + m.kv_heads))} + gated MLP "
        f"{num(3 * m.hidden * m.intermediate)} + norms {num(2 * m.hidden)}) + {num(m.hidden)}")
    p = s.add("params", "parameters", how, m.params, "", f"{m.params / 1e9:.2f} B ({m.name})")
    wd = d.weight_dtype or m.dtype
    weights = s.add("weights", "weight bytes", f"{num(p)} × {dtype_bytes(wd):g} B ({wd})", p * dtype_bytes(wd) / GIB,
                    "GiB") * GIB
    tp, why = _choose_tp(plan, weights)
    s.add("tp", "GPUs per replica (tensor parallel)", why, tp, f"× {d.gpu.name}")
    kvb = m.kv_bytes_per_token(d.kv_dtype)
    s.add("kv_per_token", "KV per token", f"{m.kv_formula(d.kv_dtype)} = {num(kvb)} B", kvb / KIB, "KiB")
    s.add("kv_per_token_gpu", "KV per token per GPU", f"{num(kvb / KIB)} KiB ÷ {tp}", kvb / KIB / tp, "KiB",
          "KV heads split across the tensor-parallel GPUs")
    kv_mem = tp * (d.gpu.hbm_gib * d.mem_util - d.reserve_gib) - weights / GIB
    s.add("kv_memory", "KV memory per replica",
          f"{tp} × ({num(d.gpu.hbm_gib)} GiB × {d.mem_util:g} − {d.reserve_gib:g} GiB reserve) − "
          f"{num(weights / GIB)} GiB weights", kv_mem, "GiB")
    if kv_mem <= 0:
        raise PlanError(f"the weights ({weights / GIB:,.1f} GiB) leave no KV memory on {tp} × {d.gpu.name}; "
                        "give a larger --tp or a smaller --weight-dtype")
    tokens = s.add("kv_tokens", "KV capacity", f"{num(kv_mem)} GiB ÷ {num(kvb / KIB)} KiB",
                   kv_mem * GIB / kvb, "tokens")
    ctx = s.add("context", "context per sequence", f"{num(w.prompt_tokens)} prompt + {num(w.output_tokens)} output",
                w.prompt_tokens + w.output_tokens, "tokens",
                "a sequence's KV at its last token: what admission must fit")
    s.add("max_seqs_kv", "sequences by KV", f"⌊{num(tokens)} ÷ {num(ctx)}⌋", math.floor(tokens / ctx), "seqs")
