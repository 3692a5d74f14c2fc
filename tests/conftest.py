"""Shared fixtures: real servers over loopback, either in-process (fake backend) or as a
subprocess running the real vLLM engine on the stored SmolLM2 model (one per session, started
ahead of the engine tests, which run last: tests/ahead.py).

How a server is started and stopped is bench.lib.servers' job (the benchmarks start theirs
the same way); this file keeps the fixtures and the names tests import from it."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.lib.servers import (
    LiveServer,
    ServerProcess,
    free_port,
    spawn,
    start_inprocess,
    start_server_process,
    tool,
    two_version_store,
    wait_ready,
)
from bench.lib.servers import stop as stop_process
from llmd.config import Config
from llmd.store import StoreError, WeightStore
from tests import ahead

REPO = Path(__file__).resolve().parent.parent
EngineServer = ServerProcess  # the name engine tests know it by
__all__ = ["ENGINE_TOML", "EngineServer", "LiveServer", "PeerServer", "async_wait_until", "client_ids", "fake_toml",
           "free_port", "start_server_process", "stop_process", "wait_until"]
_names = itertools.count()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The stored SmolLM2 model. `make test` pulls it; its absence is a set-up error, not a skip."""
    try:
        return WeightStore().resolve("smollm2").path
    except StoreError as e:
        pytest.fail(f"{e} (run `make test`, which pulls it)")


# -- in-process server with the fake backend ---------------------------------
@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[Any]:
    """Start the real sanic app on a free loopback port inside the test's event loop."""
    started: list[LiveServer] = []

    async def _make(toml: str, store: Any = None) -> LiveServer:
        port = free_port()
        cfg = Config.model_validate(__import__("tomllib").loads(textwrap.dedent(toml)))
        if cfg.server.db_path is None:
            cfg.server.db_path = tmp_path / f"llmd-{port}.db"
        live = await start_inprocess(cfg, f"llmd_test_{next(_names)}", store, port)
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
restart_attempts = {restart_attempts}
[models.fake]
step_ms = {step_ms}
step_ms_per_seq = 0.0
max_num_seqs = 8
[models.scheduling]
max_running = {max_running}
"""


def fake_toml(max_running: int = 8, step_ms: float = 2.0, restart_attempts: int = 5) -> str:
    """`restart_attempts = 0`: a killed engine stays dead (no supervisor rebuild)."""
    return FAKE_TOML.format(max_running=max_running, step_ms=step_ms, restart_attempts=restart_attempts)


# -- subprocess server with the real vLLM engine ------------------------------
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
tool_parser = "pythonic"
[models.engine]
max_model_len = 2048
kv_cache_gib = 1
max_num_seqs = 16
max_num_batched_tokens = 1024
dtype = "float32"
"""


_STORE = threading.Lock()  # the background start (tests/ahead.py) and a fixture may both ask for it


@pytest.fixture(scope="session")
def two_versions(smollm2_path: Path) -> tuple[Path, str, str]:
    """An LLMD_HOME whose store holds SmolLM2 twice under different content hashes: the stored
    (bf16) weights, hard-linked, and a float32 copy (made once, then kept next to the store)."""
    with _STORE:
        return two_version_store()


def pinned(toml: str, version: str) -> str:
    """`toml` (ENGINE_TOML's model) pinned to a stored version."""
    return toml.replace('source = "smollm2"', f'source = "smollm2"\nversion = "{version[:12]}"', 1)


def tmp(name: str) -> Path:
    """A fresh directory under the session's tmp_path_factory (for a server started ahead)."""
    return TMP[0].mktemp(name)


def _start_engine_server() -> EngineServer:
    with _STORE:  # the session's store, whatever LLMD_HOME a test running beside this start has set
        home, v_bf16, _ = two_version_store(ahead.SESSION_HOME)
    return start_server_process(pinned(ENGINE_TOML, v_bf16), tmp("engine"), env_extra={"LLMD_HOME": str(home)})


@pytest.fixture(scope="session")
def engine_server(smollm2_path: Path) -> Iterator[EngineServer]:
    """ENGINE_TOML on the stored SmolLM2 (the store's bf16 version, hard-linked: the same content
    hash and weights), with the float32 copy beside it in its store, which
    tests/engine/test_versions_engine.py loads next to it (one server start fewer). Started
    ahead of the engine tests (tests/ahead.py)."""
    yield ahead.take("engine_server")
    ahead.finish("engine_server")


@dataclass
class PeerServer:
    """`vllm serve` on the same model and engine settings as `engine_server`: the peer that
    llmd's answers are compared with."""

    url: str
    proc: subprocess.Popen[bytes]

    @property
    def base(self) -> str:
        return self.url + "/v1"


def _start_vllm_server() -> PeerServer:
    path = WeightStore().resolve("smollm2").path
    port, log = free_port(), tmp("vllm") / "vllm.log"
    argv = [tool("llmd-vllm"), "serve", str(path), "--served-model-name", "smollm2", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "16", "--max-num-batched-tokens",
            "1024", "--host", "127.0.0.1", "--port", str(port)]
    # Its own core: two engines on one box must not fight over the same one.
    proc = spawn(argv, log, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"})
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/health", 300, log)
    except BaseException:
        stop_process(proc)
        raise
    return PeerServer(f"http://127.0.0.1:{port}", proc)


@pytest.fixture(scope="session")
def vllm_server(smollm2_path: Path) -> Iterator[PeerServer]:
    yield ahead.take("vllm_server")
    ahead.finish("vllm_server")


TMP: list[pytest.TempPathFactory] = []
ahead.STARTERS |= {"engine_server": (_start_engine_server, lambda s: stop_process(s.proc)),
                   "vllm_server": (_start_vllm_server, lambda s: stop_process(s.proc))}


def pytest_sessionstart(session: pytest.Session) -> None:
    TMP.append(session.config._tmp_path_factory)  # what the tmp_path_factory fixture returns


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The engine tests last, those on the servers started ahead first among them (each server is
    stopped after its last test, before the engine tests that start their own); half-way through
    the other tests, those servers start in the background (the EARLY jobs at the first test)."""
    under = REPO / "tests/engine"
    rest = [i for i in items if not Path(i.path).is_relative_to(under)]
    engine = [i for i in items if Path(i.path).is_relative_to(under)]
    shared = {i.path for i in engine if set(getattr(i, "fixturenames", ())) & set(ahead.STARTERS)}
    engine.sort(key=lambda i: i.path not in shared)  # stable: a module's tests stay together, in order
    items[:] = rest + engine
    for i in items:
        for n in sorted(set(getattr(i, "fixturenames", ())) & set(ahead.STARTERS)):
            _LAST[n] = i  # (a dict keeps the order of first use)
    if set(_LAST) - ahead.EARLY:
        _TRIGGER.append(items[len(rest) // 2])
    if set(_LAST) & ahead.EARLY:
        _TRIGGER_EARLY.append(items[0])


_LAST: dict[str, pytest.Item] = {}  # each server started ahead -> the last test that uses it
_TRIGGER: list[pytest.Item] = []
_TRIGGER_EARLY: list[pytest.Item] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item in _TRIGGER_EARLY:
        ahead.begin([n for n in _LAST if n in ahead.EARLY])
    if item in _TRIGGER:
        ahead.begin([n for n in _LAST if n not in ahead.EARLY])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Each server started ahead stops after its last test: an engine holds about 4 GB."""
    for name in [n for n, last in _LAST.items() if last is item]:
        ahead.finish(name)


def pytest_sessionfinish(session: pytest.Session) -> None:
    ahead.finish_all()


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
