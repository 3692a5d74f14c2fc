"""`simulate`: run a fleet over a trace and say what it did, as a JSON-able dict.

Deterministic: the same spec, trace and step model give the same dict, byte for byte once dumped
with sorted keys (floats rounded to 6 significant digits; no wall clock; tenants and classes in
a fixed order).
"""

from __future__ import annotations

from typing import Any

from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.hist import Hist
from llmd.plan.sim.spec import SimSpec
from llmd.plan.sim.trace import CLASSES, Trace
from llmd.stepmodel import BASIS, StepTime


def rounded(x: Any) -> Any:
    """Floats to 6 significant digits, recursively: a report that dumps the same every run."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {str(k): rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v) for v in x]
    return x


def simulate(spec: SimSpec, trace: Trace, step: StepTime) -> dict[str, Any]:
    """The fleet `spec` serving `trace`, each engine step priced by `step`."""
    fleet = Fleet(spec, trace, step)
    fleet.run()
    return report_of(fleet, step)


def report_of(fleet: Fleet, step: StepTime) -> dict[str, Any]:
    """The report of a fleet that has run."""
    report: dict[str, Any] = rounded(_report(fleet, step))
    return report


def _latency(fleet: Fleet, itls: dict[tuple[str, str], Hist], kind: str, name: str, slo_ttft: float,
             slo_itl: float) -> dict[str, Any]:
    rec = fleet.rec
    ttft, itl = rec.ttft[(kind, name)], itls[(kind, name)]
    out = {"ttft_s": ttft.summary(), "itl_s": itl.summary(), "e2e_s": rec.e2e[(kind, name)].summary()}
    t95, i95 = ttft.quantile(0.95), itl.quantile(0.95)
    out["meets_slo"] = {"ttft_p95": None if t95 is None else t95 <= slo_ttft,
                        "itl_p95": None if i95 is None else i95 <= slo_itl}
    return out


def _report(fleet: Fleet, step: StepTime) -> dict[str, Any]:
    spec, rec = fleet.spec, fleet.rec
    slo = spec.slo
    billed_h = fleet.scaler.close() / 3600.0
    span = max(fleet.now, 1e-9)
    out_tok, in_tok = sum(rec.tokens_out.values()), sum(rec.tokens_in.values())
    dollars = billed_h * spec.price_per_hour
    itls = rec.itl()
    return {
        "sim_time_s": span,
        "slo": {"ttft_p95_s": slo.ttft_p95_s, "itl_p95_s": slo.itl_p95_s},
        "requests": dict(sorted(rec.counts.items())),
        "by_class": {c: _latency(fleet, itls, "class", c, slo.ttft_p95_s, slo.itl_p95_s) for c in CLASSES},
        "by_tenant": {t: _latency(fleet, itls, "tenant", t, slo.ttft_p95_s, slo.itl_p95_s)
                      for t in fleet.trace.tenants},
        "throughput": {"output_tokens_per_s": out_tok / span, "prompt_tokens_per_s": in_tok / span,
                       "requests_per_s": rec.counts["completed"] / span},
        "cost": {"replica_hours": billed_h, "dollars": dollars,
                 "per_million_output_tokens": dollars / out_tok * 1e6 if out_tok else None,
                 "per_million_tokens": dollars / (out_tok + in_tok) * 1e6 if out_tok + in_tok else None},
        "utilisation": _utilisation(fleet, step, billed_h * 3600.0),
        "sheds": {f"{t}/{r}": n for (t, r), n in sorted(rec.shed.items())},
        "seats": {"max": spec.scheduling.max_running or spec.engine.max_num_seqs,
                  "limit_at_end": [r.core.seat_limit for r in fleet.replicas]},
        "preemptions": {"scheduler": sum(r.sched_preempted for r in fleet.replicas),
                        "engine_kv": sum(r.engine.preempted for r in fleet.replicas)},
        "failures": {"replicas": fleet.scaler.failures, "requeued": rec.counts["failed_requeued"],
                     "lost": rec.counts["failed_lost"]},
        "autoscale": {"scale_ups": fleet.scaler.scale_ups, "scale_downs": fleet.scaler.scale_downs},
        "fairness": _fairness(fleet),
        "timeline": fleet.timeline,
    }


def _utilisation(fleet: Fleet, step: StepTime, billed_s: float) -> dict[str, Any]:
    """Where the step time went, by the step model's terms, over the billed replica-time: KV reads
    (c_kv, c_ctx: attention bandwidth and its longest sequence), token compute (c_tok, c_attn: GEMM
    and prefill attention FLOPs), fixed overheads (c_step, c_seq); and seats held over seats billed.
    Busy time says little."""
    basis = [sum(r.engine.basis[i] for r in fleet.replicas) for i in range(len(BASIS))]
    coef: dict[str, float] = getattr(step, "coef", {})
    seconds = {name: coef.get(name, 0.0) * basis[i] for i, name in enumerate(BASIS)}
    d = max(billed_s, 1e-9)
    seats = fleet.spec.engine.max_num_seqs
    out: dict[str, Any] = {
        "busy": sum(r.engine.busy_s for r in fleet.replicas) / d,
        "seat_occupancy": sum(r.engine.seat_s for r in fleet.replicas) / (d * seats),
        "prefix_cache_hit_tokens": sum(r.engine.cache.hit_tokens for r in fleet.replicas),
        "steps": basis[0],
    }
    if coef:
        out["kv_bandwidth"] = (seconds["c_kv"] + seconds["c_ctx"]) / d
        out["compute"] = (seconds["c_tok"] + seconds["c_attn"]) / d
        out["overhead"] = (seconds["c_step"] + seconds["c_seq"]) / d
        out["step_seconds_by_term"] = seconds
    return out


def _fairness(fleet: Fleet) -> dict[str, Any]:
    """Each tenant's service (w_in·prompt + w_out·output tokens served) against its weighted share
    among the tenants that were served; Jain's index over service / weight."""
    sc, rec = fleet.spec.scheduling, fleet.rec
    service = {t: sc.w_in * rec.tokens_in[t] + sc.w_out * rec.tokens_out[t] for t in fleet.trace.tenants}
    weights = {t.name: t.weight for t in fleet.tenants}
    total = sum(service.values())
    served = [t for t in fleet.trace.tenants if service[t] > 0]
    wsum = sum(weights[t] for t in served) or 1.0
    x = [service[t] / weights[t] for t in served]
    jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if x and any(x) else None
    return {"jain_index": jain, "tenants": {
        t: {"service": service[t], "share": service[t] / total if total else 0.0,
            "weighted_share": weights[t] / wsum if t in served else 0.0} for t in fleet.trace.tenants}}
