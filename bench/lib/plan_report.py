"""The end-to-end check's markdown: capacity, overheads, and per load point the measured and
simulated figures with the simulator's error, held-out loads apart from those near saturation,
and how much repeats of one point spread (the noise any error must be read against)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from bench.lib import report as md
from bench.lib import stats
from bench.lib.e2e_stats import FIGURES, error_pct, fmt, spread_pct

TARGETS = {"real": (10.0, 5.0), "fake": (3.0, 3.0)}  # (latency, throughput) error bounds, % (by base engine)


def _cell(key: str, measured: float, sim: dict[str, float] | None) -> str:
    if sim is None:
        return fmt("", key, measured)
    e = error_pct(sim[key], measured)
    return f"{fmt('', key, measured)} / {fmt('', key, sim[key])} ({e:+.1f}%)" if not math.isnan(e) else \
        f"{fmt('', key, measured)} / -"


def _run_cell(r: dict[str, Any]) -> str:
    """Whole-run throughput (first arrival to last token), the simulator's own definition."""
    sims = list((r.get("sim_by_class") or {}).values())
    return _cell("tput", r["measured"].get("tput_run", math.nan), sims[0] if sims else r.get("sim"))


def _points_table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["engine", "load", "rep", "req/s", "n", "statuses", *(label for label, _ in FIGURES), "run tok/s",
            "client CPU"]
    body = []
    for r in sorted(rows, key=lambda r: (r["engine"], r["load"], r["rep"])):
        f, m = r["measured"]["figures"], r["measured"]
        body.append([r["engine"], f"{r['load']:.0%}", str(r["rep"]), f"{r['rate']:.2f}", str(m["n"]),
                     ", ".join(f"{k} {v}" for k, v in sorted(m["statuses"].items())),
                     *(_cell(k, f[k], r.get("sim")) for _, k in FIGURES), _run_cell(r), f"{r['client_cpu']:.2f}"])
    return md.table(head, body)


def _class_table(rows: list[dict[str, Any]]) -> list[str]:
    """The same figures by priority class (batch-class requests yield their seats to interactive
    ones: their TTFT is the policy's doing, the first thing a simulator can get wrong)."""
    body = []
    for r in sorted(rows, key=lambda r: (r["engine"], r["load"], r["rep"])):
        for k, f in sorted(r["measured"].get("by_class", {}).items()):
            sim = (r.get("sim_by_class") or {}).get(k)  # its throughput is the whole run's: not by class
            body.append([r["engine"], f"{r['load']:.0%}", str(r["rep"]), k,
                         *(_cell(key, f[key], None if key == "tput" else sim) for _, key in FIGURES)])
    return md.table(["engine", "load", "rep", "class", *(label for label, _ in FIGURES)], body)


def _errors(r: dict[str, Any]) -> dict[str, list[float]]:
    """|error| % per figure of one simulated point: overall where the simulator reports it, else
    per class; throughput whole-run against whole-run."""
    m = r["measured"]
    pairs = ([(m["figures"], r["sim"])] if r.get("sim") else
             [(m["by_class"][k], s) for k, s in (r.get("sim_by_class") or {}).items() if k in m["by_class"]])
    out: dict[str, list[float]] = defaultdict(list)
    for meas, sim in pairs:
        for _, k in FIGURES:
            if k != "tput":
                out[k].append(abs(error_pct(sim[k], meas[k])))
        out["tput"].append(abs(error_pct(sim["tput"], m.get("tput_run", math.nan))))
    return out


def _verdicts(rows: list[dict[str, Any]], held_out: tuple[float, ...]) -> list[str]:
    out = []
    for engine in sorted({r["engine"] for r in rows} | set(TARGETS)):
        lat, tput = TARGETS[engine.partition("-")[0]]
        errs: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            if r["engine"] == engine and (not engine.startswith("real") or r["load"] in held_out):
                for k, v in _errors(r).items():
                    errs[k] += [x for x in v if not math.isnan(x)]
        if not errs:
            measured = any(r["engine"] == engine for r in rows)
            out.append(f"- {engine}: " + ("no simulated points yet (`simulate` was not run)" if measured else
                                          "no load points measured (capacity only)"))
            continue
        worst = {k: max(v) for k, v in errs.items() if v}
        ok = all(worst[k] <= (tput if k == "tput" else lat) for k in worst)
        scope = "held-out loads ≤ 80 %" if engine.startswith("real") else "all loads"
        each = ", ".join(f"{label} {worst[k]:.1f}%" for label, k in FIGURES if k in worst)
        out.append(f"- {engine} ({scope}): worst |error| {each}"
                   f" (targets {lat:g}% latency, {tput:g}% throughput): {'PASS' if ok else 'MISS'}")
    return out


def _paired(rows: list[dict[str, Any]]) -> list[str]:
    """Request by request: how far each simulated TTFT and e2e is from the same request's."""
    body = [[r["engine"], f"{r['load']:.0%}", str(r["rep"]), str(p["n"]),
             *(f"{p[k]:.1f}%" if p.get(k) is not None else "-" for k in ("ttft_median", "ttft_p90", "e2e_median",
                                                                          "e2e_p90"))]
            for r in sorted(rows, key=lambda r: (r["engine"], r["load"], r["rep"])) if (p := r.get("paired"))]
    if not body:
        return []
    return ["", "Request by request (both sides replay the same trace; the window's completed requests): "
            "|simulated − measured| / measured.", "",
            *md.table(["engine", "load", "rep", "requests", "TTFT median", "TTFT p90", "e2e median", "e2e p90"],
                      body)]


def _split(rows: list[dict[str, Any]]) -> list[str]:
    """Where the interactive TTFT goes (llmd's ledger of each request), beside the simulator's."""
    body = [[r["engine"], f"{r['load']:.0%}", str(p["n"]),
             *(f"{p[k] * 1000:.0f}" for k in ("client", "sim", "diff", "queue", "prefill", "held", "http",
                                              "diff_unheld")), f"{p['held_share']:.0%}"]
            for r in sorted(rows, key=lambda r: (r["engine"], r["load"], r["rep"])) if (p := r.get("ttft_split"))]
    if not body:
        return []
    return ["", "Where the interactive class's TTFT goes, by llmd's own record of each request (medians over the "
            "window's completed requests, ms): the client's TTFT, the simulator's and their difference; llmd's "
            "parts: queued (arrival to dispatch), prefill (dispatch to the engine's first token), held (the output "
            "filters holding the first tokens back: text that could still become a match; the simulator draws "
            "each request's hold from the capacity runs' first chunks), HTTP (the client's TTFT minus llmd's); "
            "the difference once held time is taken out; "
            "the share of requests whose first tokens were held over 20 ms.", "",
            *md.table(["engine", "load", "requests", "client", "simulated", "difference", "queued", "prefill",
                       "held", "HTTP", "difference less held", "held > 20 ms"], body)]


def _nested_verdicts(rows: list[dict[str, Any]], held_out: tuple[float, ...]) -> list[str]:
    """`_verdicts` of an alternative pricing, indented under its bullet; engines it has no rows for
    are left out (the main verdicts said so already)."""
    empty = ("no simulated points", "no load points")
    return ["  " + v for v in _verdicts(rows, held_out) if not any(e in v for e in empty)]


def _raw_verdicts(rows: list[dict[str, Any]], held_out: tuple[float, ...]) -> list[str]:
    """The real engine's points simulated on the calibrated step model alone, beside the judged
    ones (priced at the engine's extra time in service, read from the real capacity runs)."""
    raw = [{**r, "sim": None, "sim_by_class": r["sim_raw_by_class"]} for r in rows if r.get("sim_raw_by_class")]
    speed = next((r["sim_in_service"] for r in rows if r.get("sim_in_service")), None)
    if not raw or not speed:
        return []
    knots = ", ".join(f"{y * 1000:+.1f} ms at {x:g}" for x, y in speed["knots"])
    head = (f"- In service the real engine's steps took {knots} running over the calibrated step model's time "
            "(decode-only steps of the real capacity runs, median by bins of 4 running; linear between them), and "
            f"a step with prefill {speed['prefill_s'] * 1000:+.1f} ms more (the median over those runs' steps with "
            "prefill); the rows above price its steps so. On the calibrated model alone:")
    out = [head, *_nested_verdicts(raw, held_out)]
    holds = next((r["sim_holds"] for r in rows if r.get("sim_holds") and r["engine"].startswith("real")), None)
    if holds:
        k = holds["tokens"]
        out.append(f"- The output filters held back the first token of {holds['held']} of the {holds['of']} responses "
                   f"the real capacity runs completed, for {k[len(k) // 2]} more tokens at the median (up to "
                   f"{k[-1]}): each simulated request draws its hold from them, its first token counted with the "
                   "held ones and their gaps not seen, as the client sees them.")
    return out


def _own_speed_verdicts(rows: list[dict[str, Any]], held_out: tuple[float, ...]) -> list[str]:
    """The real points simulated at the engine's speed in service read from each point's own steps:
    a diagnostic that separates the box's speed at the time of the run from the rest of the error."""
    own = [{**r, "sim": None, "sim_by_class": r["sim_own_speed_by_class"]}
           for r in rows if r.get("sim_own_speed_by_class")]
    if not own:
        return []
    head = ("- Not a check: the same real points priced at the speed in service read from each point's own "
            "engine steps (as from the capacity runs above, but from the run compared), which takes the box's "
            "speed during the run out of the error:")
    return [head, *_nested_verdicts(own, held_out)]


def _noise(rows: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["engine"], r["load"])].append(r)
    body = [[e, f"{load:.0%}", str(len(g)), *(f"{spread_pct([x['measured']['figures'][k] for x in g]):.1f}%"
                                           for _, k in FIGURES)]
            for (e, load), g in sorted(groups.items()) if len(g) > 1]
    if not body:
        return ["No point was repeated yet (`--repeats 2`): the noise of one measurement is not known."]
    return md.table(["engine", "load", "repeats", *(f"{label} spread" for label, _ in FIGURES)], body)


def provenance_table(res: dict[str, Any]) -> list[str]:
    """Each stored row: when it was measured, at which llmd, by which command (rows measured
    before 2026-12-03 were filled in by hand from the notes of the time)."""
    rows = [(f"capacity {e}", c) for e, c in sorted(res.get("capacity", {}).items())]
    rows += [("overheads", res["overheads"])] if res.get("overheads") else []
    rows += [(f"{r['engine']} {r['load']:.0%} rep {r['rep']}", r)
             for r in sorted(res.get("points", []), key=lambda r: (r["engine"], r["load"], r["rep"]))]
    out = []
    for name, r in rows:
        p = r.get("provenance") or {}
        cmd = f"`{p['cmd']}`" if p.get("cmd") else "?"
        out.append([name, p.get("at", "?"), p.get("llmd", "?"), cmd, p.get("note", "")])
    return ["#### Where each stored row comes from", "",
            *md.table(["row", "measured", "llmd at", "command", "note"], out)]


def report(res: dict[str, Any], held_out: tuple[float, ...]) -> str:
    lines = ["#### Capacity (closed loop, the mix)", ""]
    for engine, c in sorted(res.get("capacity", {}).items()):
        lines.append(f"- {engine}: {c['req_s']:.2f} req/s ({c['tok_s']:.1f} output tok/s), {c['completed']} completed "
                     f"in {c['seconds']:.0f} s at {c['concurrency']} streams; seat limit {c['seats']}, queue up to "
                     f"{c['queued_max']}")
    o = res.get("overheads")
    if o:
        lines += ["", "#### llmd's own overheads (fake backend, lone requests)", "",
                  f"- ingress (send → first engine step) {o['ingress_s'] * 1000:.1f} ms median, p95 "
                  f"{o['ingress_p95_s'] * 1000:.1f} ms; delivery (step end → client) {o['delivery_s'] * 1000:.2f} ms "
                  f"per token, p95 {o['delivery_p95_s'] * 1000:.2f} ms; client TTFT − engine TTFT "
                  f"{o['ttft_extra_s'] * 1000:.1f} ms ({o['requests']} requests)"]
    rows = res.get("points", [])
    near = [r for r in rows if r["engine"].startswith("real") and r["load"] not in held_out]
    lines += ["", "#### Load points: measured / simulated (error)", "",
              "Latencies in ms; ITL: the engine's pace (a chunk of k tokens after a gap counts as k - 1 gaps at "
              "the stream's pace and one of the rest: a stall stays one gap, as the simulator records it); "
              "percentiles by the simulator's estimator on both sides (exact: the lower weighted quantile of "
              "every sample, no bins); output tok/s over the window after "
              "the warm-up; client CPU in cores (the client must not be the bottleneck).", ""]
    lines += _points_table([r for r in rows if r not in near])
    if near:
        lines += ["", "Real engine at ≥ 90 % of capacity (reported apart: near saturation errors explode):", ""]
        lines += _points_table(near)
    lines += ["", "By class:", "", *_class_table(rows)]
    lines += ["", *_verdicts(rows, held_out), *_raw_verdicts(rows, held_out), *_own_speed_verdicts(rows, held_out)]
    lines += _paired(rows)
    lines += _split(rows)
    lines += ["", "#### Noise: spread of repeats ((max − min) / median)", ""]
    lines += _noise(rows)
    cpu = [r["client_cpu"] for r in rows]
    if cpu:
        lines += ["", f"Client CPU share: median {stats.median(cpu):.2f}, max {max(cpu):.2f} cores."]
    lines += ["", *provenance_table(res)]
    return "\n".join(lines) + "\n"
