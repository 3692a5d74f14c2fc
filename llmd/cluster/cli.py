"""`llmd cluster ...`: the cluster as one node sees it (admin key)."""

from __future__ import annotations

import json
from typing import Any

import click

from llmd.api_client import Api
from llmd.policy.homes import BIND_ON_S


@click.group()
@click.option("--url", envvar="LLMD_URL", default="http://127.0.0.1:8000", show_default=True,
              help="Any node of the cluster (or $LLMD_URL).")
@click.option("--api-key", envvar="LLMD_ADMIN_KEY", default=None, help="An admin key (or $LLMD_ADMIN_KEY).")
@click.pass_context
def cluster(ctx: click.Context, url: str, api_key: str | None) -> None:
    """Members, their state and load in tokens, versions, prefix summaries; drain a node."""
    ctx.obj = Api(url, api_key, prefix="")


@cluster.command()
@click.option("--json", "as_json", is_flag=True, help="The whole view as JSON.")
@click.pass_obj
def status(api: Api, as_json: bool) -> None:
    """Every member as this node sees it: state, age of its last state, load per version in tokens."""
    data = api.call("GET", "/admin/cluster").json()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    me = data["self"]
    click.echo(f"node {data['node']} ({data['url']}) routing={data['routing']} draining={data['draining']} "
               f"prefix blocks={me['prefix_blocks']}")
    click.echo(f"{'member':<16} {'state':<8} {'age s':>6} {'version':<14} {'kv free':>9} {'running':>8} "
               f"{'waiting':>8} {'prefill/s':>10} {'prefix seq':>10}")
    rows = [(data["node"], "self", 0.0, me["versions"], me["prefix_seq"])]
    rows += [(m["name"], m["state"], m["age_s"], m["versions"], m["prefix_seq"]) for m in data["members"]]
    for name, state, age, versions, seq in rows:
        for v in versions or [None]:
            click.echo(_row(name, state, age, v, seq))
    g = data["gossip"]
    click.echo(f"gossip: sent {g['sent_bytes']} B, received {g['recv_bytes']} B, dropped {g['dropped']}; "
               f"forwarded {data['forwarded']}, failovers {data['failovers']}")
    h = data.get("homes") or {}
    click.echo(f"homes: {h.get('homed', 0)} prefixes have balanced homes, per node {h.get('per_node', {})} "
               f"({h.get('prefixes', 0)} routed here, traffic heard from {h.get('peers', 0)} peers); "
               f"{'bound' if h.get('bound') else 'not bound'}, queued prefill {h.get('congestion_s', 0.0):.2f} s "
               + ("(smoothed; homes bind at every load)" if h.get("bind", "always") == "always"
                  else f"(smoothed; homes bind over {BIND_ON_S} s)"))


def _row(name: str, state: str, age: float | None, v: dict[str, Any] | None, seq: int) -> str:
    age_s = f"{age:.2f}" if age is not None else "-"
    if v is None:
        return f"{name:<16} {state:<8} {age_s:>6} {'-':<14}"
    return (f"{name:<16} {state:<8} {age_s:>6} {v['model'] + '@' + v['version'][:6]:<14} {v['kv_free_tokens']:>9} "
            f"{v['running_tokens']:>8} {v['waiting_prefill_tokens']:>8} {v['prefill_tps']:>10.0f} {seq:>10}")


@cluster.command()
@click.option("--off", is_flag=True, help="Take work again.")
@click.pass_obj
def drain(api: Api, off: bool) -> None:
    """Stop running the cluster's work on this node (its own clients' requests run on the others);
    `llmd serve` also drains and leaves on shutdown."""
    click.echo(json.dumps(api.call("POST", "/admin/cluster/drain", json={"draining": not off}).json()))
