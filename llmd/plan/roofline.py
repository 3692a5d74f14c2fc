"""A first-principles step-time estimate (roofline), until `llmd plan calibrate` fits a measured one.

One decode step reads every weight once and each running sequence's KV once, and does
2 × params FLOPs (plus attention) per sequence; it takes whichever is longer:
    step(B) ≈ max((weights + B × ctx × KV/token) ÷ (TP × bandwidth × η_bw),  B × FLOPs/token ÷ (TP × peak × MFU))
No per-step or per-layer overheads, no all-reduce: an optimistic bound, stated as such.
"""

from __future__ import annotations

import math

from llmd.plan.gpus import GIB
from llmd.plan.inputs import Plan
from llmd.plan.model import COMPUTE_DTYPE
from llmd.plan.sheet import Sheet, num

KIB = 1024


def peak_flops(plan: Plan) -> tuple[float | None, str]:
    wd = (plan.deploy.weight_dtype or plan.model.dtype).lower()
    cd = COMPUTE_DTYPE.get(wd, "bf16")
    return plan.deploy.gpu.peak_flops(cd), cd


def _unknown(s: Sheet, plan: Plan) -> None:
    s.add("t_weights", "weight read per step", "", None, "ms",
          f"{plan.deploy.gpu.name}: bandwidth and FLOPs unknown until `llmd plan calibrate` measures them")


def step_lines(s: Sheet, plan: Plan) -> bool:
    """The three per-step terms; False (and an 'unknown' line) where the GPU's figures are missing."""
    d, m, w = plan.deploy, plan.model, plan.workload
    s.section = "Step time (roofline: a first-principles estimate, no overheads)"
    peak, cd = peak_flops(plan)
    if d.gpu.bandwidth is None or peak is None:
        _unknown(s, plan)
        return False
    tp, bw = int(s["tp"]), d.gpu.bandwidth * d.bw_eff
    eff = f"({tp} × {d.gpu.bandwidth_tbs:g} TB/s × η_bw {d.bw_eff:g})"
    s.add("t_weights", "weight read per step", f"{num(s['weights'])} GiB ÷ {eff}", s["weights"] * GIB / (tp * bw) * 1e3,
          "ms")
    ctx = s.add("ctx_decode", "mean context while decoding", f"{num(w.prompt_tokens)} + {num(w.output_tokens)} ÷ 2",
                w.prompt_tokens + w.output_tokens / 2, "tokens")
    s.add("t_kv_seq", "KV read per sequence per step", f"{num(ctx)} × {num(s['kv_per_token'])} KiB ÷ {eff}",
          ctx * s["kv_per_token"] * KIB / (tp * bw) * 1e3, "ms")
    attn = 4 * m.layers * m.heads * m.head_dim * ctx
    s.add("flops_token", "FLOPs per decoded token", f"2 × {num(m.params)} + 4 × {m.layers} × {m.heads} × {m.head_dim}"
          f" × {num(ctx)} (attention)", (2 * m.params + attn) / 1e9, "GFLOP")
    s.add("t_flops_seq", "compute per sequence per step",
          f"{num(s['flops_token'])} GFLOP ÷ ({tp} × {num(peak / 1e12)} TFLOPs {cd} × MFU {d.mfu:g})",
          s["flops_token"] * 1e9 / (tp * peak * d.mfu) * 1e3, "ms")
    return True


def step_ms(s: Sheet, batch: float) -> float:
    return max(s["t_weights"] + batch * s["t_kv_seq"], batch * s["t_flops_seq"])


def concurrency_lines(s: Sheet, plan: Plan, known: bool) -> None:
    """Check 2: what binds concurrency, the KV memory or the step time at the ITL target?"""
    itl, kv = plan.workload.itl_ms, s["max_seqs_kv"]
    s.section = "Check: does KV or step time bind concurrency?"
    if not known:
        s.add("max_seqs", "sequences per replica", "KV only (no step model)", kv, "seqs")
        return
    tw, tkv, tf = s["t_weights"], s["t_kv_seq"], s["t_flops_seq"]
    if itl is None:
        b = s.add("max_seqs", "sequences per replica", "KV only (no --itl-ms)", kv, "seqs")
    else:
        by_step = math.floor(min((itl - tw) / tkv, itl / tf)) if itl > tw else 0
        s.add("max_seqs_step", "sequences the step time allows at the ITL target",
              f"⌊min(({num(itl)} − {num(tw)}) ÷ {num(tkv)}, {num(itl)} ÷ {num(tf)}) ms⌋", by_step, "seqs")
        b = s.add("max_seqs", "sequences per replica", f"min(KV {num(kv)}, step time {num(by_step)})",
                  min(kv, by_step), "seqs", f"{'KV memory' if kv <= by_step else 'step time'} binds")
    if b <= 0:
        return
    st = s.add("step_at_max", "step time at that batch",
               f"max({num(tw)} + {num(b)} × {num(tkv)}, {num(b)} × {num(tf)}) ms", step_ms(s, b), "ms")
    s.add("roofline_decode_tps", "decode tokens/s per replica (roofline)", f"{num(b)} seqs ÷ {num(st)} ms",
          b / st * 1e3, "tok/s")


def prefill_rate_line(s: Sheet, plan: Plan) -> None:
    """Prefill is compute-bound: TP × peak × MFU ÷ FLOPs per prompt token (attention at half the prompt)."""
    d, m, w = plan.deploy, plan.model, plan.workload
    peak, cd = peak_flops(plan)
    if peak is None or "tp" not in s:
        return
    tp = int(s["tp"])
    per_tok = 2 * m.params + 4 * m.layers * m.heads * m.head_dim * w.prompt_tokens / 2
    s.add("prefill_flops_token", "FLOPs per prompt token", f"2 × {num(m.params)} + 4 × {m.layers} × {m.heads} × "
          f"{m.head_dim} × {num(w.prompt_tokens)} ÷ 2", per_tok / 1e9, "GFLOP")
    s.add("roofline_prefill_tps", "prefill tokens/s per replica (roofline)",
          f"{tp} × {num(peak / 1e12)} TFLOPs {cd} × MFU {d.mfu:g} ÷ {num(per_tok / 1e9)} GFLOP",
          tp * peak * d.mfu / per_tok, "tok/s")
