"""The step-time model's calibration figures for docs/benchmarks.md (bench/plan.py calls
`calibration_section`): grid size, held-out error, coefficients and stamp as markdown, and a
predicted-vs-measured scatter of the held-out grid points with a ±10 % band.

It reads what `llmd plan calibrate` wrote (the model JSON and its `*.points.json`); it measures
nothing itself, so the figures are those of the committed run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.lib.report import ROOT

MODEL = ROOT / "llmd" / "plan" / "data" / "stepmodel-local-cpu.json"  # shipped in the package: the default
POINTS = ROOT / "bench" / "data" / "stepmodel-local-cpu.points.json"  # its held-out points and steps: bench only
PLOT = ROOT / "docs" / "img" / "plan-calibration.png"
UNITS = {"c_step": ("ms per step", 1e3), "c_seq": ("ms per sequence", 1e3), "c_tok": ("ms per token", 1e3),
         "c_kv": ("µs per context token read", 1e6), "c_attn": ("ns per (chunk × context) token pair", 1e9),
         "c_ctx": ("µs per token of the longest decode context", 1e6)}
KINDS = {"decode": "tab:blue", "prefill": "tab:orange", "mixed": "tab:green"}


def load(model: Path = MODEL, points: Path | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The model's JSON and its held-out points (`*.points.json` beside it; the shipped model's
    live in bench/data, outside the package)."""
    if points is None:
        points = POINTS if model == MODEL else model.with_suffix(".points.json")
    return json.loads(model.read_text()), json.loads(points.read_text())["points"]


def scatter(points: list[dict[str, Any]], png: Path = PLOT) -> Path:
    """Predicted (held-out) against measured median step time per grid point, log-log, ±10 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6), dpi=110)
    xs = [p["measured_s"] * 1e3 for p in points]
    lo, hi = min(xs) * 0.8, max(xs) * 1.25
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", label="±10 %")
    ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8)
    for kind, colour in KINDS.items():
        sel = [p for p in points if p["point"].startswith(kind)]
        ax.scatter([p["measured_s"] * 1e3 for p in sel], [p["predicted_s"] * 1e3 for p in sel], s=18,
                   color=colour, label=f"{kind} ({len(sel)})", zorder=3)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured median step time (ms)",
           ylabel="predicted, held out (ms)", title="Step-time model on this box: held-out grid points")
    ax.legend(loc="upper left")
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def calibration_section(model: Path = MODEL, png: Path = PLOT) -> str:
    """The markdown section (without its `## ` heading) and the plot, from the committed calibration."""
    m, points = load(model)
    scatter(points, png)
    e, stamp = m["error"], m["stamp"]
    worst = sorted(points, key=lambda p: -abs(p["predicted_s"] / p["measured_s"] - 1))[:3]
    lines = [
        f"Step-time model fitted by `llmd plan calibrate` on this box: {int(e['points'])} grid points "
        f"(batch 1-64 × context 64-2049, prefill chunks 16-2048 after 0 or 1024 cached tokens, mixed steps), "
        f"{int(e['steps'])} measured steps. Held-out error ({int(e['folds'])}-fold over grid points, a point's "
        f"median step): **median {e['median'] * 100:.1f} %, p90 {e['p90'] * 100:.1f} %**, max {e['max'] * 100:.1f} % "
        "(target: median ≤ 5 %, p90 ≤ 10 %).",
        *([] if "uncorrected_median" not in e else [
            "", f"Each visit to a grid point was bracketed by reference steps ({stamp.get('reference', '?')}) and "
            f"scaled by the box's speed they saw, in the runs that had them ({stamp.get('runs', '1')} run(s) merged; "
            "docs/capacity.md, \"Calibrating the step model\", lists them and what each choice moves). Without "
            f"that correction the same steps give held-out median {e['uncorrected_median'] * 100:.1f} %, "
            f"p90 {e['uncorrected_p90'] * 100:.1f} %."]),
        "",
        f"- held-out median ≤ 5 % and p90 ≤ 10 % ({e['median'] * 100:.1f} %, {e['p90'] * 100:.1f} %): "
        + ("PASS" if e["median"] <= 0.05 and e["p90"] <= 0.10 else "MISS"),
        "",
        "| term | coefficient | unit |",
        "| --- | ---: | --- |",
        *(f"| {k} | {m['coef'][k] * UNITS[k][1]:.4g} | {UNITS[k][0]} |" for k in UNITS),
        "",
        "Stamp: " + "; ".join(f"{k} `{v}`" for k, v in sorted(stamp.items())) + ".",
        "",
        "Worst held-out points: " + "; ".join(
            f"{p['point']} {p['measured_s'] * 1e3:.0f} ms measured, {p['predicted_s'] * 1e3:.0f} ms predicted"
            for p in worst) + ".",
        "",
        f"![predicted vs measured step time]({png.relative_to(ROOT).as_posix().removeprefix('docs/')})",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(calibration_section())
