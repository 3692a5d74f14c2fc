"""Every way a benchmark or a test starts and stops a server, in one place.

In-process: the real sanic gateway and node in the caller's event loop (fake backend), for
benches that need the server's internals (bench/metering.py swaps `node.lifecycle.ledger`) and for
the unit tests' `make_server` fixture. Subprocess: `llmd serve` (or `vllm serve`) in its own
session, so stopping it can sweep the engine processes it leaves behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmd.store import WeightStore

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# -- lookups ------------------------------------------------------------------
def tool(name: str) -> str:
    """A console script of this environment (`llmd`, `llmd-vllm`), so benches run the installed code."""
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        sys.exit(f"{name!r} not found next to {sys.executable} or on PATH; run `pip install -e .`")
    return found


def model_dir(args: argparse.Namespace) -> Path:
    """`--model-dir`, else the weight store's copy of `--source` (what `vllm serve` needs as a path)."""
    if args.model_dir:
        return Path(args.model_dir)
    from llmd.store import StoreError, WeightStore

    try:
        return WeightStore().resolve(args.source).path
    except StoreError as e:
        sys.exit(f"{e}\n(run `make model` first)")


def two_version_store(home: Path | None = None) -> tuple[Path, str, str]:
    """An LLMD_HOME whose store holds SmolLM2 twice under different content hashes: the stored
    (bf16) weights, hard-linked, and a float32 copy (made once, then kept next to the store).
    Returns (home, bf16 version, float32 version); the rollout bench and engine tests share it.
    `home`: the LLMD_HOME whose SmolLM2 it links (default: $LLMD_HOME as it is now)."""
    from llmd.store import WeightStore

    base = WeightStore(home)
    root = base.root.parent.parent / "llmd-test-versions"
    ws = WeightStore(root)
    a = ws.link_from(base.resolve("smollm2"))
    return root, a.version, ws.cast_copy(a, "float32").version


# what a tiny test model copies from SmolLM2 (llmd.store.TOKENIZER_FILES is what a tokenizer id hashes)
TINY_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_versions(home: Path, payloads: Sequence[bytes], name: str = "tiny") -> tuple[WeightStore, list[str]]:
    """A weight store at `home` holding `name` once per payload: SmolLM2's tokenizer and
    template, and a weight file of those bytes, so each is a version with its own content hash
    (the fake engine never reads the weights). Returns (the WeightStore, the version ids in
    payload order). The registry tests and bench/cluster_registry.py share it."""
    import tempfile

    from llmd.store import WeightStore

    tokenizer = WeightStore().resolve("smollm2").path
    ws = WeightStore(home)
    versions = []
    with tempfile.TemporaryDirectory(prefix="llmd-tiny-") as d:
        for i, payload in enumerate(payloads):
            src = Path(d) / f"src{i}"
            src.mkdir()
            for f in TINY_MODEL_FILES:
                shutil.copy(tokenizer / f, src / f)
            (src / "model.safetensors").write_bytes(payload)
            versions.append(ws.add_hf_dir(src, name, f"test:{i}").version)
    return ws, versions


_HANDED: set[int] = set()
_RNG = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on now, for TCP and UDP (sanic reads port=0 as "the
    default", 8000). Drawn below the kernel's ephemeral range and never handed out twice by this
    process: a port the kernel picked for `bind(0)` is in that range, so between this call and the
    server's own bind an outgoing connection (gossip, a client) could take it (CI saw
    "Address already in use" that way)."""
    high = min(_ephemeral_low(), 32768)
    low = 10000 if high > 11000 else 1024  # an ephemeral range set unusually low: what is left under it
    for _ in range(200):
        port = _RNG.randrange(low, high)
        if port in _HANDED:
            continue
        try:
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def dump_toml(data: dict[str, Any]) -> str:
    """A config as tomllib read it (tables, arrays of tables, scalars, lists), written back as TOML,
    so a bench can start `llmd serve` on config.toml with a few keys changed."""
    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)  # strings, numbers and booleans: JSON spells them as TOML does

    lines: list[str] = []

    def table(path: str, d: dict[str, Any]) -> None:
        subs = []
        for k, v in d.items():
            many = isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)
            if isinstance(v, dict) or many:
                subs.append((f"{path}.{key(k)}" if path else key(k), v, many))
            else:
                lines.append(f"{key(k)} = {value(v)}")
        for name, v, many in subs:
            for item in (v if many else [v]):
                lines.extend(["", f"[[{name}]]" if many else f"[{name}]"])
                table(name, item)

    table("", data)
    return "\n".join(lines).lstrip("\n") + "\n"


def keys_toml(tenants: dict[str, str], admin: str | None = None, dashboard: str | None = None,
              **tenant_keys: int | float | str) -> str:
    """The [auth] and [[tenants]] part of a test or bench config: one API key per tenant (by
    name), the admin and dashboard keys, all stored hashed as llmd requires; `tenant_keys` apply
    to every tenant listed (e.g. requests_per_minute)."""
    from llmd.auth import hash_key

    auth = ([f'admin_keys = ["{hash_key(admin)}"]'] if admin else []) + (
        [f'dashboard_keys = ["{hash_key(dashboard)}"]'] if dashboard else [])
    out = ["[auth]", *auth] if auth else []
    for name, key in tenants.items():
        out += ["[[tenants]]", f'name = "{name}"', f'keys = ["{hash_key(key)}"]',
                *(f"{k} = {json.dumps(v)}" for k, v in tenant_keys.items())]
    return "\n".join(out) + "\n"


def tail(path: Path, n: int = 30) -> str:
    """The last `n` lines of a server log, for error messages."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


# -- in process -----------------------------------------------------------------
@dataclass
class LiveServer:
    """The real gateway serving on loopback inside this event loop."""

    url: str
    node: Any  # llmd.node.Node
    server: Any  # sanic's AsyncioServer
    stopped: bool = False

    @property
    def base(self) -> str:
        return self.url + "/v1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def runtime(self, model: str = "fake") -> Any:
        """The model's configured version: its engine, queue and scheduler."""
        return self.node.registry.primary(model)

    def backend(self, model: str = "fake") -> Any:
        return self.runtime(model).backend

    async def stop(self) -> None:
        """Shut the server down as sanic would; a second call does nothing."""
        if self.stopped:
            return
        self.stopped = True
        await self.server.before_stop()
        self.server.close()
        # As sanic's own shutdown does: drop keep-alive connections, or wait_closed waits for them.
        for conn in list(self.server.connections):
            conn.close_if_idle() or conn.abort()
        await self.server.wait_closed()
        await self.server.after_stop()


def quiet_logs() -> None:
    """Warnings only from llmd and sanic: a bench's own output is what it reports."""
    from llmd.telemetry import configure_logging

    configure_logging("warning")
    logging.getLogger("sanic").setLevel(logging.WARNING)


async def start_inprocess(cfg: Any, name: str, store: Any = None, port: int | None = None) -> LiveServer:
    """The real gateway and node for `cfg` (an llmd.config.Config; its server.port is set
    to the port used) on loopback, in this event loop. `name` must be unique per process
    (sanic registers apps by name); `store` is a WeightStore (None: the default one).

    Built by llmd's own wiring point (`llmd.node.build_node`), as `llmd serve` is. The
    request path reaches the ledger through `node.lifecycle.ledger` on every request, so
    bench/metering.py can swap in stand-ins between rounds."""
    from llmd.gateway import PROTOCOL, create_app
    from llmd.node import build_node

    port = port or free_port()
    cfg.server.port = port
    node = build_node(cfg, store)
    app = create_app(node, name=name, load_models=False)
    app.config.MOTD = False
    app.config.TOUCHUP = False  # touchup recompiles methods per app; breaks with many apps per process
    server = await app.create_server(host="127.0.0.1", port=port, return_asyncio_server=True, access_log=False,
                                     protocol=PROTOCOL)
    assert server is not None
    await server.startup()
    await server.before_start()
    await server.after_start()
    await node.load()
    return LiveServer(f"http://127.0.0.1:{port}", node, server)


# -- subprocesses -----------------------------------------------------------------
_BASE_ENV = threading.local()


@contextmanager
def inherit(env: Mapping[str, str]) -> Iterator[None]:
    """Processes this thread spawns inside the block start from `env`, not from os.environ as it is
    then: a server started in a background thread must not pick up a variable some test has
    monkeypatched for itself meanwhile (LLMD_HOME, say)."""
    _BASE_ENV.env = dict(env)
    try:
        yield
    finally:
        del _BASE_ENV.env


def spawn(argv: list[str], log: Path, env_extra: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session (its PID is its process group's id, so `stop` can sweep
    the engine processes it starts), output to `log`, from the repository root (or `cwd`: another
    checkout's, whose `llmd` then runs)."""
    base = getattr(_BASE_ENV, "env", None)
    env = {**(os.environ if base is None else base), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd or ROOT,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path, interval: float = 0.5,
               context: ssl.SSLContext | None = None) -> None:
    """Poll `url` until it answers 200 (https: trusting `context`); raise (with the log's tail)
    if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status == 200:
                    return
        except OSError:  # refused, or HTTPError (503 while models load)
            pass
        time.sleep(interval)
    raise RuntimeError(f"server not ready at {url} after {timeout:.0f}s; log {log}:\n{tail(log)}")


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the server (unless it already exited), then SIGKILL anything left in its process
    group and wait until the group is gone, so the next server never overlaps this one."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with suppress(ProcessLookupError):  # its own session: the group id is its PID; sweep engine children left behind
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)


@contextmanager
def running(argv: list[str], ready_url: str, log: Path, timeout: float,
            env_extra: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A server process that is ready inside the block and stopped (group and all) after it."""
    proc = spawn(argv, log, env_extra)
    try:
        wait_ready(proc, ready_url, timeout, log)
        yield proc
    finally:
        stop(proc)


@dataclass
class ServerProcess:
    """`llmd serve` running in a subprocess, and how to reach it."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def engine_stats(self, since: float | None = None, model: str = "smollm2") -> dict[str, Any]:
        """`model`'s entry of /admin/engines (per-step history after `since`, wall clock)."""
        import httpx

        q = f"?since={since}" if since is not None else ""
        return httpx.get(f"{self.url}/admin/engines{q}", timeout=10).json()[model]


def start_server_process(toml: str, tmp: Path, ready_timeout: float = 240.0,
                         env_extra: dict[str, str] | None = None) -> ServerProcess:
    """`llmd serve` on a config made from `toml` (its {port} and {db} filled in, files in `tmp`),
    ready to serve; stopped again if it does not get ready."""
    port = free_port()
    cfg = tmp / "config.toml"
    cfg.write_text(toml.format(port=port, db=tmp / "llmd.db"))
    log = tmp / "server.log"
    proc = spawn([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)], log, env_extra)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/ready", ready_timeout, log)
    except BaseException:
        stop(proc)
        raise
    return ServerProcess(url, proc, log)
