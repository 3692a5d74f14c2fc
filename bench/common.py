"""Helpers the benchmarks share: finding tools and the model, and running servers by PID."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        sys.exit(f"{name!r} not found next to {sys.executable} or on PATH; run `pip install -e .`")
    return found


def model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    from llmd.store import StoreError, WeightStore

    try:
        return WeightStore().resolve(args.source).path
    except StoreError as e:
        sys.exit(f"{e}\n(run `make model` first)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready at {url} after {timeout:.0f}s; log {log}:\n{tail(log)}")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server we started, then SIGKILL it and anything left in its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # its own session: the group id is its PID; sweep engine children left behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for _ in range(100):  # until the whole group is gone, so the next server never overlaps this one
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def write_section(doc: Path, section: str) -> None:
    """Replace the `## ` section that `section` starts with in `doc` (or append it); the
    other sections are kept."""
    import re

    title = section.splitlines()[0]
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    m = re.search(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", text, flags=re.M | re.S)
    if m:
        rest = text[m.end():]
        text = text[: m.start()] + section.rstrip("\n") + ("\n\n" if rest else "\n") + rest
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text, encoding="utf-8")


async def start_inprocess(cfg: object, name: str) -> tuple[object, object, int]:
    """The real gateway and service for `cfg` on a free loopback port, in this event loop
    (fake-backend benches): (server, service, port)."""
    import logging

    from llmd.gateway import create_app
    from llmd.service import Service
    from llmd.telemetry import configure_logging

    configure_logging("warning")
    logging.getLogger("sanic").setLevel(logging.WARNING)
    service = Service(cfg)  # type: ignore[arg-type]
    app = create_app(cfg, service, name=name, load_models=False)  # type: ignore[arg-type]
    app.config.MOTD = False
    app.config.TOUCHUP = False
    port = free_port()  # sanic reads port=0 as "the default", 8000
    server = await app.create_server(host="127.0.0.1", port=port, return_asyncio_server=True, access_log=False)
    assert server is not None
    await server.startup()
    await server.before_start()
    await server.after_start()
    await service.start()
    return server, service, port


async def stop_inprocess(server: object) -> None:
    s = server  # an AsyncioServer from start_inprocess
    await s.before_stop()  # type: ignore[attr-defined]
    s.close()  # type: ignore[attr-defined]
    for conn in list(s.connections):  # type: ignore[attr-defined]
        conn.close_if_idle() or conn.abort()
    await s.wait_closed()  # type: ignore[attr-defined]
    await s.after_stop()  # type: ignore[attr-defined]
