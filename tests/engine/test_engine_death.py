"""Engine death on the real engine: SIGKILL vLLM's EngineCore mid-stream.

Uses its own server (the shared one must stay alive for the other tests)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from tests.conftest import ENGINE_TOML, EngineServer, start_server_process, stop_process, wait_until

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def doomed_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    srv = start_server_process(ENGINE_TOML, tmp_path_factory.mktemp("doomed"))
    yield srv
    stop_process(srv.proc)


def _engine_core(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError("no EngineCore child process found")


def test_engine_killed_mid_stream(doomed_server: EngineServer) -> None:
    core = _engine_core(doomed_server.proc.pid)
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}
    events: list[str] = []
    with httpx.Client(timeout=30) as http, http.stream("POST", doomed_server.base + "/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 5:
                    os.kill(core.pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "engine_dead" and err["type"] == "server_error"
    # Afterwards: not ready, and new requests are refused at once with a retry hint, not hung.
    assert wait_until(lambda: httpx.get(doomed_server.url + "/ready").status_code == 503, 10)
    r = httpx.post(doomed_server.base + "/completions", json={"model": "smollm2", "prompt": "hi"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unhealthy" and r.headers["retry-after"]
    assert httpx.get(doomed_server.url + "/health").status_code == 200  # the process itself lives on
    rec = [json.loads(line) for line in doomed_server.log_lines() if '"event": "request"' in line]
    assert any(x["error_code"] == "engine_dead" and x["output_tokens"] >= 4 for x in rec)
