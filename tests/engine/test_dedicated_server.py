"""Tests that need their own real-engine server: one seat (to force preemption), then
engine death (SIGKILL vLLM's EngineCore mid-stream) with restarts off, in that order
(tests/engine/test_engine_restart.py: the engine rebuilt and the streams resumed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests import ahead
from tests.conftest import ENGINE_TOML, EngineServer, start_server_process, stop_process, tmp, wait_until

pytestmark = pytest.mark.engine


DOOMED_TOML = (ENGINE_TOML + "restart_attempts = 0\n"  # [models.engine] is ENGINE_TOML's last table
               "[models.scheduling]\nmax_running = 1\nreserved_seats = 0\n")
ahead.STARTERS["doomed_server"] = (lambda: start_server_process(DOOMED_TOML, tmp("doomed")),
                                   lambda srv: stop_process(srv.proc))


@pytest.fixture(scope="module")
def doomed_server(smollm2_path: Path) -> Iterator[EngineServer]:
    """Started ahead of the engine tests (tests/ahead.py)."""
    yield ahead.take("doomed_server")
    ahead.finish("doomed_server")


def _engine_core(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError("no EngineCore child process found")


def test_preempted_batch_resumes_with_the_same_text(doomed_server: EngineServer) -> None:
    """Greedy decoding resumed from prompt + tokens so far must continue exactly where it stopped."""
    c = openai.AsyncOpenAI(base_url=doomed_server.base, api_key="unused", max_retries=0, timeout=120)
    body = {"model": "smollm2", "prompt": "The history of the Roman Empire", "max_tokens": 120, "temperature": 0,
            "extra_body": {"ignore_eos": True}}

    async def scenario() -> tuple[str, str, openai.types.Completion]:
        alone = await c.completions.create(**body, extra_headers={"X-Priority-Class": "batch"})
        batch = asyncio.create_task(c.completions.create(**body, extra_headers={"X-Priority-Class": "batch"}))
        await asyncio.sleep(1.0)  # the batch request is generating
        inter = await c.completions.create(model="smollm2", prompt="Hello", max_tokens=5, temperature=0)
        return alone.choices[0].text, (await batch).choices[0].text, inter

    alone, resumed, inter = asyncio.run(scenario())
    assert inter.usage.completion_tokens == 5
    stats = doomed_server.engine_stats()
    assert stats["preempted"] == 1
    assert resumed == alone
    recs = [json.loads(line) for line in doomed_server.log_lines() if '"event": "request"' in line]
    assert [r["preemptions"] for r in recs if r["priority_class"] == "batch"] == [0, 1]
    assert all(r["output_tokens"] == 120 for r in recs if r["priority_class"] == "batch")


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
    # Its only engine is dead for good (restarts off): unhealthy, so an orchestrator restarts the node.
    assert httpx.get(doomed_server.url + "/health").status_code == 503
    rec = [json.loads(line) for line in doomed_server.log_lines() if '"event": "request"' in line]
    assert any(x["error_code"] == "engine_dead" and x["output_tokens"] >= 4 for x in rec)
