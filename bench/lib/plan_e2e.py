"""End to end: does `llmd plan sim` predict what llmd does? (issue L, "What it must show")

Measured: llmd as shipped (config.toml, real vLLM engine on this box) replaying the planner's
request mix open loop at fractions of its capacity; the same on the fake backend with the same
step function the simulator uses (separating policy fidelity from step-model error); llmd's own
overheads (ingress per request, delivery per token) on the fake backend at low load, given to
the simulator. Simulated: the same traces through `llmd plan sim`. bench/plan.py calls `run`,
which measures the parts it is asked for, keeps every result in a JSON file (a real-engine
sweep is split over several short runs under the box lock) and returns the markdown report.

    python -m bench.lib.plan_e2e --parts overhead capacity-fake points-fake --loads 0.3 0.5
    flock /work/notes/box.lock python -m bench.lib.plan_e2e --parts capacity-real
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import plan_servers as ps
from bench.lib import report as report_lib
from bench.lib import stats
from bench.lib.e2e_stats import summarise, ttft_split
from bench.lib.plan_load import capacity, dump, load_point, mix_trace, undump
from bench.lib.plan_overhead import measure
from bench.lib.plan_report import report
from bench.lib.plan_sim import (
    InService,
    fake_knobs,
    first_token_holds,
    in_service_knots,
    in_service_prefill,
    simulated,
    step_contexts,
    step_time,
)
from bench.lib.replayer import Sent
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepTime

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "data" / "plan-e2e.json"
CALIBRATED = ROOT / "llmd" / "plan" / "data" / "stepmodel-local-cpu.json"  # `llmd plan calibrate` on this box
MODEL = "smollm2"  # config.toml's model
ENGINES, VARIANTS = ("real", "fake"), ("", "noitl")
PARTS = ("overhead", "capacity-fake", "capacity-real", "points-fake", "points-real", "simulate")  # and -noitl ones
HELD_OUT = (0.3, 0.5, 0.7, 0.8)  # loads the step model was not fitted at; >= 0.9 reported apart
HIGH = (0.9, 1.0)
DRAIN_S = 60.0  # a replay cuts what still runs this long after its last arrival
DUMP_ROUND_S = 1e-4  # a dump's times are rounded to 0.1 ms: the last arrival must stay inside the window


def load_results(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"capacity": {}, "points": []}


def save_results(path: Path, res: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


def config_for(engine: str, step_model: Path | None) -> dict[str, Any]:
    """config.toml as shipped on the real engine ("real") or the fake backend ("fake"); with
    "-noitl" the bench-only variant without target_itl_ms (on a CPU whose prefill steps take
    longer than the target, the ITL controller keeps the seats near 1: reported beside)."""
    base, _, variant = engine.partition("-")
    if base not in ENGINES or variant not in VARIANTS:
        raise SystemExit(f"unknown engine {engine!r}: one of {ENGINES}, optionally -{VARIANTS[1]}")
    cfg = ps.shipped()
    if variant == "noitl":
        cfg["models"][0]["scheduling"].pop("target_itl_ms", None)
    return ps.as_fake(cfg, fake_knobs(step_model)) if base == "fake" else cfg


def served(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as ps.serve runs it (the bench tenants with the shipped one's limits, its deadlines):
    what the simulator must be given. Keys and port are placeholders: nothing listens."""
    hashes = {t: "sha256:" + f"{i + 1:064x}" for i, t in enumerate(ps.TENANTS)}
    return ps.bench_config(cfg, 8000, Path("unused.db"), "sha256:" + "0" * 64, hashes)


async def _capacity(res: dict[str, Any], engine: str, a: argparse.Namespace) -> None:
    with ps.serve(f"cap-{engine}", config_for(engine, a.step_model)) as (srv, _pid):
        trace = mix_trace(rate=10.0, duration=600.0, seed=5)  # only its request shapes are used
        sent: list[Sent] = []
        steps: list[list[float]] = []
        t0 = time.monotonic()
        cap = await capacity(srv, MODEL, trace, a.concurrency, a.capacity_s, a.warmup_s, sent, steps)
    dump(raw_path(a.results, f"capacity-{engine}"), sent, t0)
    raw_path(a.results, f"capacity-{engine}-server").write_text(json.dumps({"steps": steps}) + "\n")
    print(f"  capacity {engine}: {cap.describe()}", flush=True)
    res["capacity"][engine] = {**asdict(cap), "provenance": provenance()}


async def _overhead(res: dict[str, Any], a: argparse.Namespace) -> None:
    with ps.serve("overhead", config_for("fake", a.step_model)) as (srv, _pid):
        o = await measure(srv, MODEL)
    print(f"  overheads: {o.describe()}", flush=True)
    res["overheads"] = {**asdict(o), "provenance": provenance()}


def provenance(note: str | None = None) -> dict[str, str]:
    """When, at which llmd and by which command a stored row was measured (the report lists them)."""
    out = {"at": report_lib.date(), "llmd": report_lib.code_version(), "cmd": report_lib.command()}
    return {**out, "note": note} if note else out


def raw_path(results: Path, tag: str) -> Path:
    """Where a run's per-request rows go: beside the results file."""
    d = results.parent / (results.stem + "-requests")
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{tag}.json"


def _seed(load: float, rep: int) -> int:
    return 1000 + round(load * 100) * 10 + rep


async def _points(res: dict[str, Any], engine: str, a: argparse.Namespace) -> None:
    cap = res["capacity"].get(engine)
    if cap is None:
        raise SystemExit(f"measure capacity-{engine} first (--parts capacity-{engine})")
    for rep in range(a.first_rep, a.first_rep + a.repeats):
        for load in a.loads:
            rate = load * cap["req_s"]
            seed = _seed(load, 0 if a.same_trace else rep)  # same trace: the spread is the box's, not the draw's
            trace = mix_trace(rate, a.duration_s, seed)
            # A fresh llmd per point, cold as the simulation starts: one server for all points
            # began each with the last one's ITL controller (fake 80 %: 3 seats and a fitted
            # model at t = 0, where the simulation ran 64 seats until its model took over at 54 s)
            # and, on the real engine, its prefix cache.
            with ps.serve(f"points-{engine}-{load:g}-{rep}", config_for(engine, a.step_model)) as (srv, pid):
                p, sent, t0 = await load_point(srv, pid, MODEL, engine, load, rate, trace, seed, a.warmup_s,
                                               a.drain_s)
                dump(raw_path(a.results, f"{engine}-{load:g}-{rep}"), sent, t0)
                server = {k: p.extra.pop(k) for k in ("seats", "steps", "requests")}  # llmd's side, over time
                raw_path(a.results, f"{engine}-{load:g}-{rep}-server").write_text(json.dumps(server) + "\n")
                row = {**asdict(p), "rep": rep, "duration_s": a.duration_s, "warmup_s": a.warmup_s,
                       "drain_s": a.drain_s,
                       "step_model": str(a.step_model) if a.step_model else None, "sim": None,
                       "provenance": provenance()}
                res["points"] = [x for x in res["points"] if (x["engine"], x["load"], x["rep"]) != (engine, load, rep)]
                res["points"].append(row)
                save_results(a.results, res)
                f = p.measured.figures
                print(f"  {engine} {load:.0%} rep {rep}: {rate:.2f} req/s, n {p.measured.n} {p.measured.statuses}, "
                      f"TTFT p50/p95 {f.ttft_p50 * 1000:.0f}/{f.ttft_p95 * 1000:.0f} ms, ITL p50/p95 "
                      f"{f.itl_p50 * 1000:.0f}/{f.itl_p95 * 1000:.0f} ms, {f.tput:.1f} tok/s, client CPU "
                      f"{p.client_cpu:.2f}, {p.measured.tokens_per_chunk:.2f} tokens/chunk", flush=True)


def capacity_steps(results: Path) -> tuple[list[list[float]], list[tuple[int, int] | None]]:
    """The engine's steps ([t, running, prefill tokens, duration]) in every real-engine capacity run
    kept (the shipped config's and the no-ITL variant's: the same engine and box, at small and at
    large batches), with each step's decode contexts where the run's requests are kept."""
    steps: list[list[float]] = []
    contexts: list[tuple[int, int] | None] = []
    for engine in ("real", "real-noitl"):
        server, client = raw_path(results, f"capacity-{engine}-server"), raw_path(results, f"capacity-{engine}")
        if server.exists():
            run = json.loads(server.read_text())["steps"]
            steps += run
            contexts += step_contexts(run, json.loads(client.read_text())) if client.exists() else [None] * len(run)
    return steps, contexts


def real_in_service(results: Path, step: StepTime) -> InService | None:
    """The real engine's steps in service relative to `step`, by running count and for steps
    with prefill, from the capacity runs' steps (`capacity_steps`)."""
    steps, contexts = capacity_steps(results)
    return _speed_in_service(steps, contexts, step)


def point_in_service(results: Path, row: dict[str, Any], step: StepTime) -> InService | None:
    """A real point's own engine speed in service, read as `real_in_service` reads the capacity
    runs but from that point's steps. Not a check: it takes the speed from the run it is compared
    with. It shows what is left of (c)'s error when the box's speed is known, on a shared box whose
    speed moves by a quarter within the hour between calibration and a load point."""
    tag = f"{row['engine']}-{row['load']:g}-{row['rep']}"
    server, client = raw_path(results, tag + "-server"), raw_path(results, tag)
    if not server.exists():
        return None
    steps = json.loads(server.read_text()).get("steps") or []
    contexts = step_contexts(steps, json.loads(client.read_text())) if client.exists() else None
    return _speed_in_service(steps, contexts, step)


def _speed_in_service(steps: list[list[float]], contexts: list[tuple[int, int] | None] | None,
                      step: StepTime) -> InService | None:
    """`step` corrected by the extra time `steps` took over it, by running count and with prefill."""
    knots = in_service_knots(steps, step, contexts=contexts)
    if not knots:
        return None
    return InService(step, knots, in_service_prefill(steps, InService(step, knots)))


def _simulate(res: dict[str, Any], a: argparse.Namespace) -> None:
    """Simulate every measured point (no engine runs: no lock needed). A real engine's point is
    simulated at the engine's speed in service (bench/lib/plan_sim.py) and, as `sim_raw_by_class`,
    on the calibrated model alone."""
    o = res.get("overheads") or {}
    # The capacity runs' figures, read once: the real engine's speed in service and the holds.
    real_step = step_time(a.real_step_model or (CALIBRATED if CALIBRATED.exists() else None))
    real = any(r["engine"].startswith("real") for r in res["points"])
    real_ins = real_in_service(a.results, real_step) if real else None
    holds_of = {fake: capacity_holds(a.results, fake) for fake in (True, False)}
    for row in res["points"]:
        trace = mix_trace(row["rate"], row["duration_s"], row["seed"])
        model = Path(row["step_model"]) if row.get("step_model") else None
        fake = row["engine"].startswith("fake")
        step = step_time(model) if fake else real_step
        ins = None if fake else real_ins
        cfg = served(config_for(row["engine"], model))
        holds = holds_of[fake]
        per: dict[int, list[float]] = {}
        by = sim_row(row, trace, ins or step, cfg, o, per, holds)
        row["sim_holds"] = {"held": sum(k > 0 for k in holds), "of": len(holds),
                            "tokens": sorted(k for k in holds if k)} if holds else None
        row["sim"], row["sim_by_class"] = by.pop("all", None), by or None
        row["sim_in_service"] = {"knots": [list(k) for k in ins.knots], "prefill_s": ins.prefill_s} if ins else None
        dump_file = raw_path(a.results, f"{row['engine']}-{row['load']:g}-{row['rep']}")
        measured = json.loads(dump_file.read_text()) if dump_file.exists() else None
        if measured:  # summarised again from what the client saw: a change of definition reaches every row
            row["measured"] = asdict(summarise(undump(measured), 0.0, row["warmup_s"], trace.duration + DUMP_ROUND_S))
        row["paired"] = paired(measured, per, row) if measured else None
        server_file = dump_file.with_name(dump_file.stem + "-server.json")
        server = json.loads(server_file.read_text()).get("requests") if server_file.exists() else None
        row["ttft_split"] = ttft_split(measured, server, per, row["warmup_s"], row["duration_s"]) \
            if measured and server else None
        row["sim_raw_by_class"] = sim_row(row, trace, step, cfg, o, holds=holds) if ins else None
        own = None if fake else point_in_service(a.results, row, step)
        row["sim_own_speed_by_class"] = sim_row(row, trace, own, cfg, o, holds=holds) if own else None


def capacity_holds(results: Path, fake: bool) -> tuple[int, ...]:
    """The output filters' first-token holds of the engine's capacity runs (both configs': the
    same filters and engine), never of the load points they are used for; empty where none held."""
    out: list[int] = []
    for engine in ("fake", "fake-noitl") if fake else ("real", "real-noitl"):
        p = raw_path(results, f"capacity-{engine}")
        if p.exists():
            out += first_token_holds(json.loads(p.read_text()))
    return tuple(out) if any(out) else ()


def sim_row(row: dict[str, Any], trace: Trace, step: StepTime, cfg: dict[str, Any],
            overheads: dict[str, float], per_request: dict[int, list[float]] | None = None,
            holds: tuple[int, ...] = ()) -> dict[str, Any]:
    figs = simulated(trace, step, overheads.get("ingress_s", 0.0), overheads.get("delivery_s", 0.0),
                     row["warmup_s"], cfg, row.get("drain_s", DRAIN_S), per_request, holds)
    return {k: asdict(f) for k, f in (figs or {}).items()}


def paired(measured: list[dict[str, Any]], simulated: dict[int, list[float]], row: dict[str, Any]) -> dict[str, Any]:
    """Request by request (both sides ran the same trace): |simulated - measured| / measured of
    TTFT and e2e over the window's completed requests, median and p90, %. A percentile of a few
    dozen requests moves with any one of them; this says how close each request came."""
    errs: dict[str, list[float]] = {"ttft": [], "e2e": []}
    for m in measured:
        sim = simulated.get(m["i"])
        if m["status"] != "ok" or sim is None or not row["warmup_s"] <= m["sched"] <= row["duration_s"]:
            continue
        for k, x in zip(("ttft", "e2e"), sim, strict=True):
            if m[k] and x == x:  # NaN: the simulation did not complete it by the horizon
                errs[k].append(100.0 * abs(x - m[k]) / m[k])
    out: dict[str, Any] = {"n": len(errs["ttft"])}
    for k, v in errs.items():
        out[f"{k}_median"] = stats.median(v) if v else None
        out[f"{k}_p90"] = stats.pct(v, 90) if v else None
    return out


def run(parts: tuple[str, ...] = PARTS, loads: tuple[float, ...] = HELD_OUT + HIGH, repeats: int = 1,
        duration_s: float = 75.0, warmup_s: float = 15.0, step_model: Path | None = None,
        real_step_model: Path | None = None, results: Path = RESULTS, concurrency: int = 64,
        capacity_s: float = 75.0, drain_s: float = DRAIN_S, first_rep: int = 0, same_trace: bool = False) -> str:
    """Measure `parts` (see PARTS), merge them into `results` and return the markdown report of
    everything measured so far. `step_model`: the fitted step model the fake backend and the
    simulator use for the fake points; `real_step_model`: the one the simulator uses for the
    real engine's points (default: CALIBRATED, this box's fitted model)."""
    a = argparse.Namespace(loads=loads, repeats=repeats, duration_s=duration_s, warmup_s=warmup_s,
                           step_model=step_model, real_step_model=real_step_model, results=results,
                           concurrency=concurrency, capacity_s=capacity_s, drain_s=drain_s, first_rep=first_rep,
                           same_trace=same_trace)
    res = load_results(results)
    for part in parts:
        if part not in PARTS and part.removesuffix("-noitl") not in PARTS:
            raise SystemExit(f"unknown part {part!r}; the parts are {', '.join(PARTS)} (and -noitl variants)")
        if part == "overhead":
            asyncio.run(_overhead(res, a))
        elif part.startswith("capacity-"):
            asyncio.run(_capacity(res, part.split("-", 1)[1], a))
        elif part.startswith("points-"):
            asyncio.run(_points(res, part.split("-", 1)[1], a))
        else:
            _simulate(res, a)
        save_results(results, res)
    return report(res, HELD_OUT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="*", default=list(PARTS), help=f"of {', '.join(PARTS)} (and X-noitl)")
    p.add_argument("--loads", nargs="+", type=float, default=list(HELD_OUT + HIGH))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--duration-s", type=float, default=75.0)
    p.add_argument("--warmup-s", type=float, default=15.0)
    p.add_argument("--step-model", type=Path)
    p.add_argument("--real-step-model", type=Path)
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--capacity-s", type=float, default=75.0)
    p.add_argument("--drain-s", type=float, default=DRAIN_S)
    p.add_argument("--first-rep", type=int, default=0, help="number repeats from here (a later run adds repeats)")
    p.add_argument("--same-trace", action="store_true", help="every repeat replays rep 0's trace (box noise only)")
    a = p.parse_args(argv)
    print(run(tuple(a.parts), tuple(a.loads), a.repeats, a.duration_s, a.warmup_s, a.step_model, a.real_step_model,
              a.results, a.concurrency, a.capacity_s, a.drain_s, a.first_rep, a.same_trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
