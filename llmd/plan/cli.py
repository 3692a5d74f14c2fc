"""`llmd plan`: capacity planning. `llmd plan math` prints the back-of-the-envelope derivation."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click

from llmd.plan.errors import PlanError
from llmd.plan.gpus import get_gpu
from llmd.plan.inputs import Deployment, Plan, Workload
from llmd.plan.model import ModelSpec, dtype_bytes, load_model
from llmd.plan.search_cli import search_cmd
from llmd.plan.workload_cli import workload_cmd


@click.group()
def plan() -> None:
    """Capacity planning: size and price a fleet for a workload."""


plan.add_command(search_cmd)  # `llmd plan search`: llmd/plan/search_cli.py
plan.add_command(workload_cmd)  # `llmd plan workload`: llmd/plan/workload_cli.py


def _model(model_config: Path | None, params: float | None) -> ModelSpec:
    if model_config is None:
        from llmd.store import StoreError, WeightStore  # the stored default model, only when asked for
        try:
            model_config = WeightStore().resolve("smollm2").path / "config.json"
        except StoreError as e:
            raise PlanError(f"no --model-config given and the stored smollm2 is unavailable: {e}") from None
    m = load_model(model_config)
    return m.with_params(params) if params is not None else m


def _plan(o: dict[str, Any]) -> Plan:
    """Options → Plan; --seed starts from the seed's numbers and any option given overrides them."""
    from llmd.plan.seed import seed_plan

    for k in ("weight_dtype", "kv_dtype"):
        if o[k] is not None:
            dtype_bytes(str(o[k]))
    base = seed_plan() if o["seed"] else None
    model = base.model if base is not None and o["model_config"] is None else _model(o["model_config"], None)
    if o["params"] is not None:
        model = model.with_params(float(o["params"]))
    w = base.workload if base is not None else Workload(rate=100, prompt_tokens=1000, output_tokens=300)
    w = replace(w, **{f: o[k] for f, k in (("rate", "rate"), ("prompt_tokens", "prompt_tokens"),
                                             ("output_tokens", "output_tokens"), ("itl_ms", "itl_ms"),
                                             ("ttft_ms", "ttft_ms")) if o[k] is not None})
    d = base.deploy if base is not None else Deployment(gpu=get_gpu("H100-SXM"))
    if o["gpu"] is not None:
        d = replace(d, gpu=get_gpu(str(o["gpu"])))
    d = replace(d, **{f: o[k] for f, k in (("tp", "tp"), ("weight_dtype", "weight_dtype"), ("kv_dtype", "kv_dtype"),
                                             ("decode_tps", "decode_tps"), ("prefill_tps", "prefill_tps"),
                                             ("price_per_hour", "price"), ("peak_util", "peak_util"),
                                             ("avg_util", "avg_util"), ("storage_gbps", "storage_gbps"),
                                             ("init_s", "init_s"), ("util_goal", "util_goal")) if o[k] is not None})
    return Plan(model, w, d, seed=bool(o["seed"]))


@plan.command("math")
@click.option("--seed", is_flag=True, help="The seed's envelope: 280 req/s, 1,000 + 300 tokens, a 70B model in fp8 "
              "on 4 × H100, 2,000 / 10,000 tok/s per replica, $16/h. Other options override its numbers.")
@click.option("--model-config", type=click.Path(path_type=Path), default=None,
              help="A Hugging Face config.json (or its directory). Default: the stored smollm2's.")
@click.option("--params", type=float, default=None, help="Parameter count, if not estimated from the config.")
@click.option("--gpu", default=None, help="A100-80GB, H100-SXM (default), H200, or local (this box).")
@click.option("--tp", type=int, default=None, help="GPUs per replica (default: the fewest that fit).")
@click.option("--weight-dtype", default=None, help="Weights as served (bf16, fp8, int4…); default the config's.")
@click.option("--kv-dtype", default=None, help="KV cache dtype; default the config's.")
@click.option("--rate", type=float, default=None, help="Peak requests per second (default 100).")
@click.option("--prompt-tokens", type=float, default=None, help="Mean prompt tokens (default 1,000).")
@click.option("--output-tokens", type=float, default=None, help="Mean output tokens (default 300).")
@click.option("--itl-ms", type=float, default=None, help="Inter-token latency target, ms.")
@click.option("--ttft-ms", type=float, default=None, help="Time-to-first-token target, ms.")
@click.option("--decode-tps", type=float, default=None, help="Decode tok/s one replica sustains (default: roofline).")
@click.option("--prefill-tps", type=float, default=None, help="Prefill tok/s one replica sustains (default: roofline).")
@click.option("--price", type=float, default=None, help="$ per replica-hour (default: the GPU table's × GPUs).")
@click.option("--peak-util", type=float, default=None, help="Fraction of a replica's rate planned at peak (0.875).")
@click.option("--avg-util", type=float, default=None, help="Mean load as a fraction of peak, for cost (0.4).")
@click.option("--storage-gbps", type=float, default=None,
              help="GB/s the weights load at on a cold start (default 2, the seed's).")
@click.option("--init-s", type=float, default=None,
              help="The engine's start after its weights load, s (default 60, assumed: graph capture, warm-up).")
@click.option("--util-goal", type=float, default=None,
              help="A mean-utilisation goal (fraction) to check the cost's load against (the seed's 0.7).")
@click.option("--json", "as_json", is_flag=True, help="The same lines as JSON: label, formula, value, unit.")
def math_cmd(as_json: bool, **opts: Any) -> None:
    """The back-of-the-envelope fleet: every number with its derivation, then the inconsistencies."""
    from llmd.plan.derive import derive

    try:
        p = _plan(opts)
        sheet = derive(p)
    except PlanError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"inputs": asdict(p), **sheet.to_json()}, indent=1, ensure_ascii=False))
    else:
        click.echo(sheet.render(), nl=False)


@plan.command("compile")
def compile_cmd() -> None:
    """Build the simulator's modules with mypyc now (`llmd plan sim` does on first use), for
    example while building an image; prints where. LLMD_HOME decides the store."""
    from llmd.plan.compiled import CompileError, build, key, unavailable

    k = key()
    why = unavailable(k)
    if k is None or why is not None:
        raise click.ClickException(f"cannot compile here: {why}")
    try:
        out = build(k, log=lambda line: click.echo(line, err=True))
    except CompileError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(out))


def _register() -> None:
    from llmd.plan.sim.cli import sim_cmd

    plan.add_command(sim_cmd)


_register()
