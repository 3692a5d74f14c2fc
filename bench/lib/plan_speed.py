"""How fast `llmd plan sim` runs: an hour of seed-scale traffic (280 req/s, 1,000 + 300 tokens,
~1 M requests) on 80 replicas with every policy on (two weighted tenants, one with a quota, a
batch share, VTC, the ITL target with its step model, routing with reservations, a warm pool
with autoscaling, replica failures). The issue's bar: ≤ 60 s on the 2-core box, byte-identical
output for a seed. `section()` returns the markdown bench/plan.py writes to docs/benchmarks.md."""

from __future__ import annotations

import hashlib
import json
import resource
import time
from dataclasses import replace
from typing import Any

import numpy as np

from llmd.config import TenantConfig
from llmd.config.parts import SchedulingConfig
from llmd.plan.sim.builtin import poisson_trace
from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.report import report_of, simulate
from llmd.plan.sim.spec import Autoscale, EngineSpec, SimSpec
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepModel

# A 70B fp8 model on 4 × H100, roughly (planner-anchors §2): ~15 ms of weight reads and overhead
# a step, ~2,000 decode tok/s per replica at the seed's batch; a prior, not a fit.
SEED_STEP = StepModel(coef={"c_step": 0.015, "c_seq": 5e-5, "c_tok": 2e-5, "c_kv": 2e-8, "c_attn": 1e-10},
                      stamp={"source": "bench prior (seed scale)"})


def seed_trace(duration_s: float = 3600.0, rate: float = 280.0, seed: int = 0) -> Trace:
    tr = poisson_trace(rate, duration_s, 1000, 300, seed=seed, tenants=("acme", "globex"), batch_share=0.2)
    rng = np.random.default_rng(seed + 1)
    n = len(tr)
    return replace(tr, prefix=rng.integers(-1, 16, n).astype(np.int32), prefix_tokens=np.full(n, 400, np.int32))


def seed_spec(replicas: int = 80, seed: int = 0, control_s: float | None = None) -> SimSpec:
    """The seed-scale fleet; `control_s`: SimSpec.control_interval_s (None: llmd's own, exact)."""
    return SimSpec(replicas=replicas, engine=EngineSpec(max_num_seqs=256, max_num_batched_tokens=8192,
                                                        kv_tokens=671_000),
                   scheduling=SchedulingConfig(target_itl_ms=100),
                   tenants=(TenantConfig(name="acme", weight=2),
                            TenantConfig(name="globex", tokens_per_minute=60_000_000)),
                   autoscale=Autoscale(min_active=max(1, replicas - 8), warm_pool=4, step=2),
                   mtbf_s=36_000.0, seed=seed, control_interval_s=control_s)


def measure(duration_s: float = 3600.0, replicas: int = 80, control_s: float | None = None) -> dict[str, Any]:
    """One run, timed: wall seconds, events (engine boundaries + arrivals) per second, peak RSS."""
    trace, spec = seed_trace(duration_s), seed_spec(replicas, control_s=control_s)
    t0 = time.perf_counter()
    fleet = Fleet(spec, trace, SEED_STEP)
    fleet.run()
    wall = time.perf_counter() - t0
    report = report_of(fleet, SEED_STEP)
    digest = hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()[:16]
    return {"requests": len(trace), "replicas": replicas, "sim_s": duration_s, "wall_s": wall,
            "events": fleet.events, "events_per_s": fleet.events / wall, "steps": report["utilisation"]["steps"],
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "digest": digest,
            "completed": report["requests"].get("completed", 0),
            "ttft_p95": report["by_class"]["interactive"]["ttft_s"]["p95"],
            "itl_p95": report["by_class"]["interactive"]["itl_s"]["p95"]}


def section(duration_s: float = 3600.0, control_s: float | None = None) -> str:
    """The markdown section: the seed-scale hour, timed, and a second run's digest (determinism)."""
    m = measure(duration_s, control_s=control_s)
    again = hashlib.sha256(json.dumps(simulate(seed_spec(control_s=control_s), seed_trace(duration_s), SEED_STEP),
                                      sort_keys=True).encode()).hexdigest()[:16] if duration_s <= 600 else None
    ok = "meets" if m["wall_s"] <= 60 * duration_s / 3600 else "misses"
    rows = [("requests", f"{m['requests']:,}"), ("replicas", str(m["replicas"])),
            ("simulated", f"{m['sim_s']:.0f} s"),
            ("ITL controller interval", "llmd's own, 0.5 s (exact)" if control_s is None
             else f"{control_s:g} s (SimSpec.control_interval_s: an approximation)"),
            ("wall time", f"{m['wall_s']:.1f} s ({ok} the ≤ 60 s/hour bar)"),
            *([] if duration_s >= 3600 else
              [("an hour, extrapolated", f"{m['wall_s'] * 3600 / duration_s:.0f} s (target ≤ 60 s)")]),
            ("events", f"{m['events']:,} ({m['events_per_s']:,.0f}/s)"), ("engine steps", f"{m['steps']:,.0f}"),
            ("peak RSS", f"{m['rss_mib']:.0f} MiB"), ("completed", f"{m['completed']:,}"),
            ("interactive TTFT / ITL p95", f"{m['ttft_p95']} s / {m['itl_p95']} s"),
            ("report digest", m["digest"] + ("" if again is None else f" (second run: {again})"))]
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return ("## `llmd plan sim`: speed\n\nSeed-scale traffic (280 req/s, 1,000 + 300 tokens, two tenants, 20 % "
            "batch, shared prefixes) on 80 replicas, every policy on (VTC, ITL target with its step model, "
            "routing with reservations, warm pool and autoscaling, failures at a 10 h MTBF).\n\n"
            f"| | |\n|---|---|\n{body}\n")


if __name__ == "__main__":
    import sys

    print(section(float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0))
