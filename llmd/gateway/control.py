"""How an operator steers a running `llmd serve`: SIGHUP re-reads its config file (and its
TLS files), the pid file beside the database says whom to signal (`llmd reload`), and the
report file beside it says what came of the last reload (llmd/reload.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from llmd.config import ConfigError, load_config
from llmd.gateway.types import App
from llmd.node import Node
from llmd.reload import Report, database, pid_file, report_file
from llmd.telemetry import log
from llmd.tls import ServerTLS


def reload_config(node: Node, tls: ServerTLS | None) -> list[str]:
    """Re-read the node's config file and apply it (raises ConfigError, changing nothing): the
    TLS pair is checked before the node's config is swapped, and loaded after."""
    path = node.config.path
    if path is None:
        raise ConfigError("config: this node was not started from a file; there is nothing to re-read")
    new = load_config(path)
    pair = tls.check(new.server.tls, path) if tls is not None else None
    notes = node.reload(new)
    if tls is not None and pair is not None:
        tls.apply(pair)
    elif (tls is None) != (new.server.tls is None):
        notes.append("[server.tls] turned on or off: that takes a restart (the port speaks TLS or not)")
    return notes


def add_controls(app: App, node: Node, tls: ServerTLS | None) -> None:
    """SIGHUP handling, the pid file and the reload report, for a server run by `llmd serve`."""
    db = database(node.config)
    pids, reports = pid_file(db), report_file(db)
    seq = 0

    def on_sighup() -> None:
        nonlocal seq
        seq += 1
        report = Report(os.getpid(), seq, True, str(node.config.path))
        try:
            report.notes = reload_config(node, tls)
        except ConfigError as e:
            report.ok, report.error = False, str(e)
        except Exception as e:  # a filter class that fails to build: refused like a bad file
            report.ok, report.error = False, f"{node.config.path}: cannot apply: {type(e).__name__}: {e}"
        if report.ok:
            log.info("config_reloaded", config=report.config, seq=seq, notes=report.notes)
        else:
            log.error("config_reload_refused", config=report.config, seq=seq, error=report.error)
        report.write(reports)

    @app.after_server_start
    async def _listen(app: App) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
        pids.parent.mkdir(parents=True, exist_ok=True)
        pids.write_text(f"{os.getpid()}\n")  # after the handler: a signal sent on seeing it is handled

    @app.before_server_stop
    async def _unlisten(app: App) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        with contextlib.suppress(OSError):
            if pids.read_text().strip() == str(os.getpid()):
                pids.unlink()
