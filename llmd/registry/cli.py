"""`llmd registry ...`: a model's versions and split on a running server (admin key)."""

from __future__ import annotations

import json

import click

from llmd.api_client import Api


@click.group()
@click.option("--url", envvar="LLMD_URL", default="http://127.0.0.1:8000", show_default=True,
              help="The llmd server (or $LLMD_URL).")
@click.option("--api-key", envvar="LLMD_ADMIN_KEY", default=None, help="An admin key (or $LLMD_ADMIN_KEY).")
@click.pass_context
def registry(ctx: click.Context, url: str, api_key: str | None) -> None:
    """Versions of a model: load, split traffic, roll back, drain, unload."""
    ctx.obj = Api(url, api_key, prefix="")


def _show(data: dict) -> None:
    click.echo(json.dumps(data, indent=2))


@registry.command()
@click.argument("model")
@click.pass_obj
def status(api: Api, model: str) -> None:
    """The model's versions (state, weight, requests in flight) and its split."""
    _show(api.call("GET", f"/admin/models/{model}").json())


@registry.command()
@click.argument("model")
@click.argument("version")
@click.option("--no-warm", is_flag=True, help="Skip the warm-up generations.")
@click.option("--cpu-bind", default=None, help="CPU engines: the cores this one uses (e.g. 2-3).")
@click.option("--warm-pool", is_flag=True, help="Cluster: asleep until the warm pool promotes it under load.")
@click.pass_obj
def load(api: Api, model: str, version: str, no_warm: bool, cpu_bind: str | None, warm_pool: bool) -> None:
    """Load a stored VERSION (id or prefix) of MODEL on standby, out of rotation."""
    _show(api.call("POST", f"/admin/models/{model}/versions",
                   json={"version": version, "warm": not no_warm, "cpu_threads_bind": cpu_bind,
                         "warm_pool": warm_pool}).json())


@registry.command()
@click.argument("model")
@click.argument("weights", nargs=-1, required=True)
@click.pass_obj
def split(api: Api, model: str, weights: tuple[str, ...]) -> None:
    """Route MODEL's traffic by WEIGHTS, given as VERSION=WEIGHT (e.g. f647=90 7f1c=10)."""
    parsed: dict[str, float] = {}
    for w in weights:
        version, sep, value = w.partition("=")
        try:
            parsed[version] = float(value)
        except ValueError:
            raise click.BadParameter(f"{w!r} is not VERSION=WEIGHT") from None
        if not sep or not version:
            raise click.BadParameter(f"{w!r} is not VERSION=WEIGHT")
    _show(api.call("PUT", f"/admin/models/{model}/split", json={"weights": parsed}).json())


@registry.command()
@click.argument("model")
@click.pass_obj
def rollback(api: Api, model: str) -> None:
    """Restore MODEL's previous split (one registry write)."""
    _show(api.call("POST", f"/admin/models/{model}/rollback").json())


@registry.command()
@click.argument("model")
@click.argument("version")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for requests in flight.")
@click.pass_obj
def drain(api: Api, model: str, version: str, timeout: float) -> None:
    """Take VERSION out of routing and wait for its requests in flight to finish."""
    _show(api.call("POST", f"/admin/models/{model}/versions/{version}/drain", json={"timeout_s": timeout}).json())


@registry.command()
@click.argument("model")
@click.argument("version")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to drain before unloading.")
@click.pass_obj
def unload(api: Api, model: str, version: str, timeout: float) -> None:
    """Drain VERSION, then stop its engine."""
    _show(api.call("DELETE", f"/admin/models/{model}/versions/{version}", params={"timeout_s": timeout}).json())
