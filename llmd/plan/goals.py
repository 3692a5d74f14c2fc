"""What the plan must meet and what it takes to start: the targets it was given, the cold start
of one replica, the fleet counted in GPUs, and a utilisation goal read against the cost lines.

These are the places a careful reader of an envelope finds it at odds with itself: a replica of
4 GPUs counted as one "GPU", a utilisation goal that the fleet the cost assumes cannot reach, a
cold start that names only the weights' transfer.
"""

from __future__ import annotations

from llmd.plan.gpus import GIB
from llmd.plan.inputs import Plan
from llmd.plan.sheet import Sheet, num, usd


def target_lines(s: Sheet, plan: Plan) -> None:
    """The SLOs and the utilisation goal as given (with --seed, as the seed states them)."""
    w, d = plan.workload, plan.deploy
    s.section = "Targets"
    where = "the seed's" if plan.seed else "given"
    s.add("ttft_target", "TTFT p95 target", where if w.ttft_ms is not None else "none given (--ttft-ms)",
          w.ttft_ms, "ms")
    s.add("itl_target", "ITL p95 target", where if w.itl_ms is not None else "none given (--itl-ms)", w.itl_ms, "ms")
    if d.util_goal is not None:
        s.add("util_goal", "utilisation goal", where, d.util_goal * 100, "%", "the fleet's mean busy fraction")


def cold_start_lines(s: Sheet, plan: Plan) -> None:
    """One replica from nothing to serving: its weights over the storage bandwidth, then the
    engine's own start (assumed: graph capture, warm-up), which a weights-only figure omits."""
    d = plan.deploy
    s.section = "Cold start of one replica"
    gb = s.add("weights_gb", "weight bytes in GB", f"{num(s['weights'])} GiB × 1.074", s["weights"] * GIB / 1e9, "GB")
    load = s.add("weight_load_s", "weights from storage", f"{num(gb)} GB ÷ {num(d.storage_gbps)} GB/s",
                 gb / d.storage_gbps, "s", f"storage bandwidth {num(d.storage_gbps)} GB/s"
                 + (" (the seed's)" if plan.seed else " (--storage-gbps)"))
    s.add("init_s", "engine initialisation", "assumed (--init-s)", d.init_s, "s",
          "process and engine start, CUDA graph capture, warm-up: measure yours")
    s.add("cold_start_s", "cold start", f"{num(load)} s + {num(d.init_s)} s", load + d.init_s, "s",
          "what a replica added under load takes to serve (a warm pool: seconds)")


def gpu_lines(s: Sheet, plan: Plan) -> None:
    """The fleet counted in GPUs: replicas × GPUs per replica. The seed's ~80 are replicas."""
    s.section = "Fleet in GPUs"
    fleet, tp, name = s["fleet_replicas"], int(s["tp"]), plan.deploy.gpu.name
    gpus = s.add("fleet_gpus", "GPUs in the fleet", f"{num(fleet)} replicas × {tp} GPUs", fleet * tp, f"× {name}")
    if plan.seed and tp > 1:
        price = s["price_per_replica"] if "price_per_replica" in s else float("nan")
        s.flag("gpus_vs_replicas", f'the seed\'s ~{num(fleet)} "GPUs" are replicas of {tp} × {name}: '
               f"{num(gpus)} GPUs",
               f"{num(fleet)} replicas × {tp} GPUs each (tensor parallel: {num(s['weights'])} GiB of weights and "
               f"the KV of ~{num(s['max_seqs_kv'])} sequences) = {num(gpus)} GPUs",
               f"{num(fleet)} GPUs make {num(fleet)} ÷ {tp} = {num(fleet / tp)} replicas: "
               f"{1 / tp:.0%} of the fleet the workload needs",
               *([f"the cost lines price replicas ({usd(price)}/h each = {usd(price / tp)}/GPU-h), so they "
                  f"hold for {num(gpus)} GPUs"] if price == price else []))


def utilisation_goal(s: Sheet, plan: Plan) -> None:
    """A mean-utilisation goal against the fleet the cost lines price: sized for the peak at
    `peak_util` and paid at `avg_util` mean load, it runs at their product all day."""
    d = plan.deploy
    goal = d.util_goal
    if goal is None or "fleet_cost_output" not in s:
        return
    s.section = "Check: utilisation goal vs the cost's load"
    mean = s.add("static_util", "mean utilisation of the fleet sized for the peak",
                 f"{d.avg_util:g} mean load × {d.peak_util:g} at peak × 100", d.avg_util * d.peak_util * 100, "%") / 100
    at_goal = s.add("fleet_cost_output_goal", f"whole fleet per million output tokens at {goal:.0%} utilisation",
                    f"{usd(s['fleet_cost_output'])} × {d.peak_util:g} ÷ {goal:g}",
                    s["fleet_cost_output"] * d.peak_util / goal, "$/M tok", "a fleet that follows the load")
    if mean >= goal:
        return
    fleet = s["fleet_replicas"]
    s.flag("util_goal", f"a {goal:.0%} utilisation goal beside a cost at {d.avg_util:.0%} load: the fleet the cost "
           f"prices runs at {mean:.0%}",
           f"sized for the peak ({num(fleet)} replicas at {d.peak_util:.1%}) and loaded at {d.avg_util:.0%} of it on "
           f"average: {d.avg_util:g} × {d.peak_util:g} = {mean:.0%} utilisation, {mean / goal:.0%} of the goal",
           f"holding {goal:.0%} takes a fleet that follows the load: {num(fleet)} × {mean:.0%} ÷ {goal:.0%} = "
           f"{num(fleet * mean / goal)} replicas on average (autoscaling, each added one a "
           f"{num(s['cold_start_s'])} s cold start away)",
           f"then the whole fleet costs {usd(at_goal)}/M output tokens, not {usd(s['fleet_cost_output_avg'])} "
           f"(static at {d.avg_util:.0%}); the one-replica formula at {goal:.0%}: "
           f"{usd(s['seed_cost_full'])} ÷ {goal:g} = {usd(s['seed_cost_full'] / goal)}/M, not "
           f"{usd(s['seed_cost_at_util'])}",
           "the two figures describe two different fleets: state which one is planned")
