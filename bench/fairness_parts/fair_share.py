"""Part (b), fair share under overload: do two tenants get equal service when both want more?

Two tenants offer requests 1:2 at about twice the engine's capacity, through llmd with
fairness fcfs, vtc, and fcfs plus per-tenant requests_per_minute. Service = input tokens x 1
+ output tokens x 2 (llmd's VTC weights), accumulated from the streamed chunks; VTC should
keep the difference between the tenants bounded where FCFS lets it grow with the rate ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from typing import Any

from bench.fairness_parts import PartResult
from bench.lib import report, stats
from bench.lib.engines import Bench, Srv
from bench.lib.load import (
    AdminSampler,
    Body,
    Workers,
    cancel_all,
    medium_body,
    open_loop,
    preempted,
    seat_summary,
    warm_up,
)
from bench.lib.streams import (
    Stream,
    new_client,
    output_tokens_between,
    statuses,
    token_weight,
)

TITLE = "(b) Two tenants at about 2x capacity"
QUICK: dict[str, Any] = {"share_duration_s": 20.0, "calib_s": 8.0}
W_IN, W_OUT = 1.0, 2.0  # service weights, as llmd's VTC defaults
# The baseline: arrival order, and none of llmd's seat-level fairness (reserved seats for tenants below their
# share, preemption of the most over-share tenant), which otherwise applies whatever the queue's policy.
PURE_FCFS: dict[str, Any] = {"fairness": "fcfs", "reserved_seats": 0, "preempt_for_fairness": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("part b: fair share under overload")
    g.add_argument("--share-duration-s", type=float, default=60.0)
    g.add_argument("--overload", type=float, default=2.0, help="offered load / measured capacity")
    g.add_argument("--share-max-tokens", type=int, default=128)
    g.add_argument("--share-prompt-tokens", type=int, default=100, help="(the prompt is fixed text of about this size)")
    g.add_argument("--sample-s", type=float, default=5.0, help="service difference sampling interval")
    g.add_argument("--capacity-rps", type=float, help="skip calibration: engine capacity in requests/s")
    g.add_argument("--calib-s", type=float, default=20.0, help="capacity calibration window (closed loop)")


def poisson(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at `rate` per second over `duration` seconds."""
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def service_curve(results: list[Stream], t0: float, times: list[float], prompt_default: float) -> list[float]:
    """Accumulated service (input x W_IN at the first token, output x W_OUT per chunk) at t0 + each of `times`."""
    w = token_weight(results)
    events: list[tuple[float, float]] = []
    for s in results:
        if s.t_first is None:
            continue
        events.append((s.t_first - t0, (s.prompt_tokens or prompt_default) * W_IN))
        wt = w(s) * W_OUT
        events += [(t - t0, wt) for t in s.chunks]
    events.sort()
    out, acc, i = [], 0.0, 0
    for t in times:
        while i < len(events) and events[i][0] <= t:
            acc += events[i][1]
            i += 1
        out.append(acc)
    return out


async def calibrate(bench: Bench, srv: Srv) -> float:
    """The engine's capacity for part b's requests, in requests/s: output tokens/s over max_tokens, closed loop
    at max_num_seqs streams, counted by the engine (/admin/engines history) once 90% of the streams have their
    first token (so the initial prefill burst is left out), for `calib_s`."""
    a = bench.args
    async with new_client() as client:
        await warm_up(client, srv, "a", a.name)
        sampler = AdminSampler(client, srv, a.name)
        w = Workers(client, srv, "a", a.max_num_seqs, "/v1/completions",
                    lambda i: medium_body(a.name, "cal", i, a.share_max_tokens), srv.headers("a"), stagger_s=3.0)
        w.start()
        t_give_up = time.monotonic() + 120
        while sum(1 for s in w.results if s.t_first is not None) < 0.9 * w.n and time.monotonic() < t_give_up:
            await asyncio.sleep(0.5)
        u0 = time.time()
        await asyncio.sleep(a.calib_s)
        u1 = time.time()
        hist = await sampler.history(u0)
        await w.stop()
    tps = sum(r["generated_tokens"] for r in hist if r["t"] <= u1) / (u1 - u0)
    await asyncio.sleep(2)  # let the engine finish aborting
    cap = tps / a.share_max_tokens
    if cap < 0.05:
        raise RuntimeError(f"calibration measured {tps:.1f} output tokens/s: too little to size part b; "
                           f"see {srv.log}")
    return cap


def _bodies(a: argparse.Namespace, tenant: str) -> Body:
    return lambda i: medium_body(a.name, tenant, i, a.share_max_tokens)


async def _drive(bench: Bench, srv: Srv, scheds: dict[str, list[float]]) -> tuple[dict[str, list[Stream]],
                                                                                 AdminSampler, float, float]:
    """Both tenants' open-loop schedules for --share-duration-s; whatever is left then is cut."""
    a = bench.args
    results: dict[str, list[Stream]] = {t: [] for t in scheds}
    tasks: list[asyncio.Task[Stream]] = []
    async with new_client() as client:
        await warm_up(client, srv, "a", a.name)
        sampler = AdminSampler(client, srv, a.name)
        sampler.start()
        t0 = time.monotonic() + 0.2
        senders = [asyncio.create_task(open_loop(client, srv, t, sched, t0, "/v1/completions", _bodies(a, t),
                                                 srv.headers(t), None, results[t], tasks))
                   for t, sched in scheds.items()]
        await asyncio.sleep(t0 + a.share_duration_s - time.monotonic())
        t_end = time.monotonic()
        await cancel_all(senders)
        await cancel_all(list(tasks))
        await sampler.stop()
    return results, sampler, t0, t_end


async def share_run(bench: Bench, srv: Srv, label: str, sched_a: list[float], sched_b: list[float]) -> dict[str, Any]:
    """Both schedules through `srv`; the tenants' service curves and their difference over time."""
    a = bench.args
    results, sampler, t0, t_end = await _drive(bench, srv, {"a": sched_a, "b": sched_b})
    D = t_end - t0
    times = [x * a.sample_s for x in range(1, int(D / a.sample_s + 1e-9) + 1)]
    prompt_default = stats.median([s.prompt_tokens for v in results.values() for s in v if s.prompt_tokens] or [100])
    curves = {t: service_curve(results[t], t0, times, prompt_default) for t in results}
    diff = [abs(x - y) for x, y in zip(curves["a"], curves["b"], strict=True)]
    half = [d for t, d in zip(times, diff, strict=True) if t <= D / 2]
    second = [d for t, d in zip(times, diff, strict=True) if t > D / 2]
    tok = {t: output_tokens_between(results[t], t0, t_end) for t in results}
    row: dict[str, Any]
    row = {"config": label, "times": times, "S_a": curves["a"], "S_b": curves["b"], "diff": diff,
           "max_diff": max(diff) if diff else math.nan, "final_diff": diff[-1] if diff else math.nan,
           "max_first_half": max(half) if half else math.nan, "max_second_half": max(second) if second else math.nan,
           "tps": (tok["a"] + tok["b"]) / D, "tps_a": tok["a"] / D, "tps_b": tok["b"] / D,
           "sent": {t: len(v) for t, v in results.items()}, "statuses": {t: statuses(v) for t, v in results.items()},
           "seats": seat_summary(sampler.samples), "duration": D, "preempted": preempted(sampler.samples),
           "fairness_counters": sampler.samples[-1]["fairness"] if sampler.samples else None}
    print(f"    {label}: max |S_A-S_B| {row['max_diff']:.0f}, final {row['final_diff']:.0f}, "
          f"preempted {row['preempted']}, {row['tps']:.0f} tok/s (A {row['tps_a']:.0f}, B {row['tps_b']:.0f}); "
          f"A: {row['statuses']['a']}; "
          f"B: {row['statuses']['b']}", flush=True)
    return row


def _verdicts(a: argparse.Namespace, fcfs: dict[str, Any], vtc: dict[str, Any]) -> list[tuple[str, bool]]:
    slack = a.share_prompt_tokens * W_IN + a.share_max_tokens * W_OUT  # one request's service
    bounded = vtc["max_second_half"] <= 1.5 * vtc["max_first_half"] + slack
    return [
        ((f"vtc: |S_A-S_B| bounded: max over 2nd half {vtc['max_second_half']:.0f} <= 1.5 x max over 1st half "
         f"{vtc['max_first_half']:.0f} + one request's service {slack:.0f}"), bounded),
        (f"vtc max |S_A-S_B| {vtc['max_diff']:.0f} <= 0.5 x fcfs's {fcfs['max_diff']:.0f}",
         vtc["max_diff"] <= 0.5 * fcfs["max_diff"]),
        (f"vtc throughput {vtc['tps']:.0f} tok/s >= 0.95 x fcfs's {fcfs['tps']:.0f}", vtc["tps"] >= 0.95 * fcfs["tps"]),
    ]


def _lines(a: argparse.Namespace, rows: list[dict[str, Any]], cap: float, n_a: int, n_b: int,
           verdicts: list[tuple[str, bool]]) -> list[str]:
    head = ["configuration", "max abs(S_A-S_B)", "final abs(S_A-S_B)", "max 1st/2nd half", "S_A final", "S_B final",
            "out tok/s", "A tok/s", "B tok/s", "preempted", "A requests", "B requests"]
    body = [[r["config"], f"{r['max_diff']:.0f}", f"{r['final_diff']:.0f}",
             f"{r['max_first_half']:.0f} / {r['max_second_half']:.0f}", f"{r['S_a'][-1]:.0f}", f"{r['S_b'][-1]:.0f}",
             report.num(r["tps"]), report.num(r["tps_a"]), report.num(r["tps_b"]), r["preempted"],
             f"{r['sent']['a']} sent: {r['statuses']['a']}", f"{r['sent']['b']} sent: {r['statuses']['b']}"]
            for r in rows]
    series_head = ["t s"] + [r["config"] for r in rows]
    series = [[f"{t:g}"] + [f"{r['diff'][k]:.0f}" if k < len(r["diff"]) else "" for r in rows]
              for k, t in enumerate(rows[0]["times"])]
    return [
        (f"Open-loop Poisson arrivals (seed {a.seed}, the same schedule for every configuration) for "
         f"{a.share_duration_s:g} s: tenant A at 1/3 and tenant B at 2/3 of {a.overload:g} x the measured capacity "
         f"({cap:.2f} req/s = {cap * 60:.0f} req/min, closed loop at {a.max_num_seqs} streams), i.e. "
         f"{n_a} and {n_b} requests. Each request: a ~{a.share_prompt_tokens}-token prompt, "
         f"max_tokens {a.share_max_tokens}, ignore_eos, streamed. Service S = input tokens x {W_IN:g} (at the first "
         f"token) + output tokens x {W_OUT:g} (per chunk, scaled to the stream's usage), accumulated from t = 0; "
         "anything still running or queued at the end is cut. default_deadline_s 600, max_queue 100000. "
         "A 429 is a rejected request (not retried). The fcfs rows are the baseline: reserved_seats 0 and "
         "preempt_for_fairness false; the vtc row runs llmd's defaults (reserved seats for tenants below their "
         "share, preemption of the most over-share tenant). A requests_per_minute bucket starts full (one "
         "minute's worth), so in a 60 s run it only bites once a tenant has spent that burst."),
        "", *report.table(head, body), "", f"abs(S_A - S_B) every {a.sample_s:g} s:", "",
        *report.table(series_head, series), "", *report.verdict_lines(verdicts),
    ]


async def run(bench: Bench) -> PartResult:
    a = bench.args
    print("part b: two tenants, 1:2 request rates, about 2x capacity", flush=True)
    tenants: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    rng = random.Random(a.seed)
    rows: list[dict[str, Any]] = []
    with bench.llmd("b-fcfs", PURE_FCFS, tenants) as srv:
        cap = a.capacity_rps or await calibrate(bench, srv)
        rate = a.overload * cap
        sched_a = poisson(rate / 3, a.share_duration_s, rng)
        sched_b = poisson(2 * rate / 3, a.share_duration_s, rng)
        print(f"    capacity {cap:.2f} req/s ({'given' if a.capacity_rps else 'measured'}); offering {rate:.2f} req/s: "
              f"A {len(sched_a)} and B {len(sched_b)} requests in {a.share_duration_s:g}s", flush=True)
        rows.append(await share_run(bench, srv, "fcfs", sched_a, sched_b))
    with bench.llmd("b-vtc", {"fairness": "vtc"}, tenants) as srv:
        rows.append(await share_run(bench, srv, "vtc", sched_a, sched_b))
    rpm = max(1, round(cap * 60 / 2))
    limited = {t: {"requests_per_minute": rpm} for t in tenants}
    with bench.llmd("b-rpm", PURE_FCFS, limited) as srv:
        rows.append(await share_run(bench, srv, f"fcfs + requests_per_minute {rpm} each", sched_a, sched_b))
    verdicts = _verdicts(a, rows[0], rows[1])
    return PartResult(TITLE, _lines(a, rows, cap, len(sched_a), len(sched_b), verdicts), verdicts,
                      {"rows": rows, "capacity_rps": cap})
