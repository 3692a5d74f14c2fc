"""Issue L's step model on a GPU: the datasheet prior (`llmd plan calibrate --prior`) and the
step model's basis against steps measured on a real GPU. Writes plan (a1) in docs/benchmarks.md.

The steps come from bench/lib/gpu_steps.py, run on a GPU machine the device tool lends (torch
only: vLLM cannot be installed there), and are kept in bench/data/gpu-steps-<gpu>.json. This
script needs no GPU: it reads them and prices every step with
  - the shipped prior (llmd/plan/prior.py: the roofline fitted onto the basis), never fitted to them;
  - the first prior (the roofline's bandwidth and compute terms summed), for the record;
  - the basis fitted on these steps, each grid point held out (k-fold over points, as calibrate
    reports it): how well the basis itself follows a GPU.

  .venv/bin/python bench/plan_gpu.py [--from bench/data/gpu-steps-h100.json] [--gpu H100]
  # measuring again, on the GPU machine:
  python3 bench/lib/gpu_steps.py --config llama-3.2-1b --config llama-3-8b --config qwen2.5-14b --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report
from bench.plan import INTRO, SECTION
from llmd.plan.fit import Sample, by_point, fit, samples_from_json
from llmd.plan.gpus import Gpu, get_gpu
from llmd.plan.model import ModelSpec, from_config
from llmd.plan.prior import BAND, BW_EFF, LAYER_OVERHEAD_S, MFU, SEQ_OVERHEAD_S, prior_model_coef
from llmd.stepmodel import StepModel

DATA = Path(__file__).resolve().parent / "data" / "gpu-steps-h100.json"


def summed_prior(gpu: Gpu, m: ModelSpec) -> StepModel:
    """The first prior (until 2026-12-05): the roofline's two terms summed on the basis (weights
    over bandwidth in c_step, every token's FLOPs in c_tok), the whole embedding read."""
    bw, peak = gpu.bandwidth or 0.0, gpu.peak_flops("bf16") or 0.0
    return StepModel({"c_step": LAYER_OVERHEAD_S * m.layers + m.params * 2 / (bw * BW_EFF), "c_seq": SEQ_OVERHEAD_S,
                      "c_tok": 2 * m.params / (peak * MFU), "c_kv": m.kv_bytes_per_token() / (bw * BW_EFF),
                      "c_attn": 4 * m.layers * m.heads * m.head_dim / (peak * MFU)})


def _priced(model: StepModel, steps: list[Sample]) -> float:
    return statistics.median(model.seconds(s.shape) for s in steps)


def _summary(label: str, errs: list[float]) -> str:
    a = sorted(abs(e) for e in errs)
    within = sum(x <= BAND for x in a)
    return (f"{label}: median |error| {statistics.median(a):.1%}, p90 {a[min(len(a) - 1, int(0.9 * len(a)))]:.1%}, "
            f"worst {a[-1]:.1%}; within ±{BAND:.0%} at {within} of {len(a)} points")


def model_rows(name: str, run: dict[str, Any], gpu: Gpu) -> tuple[list[str], dict[str, list[float]]]:
    spec = from_config(run["config"], name)
    samples = samples_from_json(run["samples"], name)
    prior, first = StepModel(prior_model_coef(gpu, spec)), summed_prior(gpu, spec)
    _, held = fit(samples, {"kind": "measured"})
    held_at = {e.point: e.predicted for e in held}
    errs: dict[str, list[float]] = {"prior": [], "first": [], "held": []}
    rows = []
    for point, steps in by_point(samples).items():
        measured = statistics.median(s.seconds for s in steps)
        cells = {"prior": _priced(prior, steps) / measured - 1, "first": _priced(first, steps) / measured - 1,
                 "held": held_at[point] / measured - 1}
        for k, v in cells.items():
            errs[k].append(v)
        rows.append([name, point, f"{measured * 1e3:.2f}", *(f"{v:+.1%}" for v in cells.values())])
    return rows, errs


def section(path: Path, gpu_name: str) -> list[str]:
    data = json.loads(path.read_text())
    gpu = get_gpu(gpu_name)
    rows: list[list[str]] = []
    lines: list[str] = []
    total: dict[str, list[float]] = {"prior": [], "first": [], "held": []}
    for name, run in data["models"].items():
        if name == "tiny":  # the run's smoke test
            continue
        r, errs = model_rows(name, run, gpu)
        rows += r
        lines.append(f"- {name} ({from_config(run['config'], name).params / 1e9:.1f} B parameters): "
                     + "; ".join(_summary(lab, errs[k]) for k, lab in
                                 (("prior", "shipped prior"), ("first", "first prior"))))
        for k in total:
            total[k] += errs[k]
    peaks = data["peaks"]
    bw, flops = gpu.bandwidth or 1.0, gpu.peak_flops("bf16") or 1.0
    took = f"the GPU run took {data['took_s']:.0f} s of {data['device']} ({data.get('measured_at', 'not recorded')})"
    return ["### (a1) The step model on a GPU: the datasheet prior against an H100", "",
            report.stamp(cmd=report.command(), took=took), "",
            f"Steps measured by `{data.get('command', 'python3 bench/lib/gpu_steps.py')}` on the device tool's "
            f"{data['device']} (torch {data['torch']}, CUDA {data['cuda']}); kept in "
            f"{path.relative_to(report.ROOT) if path.is_relative_to(report.ROOT) else path}. vLLM cannot be installed "
            "there (no package registry, 64 MiB carried), so the engine is a stand-in: each model's decoder in "
            "PyTorch with random weights, every step (flattened tokens, one GEMM per projection over all rows, "
            "SDPA attention, logits for each sequence's last token) captured once in a CUDA graph and replayed, "
            "20 decode or prefill steps a point, median. This device measured "
            f"{peaks['gemm_flops'] / 1e12:.0f} TFLOP/s on an 8192³ bf16 GEMM ({peaks['gemm_flops'] / flops:.0%} of "
            f"the datasheet's {flops / 1e12:.0f}) and {peaks['copy_bytes_per_s'] / 1e12:.2f} TB/s on a copy "
            f"({peaks['copy_bytes_per_s'] / bw:.0%} of {bw / 1e12:.2f}). `shipped prior`: `llmd plan calibrate --prior "
            f"{gpu.name}` for the model's config, never fitted to these steps; `first prior`: the prior until this "
            "run (the roofline's two terms summed); `held out`: the basis fitted on these steps, each point "
            "predicted by a fit on the other folds' points (k = 5), as `llmd plan calibrate` reports a fit.", "",
            *report.table(["model", "step", "measured ms", "shipped prior", "first prior", "basis, held out"], rows),
            "", *lines,
            f"- all three: {_summary('shipped prior', total['prior'])}; {_summary('first prior', total['first'])}; "
            f"the basis fitted on them, held out: {_summary('held out', total['held']).split(': ', 1)[1]}",
            "- prior within its ±30 % band at nine points in ten or more: "
            + report.verdict(sum(abs(e) <= BAND for e in total["prior"]) >= 0.9 * len(total["prior"]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="path", type=Path, default=DATA)
    ap.add_argument("--gpu", default="H100")
    a = ap.parse_args()
    lines = section(a.path, a.gpu)
    print("\n".join(lines))
    report.write_subsections(report.DOC, SECTION, [INTRO], {"(a1)": lines})


if __name__ == "__main__":
    main()
