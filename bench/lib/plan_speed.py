"""How fast `llmd plan sim` runs: an hour of seed-scale traffic (280 req/s, 1,000 + 300 tokens,
~1 M requests) on 80 replicas with every policy on (two weighted tenants, one with a quota, a
batch share, VTC, the ITL target with its step model, routing with reservations, a warm pool
with autoscaling, replica failures). The issue's bar: ≤ 60 s on the 2-core box, byte-identical
output for a seed. `section()` returns the markdown bench/plan.py writes to docs/benchmarks.md."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from llmd.config import TenantConfig
from llmd.config.parts import SchedulingConfig
from llmd.plan.sim.builtin import poisson_trace
from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.report import report_of
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


# A run in a child process, on the modules `llmd plan sim` would load (llmd/plan/compiled.py):
# they are chosen before anything imports them, so each mode needs a fresh interpreter.
_CHILD = """
import json, sys, time
from llmd.plan.compiled import use
t0 = time.perf_counter()
compiled = use(log=lambda line: print(line, file=sys.stderr))
prepared = time.perf_counter() - t0
from bench.lib.plan_speed import measure
import llmd.policy.scheduler as scheduler
m = measure(float(sys.argv[1]), control_s=None if sys.argv[2] == "-" else float(sys.argv[2]))
m.update(compiled=compiled, loaded_from=scheduler.__file__, prepare_s=prepared)
print(json.dumps(m))
"""


def measure_as(mode: str, duration_s: float, control_s: float | None = None,
               root: Path | None = None) -> dict[str, Any]:
    """`measure` in a child with LLMD_PLAN_COMPILED=`mode` ("1": compiled, "0": Python), on the
    checkout at `root` (default: this one; another: an older commit's worktree, to compare)."""
    root = root or Path(__file__).resolve().parents[2]
    env = {**os.environ, "LLMD_PLAN_COMPILED": mode, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(duration_s), "-" if control_s is None else str(control_s)],
                       check=False, cwd=root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the {mode!r} run failed:\n{r.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


# The server's own refit: llmd runs the step model as Python (only `llmd plan sim` is compiled),
# over its 512-step window, once per engine every 0.5 s, on the event loop.
_REFIT = """
import json, random, statistics, sys, time
import llmd.policy.steptime as steptime
rng = random.Random(0)
m = steptime.StepTimeModel()  # llmd's window (512 steps)
t = 0.0
for i in range(512):
    n = rng.randint(1, 64)
    pre = rng.choice((0, 0, 0, 0, 128, 512))
    d = (0.02 + 0.0008 * n + 0.00002 * pre) * (1 + rng.gauss(0, 0.05))
    t += d
    m.observe(t, n, pre, d)
walls = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    assert m._fit() is not None
    walls.append(time.perf_counter() - t0)
print(json.dumps({"ms": statistics.median(walls) * 1000, "steps": len(m.window), "file": steptime.__file__}))
"""


def server_refit_ms(repeats: int = 50) -> dict[str, Any]:
    """The server's refit as Python, timed in a child on a 512-step window of varied batches."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _REFIT, str(repeats)], check=True, cwd=root, capture_output=True,
                       text=True, env={**os.environ, "LLMD_PLAN_COMPILED": "0"})
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def section(duration_s: float = 3600.0, control_s: float | None = None, rounds: int = 3) -> str:
    """The markdown section: the seed-scale traffic, timed as `llmd plan sim` runs it (compiled,
    llmd/plan/compiled.py; `rounds` runs, the median reported: one run on this shared box read
    13.7 s and the next 19.8 s) and as Python beside it; the digests must agree (determinism)."""
    cs = sorted((measure_as("1", duration_s, control_s) for _ in range(rounds)), key=lambda m: m["wall_s"])
    c = cs[len(cs) // 2]
    p = measure_as("0", duration_s, control_s)
    refit = server_refit_ms()
    hour = 3600 / duration_s
    spread = f"median of {rounds} runs: " + " / ".join(f"{m['wall_s']:.1f}" for m in cs) + "; " if rounds > 1 else ""

    def wall(m: dict[str, Any]) -> str:
        ok = "meets" if m["wall_s"] <= 60 / hour else "misses"
        return f"{m['wall_s']:.1f} s ({spread if m is c else ''}{ok} the ≤ 60 s/hour bar)"

    def events(m: dict[str, Any]) -> str:
        return f"{m['events']:,} ({m['events_per_s']:,.0f}/s)"

    def p95s(m: dict[str, Any]) -> str:
        return f"{m['ttft_p95']} s / {m['itl_p95']} s"

    both = [("wall time", wall(c), wall(p)),
            *([] if duration_s >= 3600 else
              [("an hour, extrapolated", f"{c['wall_s'] * hour:.0f} s (target ≤ 60 s)",
                f"{p['wall_s'] * hour:.0f} s")]),
            ("events", events(c), events(p)),
            ("engine steps", f"{c['steps']:,.0f}", f"{p['steps']:,.0f}"),
            ("peak RSS", f"{c['rss_mib']:.0f} MiB", f"{p['rss_mib']:.0f} MiB"),
            ("completed", f"{c['completed']:,}", f"{p['completed']:,}"),
            ("interactive TTFT / ITL p95", p95s(c), p95s(p)),
            ("report digest", c["digest"], p["digest"]),
            ("policy modules loaded from", Path(c["loaded_from"]).name, Path(p["loaded_from"]).name),
            ("compiling before the run", f"{c['prepare_s']:.0f} s (once per version of the sources)", "-")]
    head = [("requests", f"{c['requests']:,}"), ("replicas", str(c["replicas"])), ("simulated", f"{c['sim_s']:.0f} s"),
            ("ITL controller interval", "llmd's own, 0.5 s (exact)" if control_s is None
             else f"{control_s:g} s (SimSpec.control_interval_s: an approximation)")]
    same = ("the same report, byte for byte" if len({m["digest"] for m in [*cs, p]}) == 1
            else "DIFFERENT reports (a bug)")
    return ("## `llmd plan sim`: speed\n\nSeed-scale traffic (280 req/s, 1,000 + 300 tokens, two tenants, 20 % "
            "batch, shared prefixes) on 80 replicas, every policy on (VTC, ITL target with its step model, "
            "routing with reservations, warm pool and autoscaling, failures at a 10 h MTBF).\n\n"
            + "\n".join(f"- {k}: {v}" for k, v in head) + "\n\n"
            "| | as shipped: compiled (`llmd plan sim`) | Python (`LLMD_PLAN_COMPILED=0`) |\n| --- | --- | --- |\n"
            + "\n".join(f"| {k} | {a} | {b} |" for k, a, b in both)
            + f"\n\nSpeed-up {p['wall_s'] / c['wall_s']:.2f}x; {same}.\n\n"
            f"The server's refit (llmd runs the step model as Python: {Path(refit['file']).name}, over its "
            f"{refit['steps']}-step window, once per engine every 0.5 s, on the event loop): "
            f"{refit['ms']:.2f} ms (median of 50).\n")


if __name__ == "__main__":
    print(section(float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0))


def against(other: Path, duration_s: float, rounds: int = 3) -> str:
    """The compiled simulator here against the one in checkout `other`, alternating, `rounds`
    each: the box's speed moves by a third within an hour, so versions are compared only as
    runs interleaved in one session (the digests say whether they simulate the same thing)."""
    here = Path(__file__).resolve().parents[2]
    runs: dict[Path, list[dict[str, Any]]] = {other: [], here: []}
    for _ in range(rounds):
        for root in (other, here):
            runs[root].append(measure_as("1", duration_s, root=root))

    def rev(root: Path) -> str:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                           check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=False).stdout.strip()
        return (r.stdout.strip() or str(root)) + (" + uncommitted changes" if dirty else "")

    rows = []
    for root, ms in runs.items():
        walls = sorted(m["wall_s"] for m in ms)
        each = " / ".join(f"{m['wall_s']:.1f}" for m in ms)
        rows.append(f"| {rev(root)} | {each} | {walls[len(walls) // 2]:.1f} s | {walls[0]:.1f} s "
                    f"| {walls[len(walls) // 2] * 3600 / duration_s:.0f} s | {ms[0]['digest']} |")
    old_w, new_w = (sorted(m["wall_s"] for m in runs[r]) for r in (other, here))
    return (f"Compiled, {duration_s:.0f} s simulated, the two checkouts alternating ({rounds} runs each):\n\n"
            "| llmd at | wall per run (in order) | median | best | an hour (median) | digest |\n"
            "| --- | --- | --- | --- | --- | --- |\n"
            + "\n".join(rows) + f"\n\n{rev(here)} runs {old_w[rounds // 2] / new_w[rounds // 2]:.2f}x as fast as "
            f"{rev(other)} by the medians, {old_w[0] / new_w[0]:.2f}x by the best runs (the box's neighbours only "
            "ever slow a run down).\n")
