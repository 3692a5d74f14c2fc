"""Helpers the benchmarks share: finding tools and the model, and running servers by PID."""

from __future__ import annotations

import argparse
import shutil
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


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""
