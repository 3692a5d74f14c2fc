"""`derive(plan)`: the whole derivation sheet, in the order a careful engineer works it out.

With per-replica rates given (the seed's 2,000 and 10,000 tok/s): workload → replicas, then
memory, then the checks. Without them the planner must first estimate them, so memory and the
roofline come first and the replicas follow from the estimate.
"""

from __future__ import annotations

from llmd.plan import checks, cost, envelope, goals, roofline
from llmd.plan.errors import PlanError
from llmd.plan.inputs import Plan
from llmd.plan.seed import SEED_CLAIMS
from llmd.plan.sheet import Sheet


def _rates(s: Sheet, plan: Plan) -> tuple[tuple[float, str], tuple[float, str]]:
    d = plan.deploy
    if d.decode_tps is None and "roofline_decode_tps" not in s:
        raise PlanError(f"{d.gpu.name}: decode rate unknown (no bandwidth and FLOPs until `llmd plan calibrate`); "
                        "give --decode-tps and --prefill-tps")
    if d.prefill_tps is None and "roofline_prefill_tps" not in s:
        raise PlanError(f"{d.gpu.name}: prefill rate unknown; give --prefill-tps")
    given = "given (the seed's figure)" if plan.seed else "given"
    dec = (d.decode_tps, given) if d.decode_tps is not None else (s["roofline_decode_tps"], "roofline estimate below")
    pre = (d.prefill_tps, given) if d.prefill_tps is not None else (s["roofline_prefill_tps"], "roofline estimate")
    return dec, pre


def _validate(plan: Plan) -> None:
    w, d = plan.workload, plan.deploy
    for name, v in (("--rate", w.rate), ("--prompt-tokens", w.prompt_tokens), ("--output-tokens", w.output_tokens),
                    ("--decode-tps", d.decode_tps), ("--prefill-tps", d.prefill_tps), ("--itl-ms", w.itl_ms),
                    ("--ttft-ms", w.ttft_ms), ("--price", d.price_per_hour), ("--tp", d.tp),
                    ("--storage-gbps", d.storage_gbps)):
        if v is not None and not v > 0:
            raise PlanError(f"{name} must be positive, not {v:g}")
    for name, u in (("--peak-util", d.peak_util), ("--avg-util", d.avg_util), ("--util-goal", d.util_goal)):
        if u is not None and not 0 < u <= 1:
            raise PlanError(f"{name} must be in (0, 1], not {u:g}")
    if not d.init_s >= 0:
        raise PlanError(f"--init-s must be ≥ 0, not {d.init_s:g}")


def derive(plan: Plan) -> Sheet:
    """Every line and finding for `plan`."""
    _validate(plan)
    s = Sheet(claims=SEED_CLAIMS if plan.seed else {})
    goals.target_lines(s, plan)
    rates_given = plan.deploy.decode_tps is not None and plan.deploy.prefill_tps is not None
    if rates_given:
        envelope.replica_lines(s, plan, *_rates(s, plan))
    envelope.memory_lines(s, plan)
    goals.cold_start_lines(s, plan)
    known = roofline.step_lines(s, plan)
    roofline.concurrency_lines(s, plan, known)
    roofline.prefill_rate_line(s, plan)
    if not rates_given:
        envelope.replica_lines(s, plan, *_rates(s, plan))
    checks.littles_law(s, plan)
    checks.efficiency(s, plan)
    checks.ttft(s, plan)
    cost.cost_lines(s, plan)
    goals.gpu_lines(s, plan)
    goals.utilisation_goal(s, plan)
    return s
