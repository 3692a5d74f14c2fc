"""`llmd plan search`'s command line: a workload, a step model, SLOs and the knobs to try, in;
the frontier table and the winner (or JSON) out. The search itself: llmd/plan/search.py.

The evaluator is `evaluator_factory(trace, step, price, targets, config, model)`: by default the
simulator (`llmd.plan.sim.report.simulate(spec, trace, step)`), looked up when the command runs so
the search and its tests stand without it; a test swaps in a closed-form one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from llmd.config.slo import DEFAULT_ITL_P95_S, DEFAULT_TTFT_P95_S
from llmd.plan.errors import PlanError
from llmd.plan.journal import Journal, inputs_digest, journal_path
from llmd.plan.search import Candidate, Evaluator, Grid, Slo, Targets, Trial, render, search, to_json
from llmd.plan.sim.cli import resolve_step_model
from llmd.plan.sim.trace import COLUMNS, Trace
from llmd.plan.sim.workload_spec import KEYS, spec_from_options, workload_options
from llmd.stepmodel import StepTime


def simulator_evaluator(trace: Trace, step: StepTime, price: float, targets: Targets,
                        config: Path | None = None, model: str | None = None) -> Evaluator:
    """Each candidate simulated over the whole trace (llmd/plan/sim/report.py's `simulate`): the
    fleet config.toml describes (`llmd plan sim`'s spec_from_config) or llmd's defaults, with the
    candidate's max_num_seqs and target_itl_ms. Without a warm pool, `replicas` all active; with
    one, `replicas` active at least (min_active) plus `warm_pool` warm, the autoscaler waking them
    under load. Billed at `price`; the interactive targets are the report's SLO lines."""
    try:
        simulate = importlib.import_module("llmd.plan.sim.report").simulate
        specs = importlib.import_module("llmd.plan.sim.spec")
        from_config = importlib.import_module("llmd.plan.sim.cli").spec_from_config
    except (ImportError, AttributeError):
        raise PlanError("this llmd has no simulator (llmd.plan.sim.report.simulate) to search with") from None
    block = specs.step_block_size(step)  # the measured engine's KV block
    base = (from_config(config, model, 1, block_size=block, price_per_hour=price) if config is not None
            else specs.SimSpec(replicas=1, engine=specs.default_engine(block), price_per_hour=price))
    slo = targets.classes.get("interactive", Slo())
    with contextlib.suppress(ValueError):  # the plot's SLO lines only; the search judges by `targets`
        base = replace(base, slo=base.slo.model_copy(update={
            k: v for k, v in (("ttft_p95_s", slo.ttft_p95_s), ("itl_p95_s", slo.itl_p95_s)) if v is not None}))

    def evaluate(c: Candidate) -> dict[str, Any]:
        spec = replace(base, replicas=c.replicas + c.warm_pool,
                       engine=replace(base.engine, max_num_seqs=c.max_num_seqs),
                       scheduling=base.scheduling.model_copy(update={"target_itl_ms": c.itl_target_ms}),
                       autoscale=(specs.Autoscale(min_active=c.replicas, warm_pool=c.warm_pool)
                                  if c.warm_pool else None))
        out: dict[str, Any] = simulate(spec, trace, step)
        return out

    return evaluate


evaluator_factory = simulator_evaluator


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"--{what}: {text!r} is not a comma-separated list of whole numbers") from None


def _itl_targets(text: str) -> tuple[float | None, ...]:
    try:
        return tuple(None if x.strip().lower() == "none" else float(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"--itl-target-ms: {text!r} is not a comma-separated list of ms (or none)") from None


def _targets(o: dict[str, Any]) -> Targets:
    ms = {k: (o[k] / 1000 if o[k] is not None else None) for k in ("ttft_ms", "itl_ms", "batch_ttft_ms",
                                                                    "batch_itl_ms")}
    classes = {"interactive": Slo(ms["ttft_ms"], ms["itl_ms"])}
    if ms["batch_ttft_ms"] is not None or ms["batch_itl_ms"] is not None:
        classes["batch"] = Slo(ms["batch_ttft_ms"], ms["batch_itl_ms"])
    return Targets(classes, max_shed=o["max_shed"])


def _trace(o: dict[str, Any]) -> Trace:
    from llmd.plan.sim.workload import generate

    if o["trace"] is not None:
        given = [k for k in (*KEYS, "workload_file") if o.get(k) is not None]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise PlanError(f"--trace is the whole workload; drop {flags}")
        return Trace.load(o["trace"])
    return generate(spec_from_options(o))


@click.command("search")
@workload_options
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="A saved workload trace (.npz) instead of the workload options.")
@click.option("--config", type=click.Path(path_type=Path), default=None,
              help="config.toml: the model's engine and scheduling, the tenants, [slo] (as llmd plan sim).")
@click.option("--model", default=None, help="Which of the config's models (default: the first).")
@click.option("--step-model", type=click.Path(path_type=Path), default=None,
              help="The step-time model (llmd plan calibrate's JSON). Default: as llmd plan sim, this box's "
              "own calibration for --model, else the one committed with llmd.")
@click.option("--price", type=float, default=16.0, show_default=True, help="$ per replica-hour, active or warm.")
@click.option("--ttft-ms", type=float, default=DEFAULT_TTFT_P95_S * 1000, show_default=True,
              help="Interactive TTFT p95 target.")
@click.option("--itl-ms", type=float, default=DEFAULT_ITL_P95_S * 1000, show_default=True,
              help="Interactive ITL p95 target.")
@click.option("--batch-ttft-ms", type=float, default=None, help="Batch class TTFT p95 target (default unchecked).")
@click.option("--batch-itl-ms", type=float, default=None, help="Batch class ITL p95 target (default unchecked).")
@click.option("--max-shed", type=float, default=0.001, show_default=True,
              help="Most requests shed or dropped, as a fraction.")
@click.option("--max-num-seqs", default="64", show_default=True, help="Batch limits to try, comma-separated.")
@click.option("--itl-target-ms", default="none", show_default=True,
              help="Scheduler ITL targets to try (ms, or none), comma-separated.")
@click.option("--warm-pool", default="0", show_default=True, help="Warm-pool sizes to try, comma-separated.")
@click.option("--min-replicas", type=int, default=1, show_default=True)
@click.option("--max-replicas", type=int, default=256, show_default=True)
@click.option("--start", type=int, default=None, help="Replicas to try first (e.g. llmd plan math's fleet).")
@click.option("--json", "as_json", is_flag=True, help="Print the search as JSON.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Also write the JSON here.")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="The winner's timeline as a PNG.")
@click.option("--journal", type=click.Path(path_type=Path), default=None,
              help="Where each evaluation is written as it finishes, and read back to resume (default: "
              "OUT.evaluations.jsonl beside --out, else $LLMD_HOME/plan/searches/INPUTS.evaluations.jsonl).")
@click.option("--fresh", is_flag=True, help="Start the journal again instead of resuming from it.")
def search_cmd(as_json: bool, **o: Any) -> None:
    """The cheapest fleet (replicas, max_num_seqs, ITL target, warm pool) meeting the SLOs."""
    journal: Journal | None = None
    try:
        targets = _targets(o)
        grid = Grid(_ints(o["max_num_seqs"], "max-num-seqs"), _itl_targets(o["itl_target_ms"]),
                    _ints(o["warm_pool"], "warm-pool"), o["min_replicas"], o["max_replicas"], o["start"])
        step, _ = resolve_step_model(o["step_model"], o["model"])
        trace = _trace(o)
        journal = _journal(o, trace, step)
        evaluate = journal.wrap(evaluator_factory(trace, step, o["price"], targets, o["config"], o["model"]))
        res = search(evaluate, targets, grid, o["price"], progress=None if as_json else _progress)
        if journal.reused:
            click.echo(f"{journal.reused} of {len(res.trials)} evaluations read from {journal.path}", err=True)
        doc = to_json(res)
        if o["out"] is not None:
            Path(o["out"]).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        click.echo(json.dumps(doc, indent=1, sort_keys=True) if as_json else render(res), nl=as_json)
        if o["plot"] is not None and res.winner is not None:
            from llmd.plan.sim.plot import plot_report

            plot_report(res.winner.report, o["plot"])
    except PlanError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        if journal is None:
            raise
        click.echo(f"interrupted: {journal.kept()} evaluations kept in {journal.path}; "
                   "the same command resumes from them", err=True)
        raise SystemExit(130) from None
    finally:
        if journal is not None:
            journal.close()


def _journal(o: dict[str, Any], trace: Trace, step: StepTime) -> Journal:
    """The search's journal (see llmd/plan/journal.py), keyed by what its reports depend on."""
    h = hashlib.sha256()
    for c in COLUMNS:
        h.update(getattr(trace, c).tobytes())
    h.update("\0".join(trace.tenants).encode())
    config = o["config"]
    try:
        config_bytes = Path(config).read_bytes() if config is not None else b""
    except OSError as e:
        raise PlanError(f"--config {config}: {e.strerror}") from None
    to_json_ = getattr(step, "to_json", None)
    inputs = inputs_digest({"trace": h.digest(), "step_model": (to_json_() if to_json_ else repr(step)).encode(),
                            "config": config_bytes, "model": str(o["model"]).encode(),
                            "price": repr(float(o["price"])).encode()})
    path = o["journal"]
    if path is None and o["out"] is not None:
        path = journal_path(Path(o["out"]))
    if path is None:
        from llmd.store import home

        path = home() / "plan" / "searches" / f"{inputs['all']}.evaluations.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if o["fresh"]:
            path.unlink(missing_ok=True)
        j = Journal(path, inputs)
    except OSError as e:
        raise PlanError(f"search journal {path}: {e.strerror or e}") from None
    if j.reports:
        click.echo(f"resuming from {path}: {len(j.reports)} evaluations", err=True)
    return j


def _progress(t: Trial) -> None:
    c = t.candidate
    click.echo(f"  tried {c.replicas} replicas, max_num_seqs {c.max_num_seqs}, ITL target "
               f"{c.itl_target_ms if c.itl_target_ms is not None else 'none'}, warm {c.warm_pool}: "
               + ("meets the SLOs" if t.ok else "; ".join(t.misses)), err=True)
