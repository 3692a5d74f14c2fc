"""Shared fixtures: real servers over loopback, either in-process (fake backend) or as a
subprocess running the real vLLM engine on the stored SmolLM2 model (one per session)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

from llmd.config import Config
from llmd.store import StoreError, WeightStore

REPO = Path(__file__).resolve().parent.parent
_names = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The stored SmolLM2 model. `make test` pulls it; its absence is a set-up error, not a skip."""
    try:
        return WeightStore().resolve("smollm2").path
    except StoreError as e:
        pytest.fail(f"{e} (run `make test`, which pulls it)")


# -- in-process server with the fake backend ---------------------------------
@dataclass
class LiveServer:
    url: str
    node: Any
    server: Any

    @property
    def base(self) -> str:
        return self.url + "/v1"

    stopped: bool = False

    def runtime(self, model: str = "fake") -> Any:
        """The model's configured version: its engine, queue and scheduler."""
        return self.node.registry.primary(model)

    def backend(self, model: str = "fake") -> Any:
        return self.runtime(model).backend

    async def stop(self) -> None:
        """Shut the server down as sanic would (the fixture does it for the ones left running)."""
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


@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[Any]:
    """Start the real sanic app on a free loopback port inside the test's event loop."""
    from llmd.gateway import create_app
    from llmd.node import build_node

    started: list[LiveServer] = []

    async def _make(toml: str, store: Any = None) -> LiveServer:
        port = free_port()
        cfg = Config.model_validate(__import__("tomllib").loads(textwrap.dedent(toml)))
        cfg.server.port = port
        if cfg.server.db_path is None:
            cfg.server.db_path = tmp_path / f"llmd-{port}.db"
        node = build_node(cfg, store)
        app = create_app(node, name=f"llmd_test_{next(_names)}", load_models=False)
        app.config.MOTD = False
        app.config.TOUCHUP = False  # touchup recompiles methods per app; breaks with many apps per process
        server = await app.create_server(host="127.0.0.1", port=port, return_asyncio_server=True, access_log=False)
        assert server is not None
        await server.startup()
        await server.before_start()
        await server.after_start()
        await node.load()
        live = LiveServer(f"http://127.0.0.1:{port}", node, server)
        started.append(live)
        return live

    yield _make
    for live in started:
        await live.stop()


@pytest.fixture
def records() -> Iterator[list[dict[str, Any]]]:
    """Every request record emitted while the test runs."""
    from llmd import telemetry

    out: list[dict[str, Any]] = []
    telemetry.RECORD_SINKS.append(out.append)
    yield out
    telemetry.RECORD_SINKS.remove(out.append)


def client_ids(engine_ids: list[str], records: list[dict[str, Any]]) -> list[str | None]:
    """Engine request ids (ours) translated to the clients' X-Request-IDs, via the request records."""
    by_id = {r["request_id"]: r["client_request_id"] for r in records}
    return [by_id.get(e[:36]) for e in engine_ids]  # "req-" + 32 hex digits, then our suffixes


FAKE_TOML = """
[server]
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
default_max_tokens = 16
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = {step_ms}
step_ms_per_seq = 0.0
max_num_seqs = 8
[models.scheduling]
max_running = {max_running}
"""


def fake_toml(max_running: int = 8, step_ms: float = 2.0) -> str:
    return FAKE_TOML.format(max_running=max_running, step_ms=step_ms)


# -- subprocess server with the real vLLM engine ------------------------------
@dataclass
class EngineServer:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def engine_stats(self, since: float | None = None) -> dict[str, Any]:
        q = f"?since={since}" if since is not None else ""
        return httpx.get(f"{self.url}/admin/engines{q}", timeout=10).json()["smollm2"]


ENGINE_TOML = """
[server]
host = "127.0.0.1"
port = {port}
default_deadline_s = 120
db_path = "{db}"
[[models]]
name = "smollm2"
source = "smollm2"
backend = "vllm"
max_prompt_tokens = 1000
max_output_tokens = 1024
default_max_tokens = 64
[models.engine]
max_model_len = 2048
kv_cache_gib = 1
max_num_seqs = 16
max_num_batched_tokens = 1024
dtype = "float32"
"""


def start_server_process(toml: str, tmp: Path, ready_timeout: float = 240.0,
                         env_extra: dict[str, str] | None = None) -> EngineServer:
    port = free_port()
    cfg = tmp / "config.toml"
    cfg.write_text(toml.format(port=port, db=tmp / "llmd.db"))
    log_path = tmp / "server.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return EngineServer(url, proc, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_process(proc)
    raise RuntimeError(f"server not ready after {ready_timeout}s:\n{log_path.read_text()[-4000:]}")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="session")
def two_versions(smollm2_path: Path) -> tuple[Path, str, str]:
    """An LLMD_HOME whose store holds SmolLM2 twice under different content hashes: the stored
    (bf16) weights, hard-linked, and a float32 copy (made once, then kept next to the store)."""
    root = WeightStore().root.parent.parent / "llmd-test-versions"
    ws = WeightStore(root)
    a = ws.link_from(WeightStore().resolve("smollm2"))
    return root, a.version, ws.cast_copy(a, "float32").version


@pytest.fixture(scope="session")
def engine_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    srv = start_server_process(ENGINE_TOML, tmp_path_factory.mktemp("engine"))
    yield srv
    stop_process(srv.proc)


def wait_until(pred: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


async def async_wait_until(pred: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(interval)
    return False
