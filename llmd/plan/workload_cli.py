"""`llmd plan workload`: draw a workload from its description, say what it is (rates, tenants,
classes, lengths, shared prefixes) and save it as a trace for `llmd plan sim`/`search --trace`
and bench/plan.py, so the simulator and the real llmd replay exactly the same requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from llmd.plan.errors import PlanError
from llmd.plan.sim.trace import CLASSES, Trace
from llmd.plan.sim.workload_spec import spec_from_options, workload_options


def summary(tr: Trace) -> dict[str, Any]:
    """What a planner checks before simulating: the load it asks for, by whom, how long."""
    n = len(tr)
    if n == 0:
        return {"requests": 0}
    per_min = np.bincount((tr.t // 60).astype(np.int64))
    lengths = {k: getattr(tr, k) for k in ("prompt_tokens", "output_tokens")}
    return {"requests": n, "duration_s": round(tr.duration, 3), "mean_rps": round(n / max(tr.duration, 1e-9), 3),
            "peak_minute_rps": round(float(per_min.max()) / 60, 3),
            "tenants": {name: round(float((tr.tenant == i).mean()), 4) for i, name in enumerate(tr.tenants)},
            "classes": {name: round(float((tr.klass == i).mean()), 4) for i, name in enumerate(CLASSES)},
            **{k: {"mean": round(float(v.mean()), 1), "p50": int(np.percentile(v, 50)),
                   "p95": int(np.percentile(v, 95)), "max": int(v.max())} for k, v in lengths.items()},
            "prompt_tok_s": round(float(lengths["prompt_tokens"].sum()) / max(tr.duration, 1e-9), 1),
            "output_tok_s": round(float(lengths["output_tokens"].sum()) / max(tr.duration, 1e-9), 1),
            "with_shared_prefix": round(float((tr.prefix >= 0).mean()), 4),
            "prefix_groups": int(tr.prefix.max()) + 1 if (tr.prefix >= 0).any() else 0}


@click.command("workload")
@workload_options
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Save the trace (.npz) here.")
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
def workload_cmd(as_json: bool, out: Path | None, **o: Any) -> None:
    """Draw a workload, summarise it and (with --out) save it as a trace."""
    from llmd.plan.sim.workload import generate

    try:
        tr = generate(spec_from_options(o))
        if out is not None:
            tr.save(out)
    except PlanError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot write {out}: {e.strerror}") from None
    s = summary(tr)
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    for k, v in s.items():
        shown = ", ".join(f"{a} {b:,}" for a, b in v.items()) if isinstance(v, dict) else f"{v:,}"
        click.echo(f"{k:>18}: {shown}")
    if out is not None:
        click.echo(f"{'saved':>18}: {out}")
