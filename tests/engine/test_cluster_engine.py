"""The cluster on the real engine: two llmd nodes on this box (SmolLM2 on vLLM, one core each,
KV events on). A prompt whose prefix is cached on B, sent to A, runs on B with cached tokens;
a third node that joins with an empty weight store pulls the model from both; kill -9 of B
mid-stream: the stream completes through A, its text at temperature 0 the same as a run never
interrupted, and one usage row on A."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.lib.servers import free_port, spawn, stop, wait_ready
from tests import ahead
from tests.conftest import ENGINE_TOML, tmp

pytestmark = pytest.mark.engine
SECRET = "engine-cluster-test-secret-0123456789"
SYSTEM = ("You are the support assistant of a small bakery. Answer briefly and politely. " +
          "The bakery opens at seven, sells bread, cakes and coffee, and closes at six. " * 12)
CLUSTER = """
[cluster]
enabled = true
gossip_port = {gossip}
seeds = [{seeds}]
"""


def _node(tmp: Path, name: str, gossip: int, seeds: list[int], core: str, env: dict[str, str]) -> dict[str, Any]:
    d = tmp / name
    d.mkdir()
    port = free_port()
    toml = ENGINE_TOML.format(port=port, db=d / "llmd.db").replace('[server]\n', f'[server]\nnode = "{name}"\n', 1)
    toml += f'cpu_threads_bind = "{core}"\nkv_events = true\n'  # [models.engine] is the last table
    toml += CLUSTER.format(gossip=gossip, seeds=", ".join(f'"127.0.0.1:{p}"' for p in seeds))
    (d / "config.toml").write_text(toml)
    log = d / "server.log"
    proc = spawn([sys.executable, "-m", "llmd", "serve", "--config", str(d / "config.toml")], log,
                 {"LLMD_CLUSTER_SECRET": SECRET, **env})
    return {"name": name, "url": f"http://127.0.0.1:{port}", "proc": proc, "log": log, "db": d / "llmd.db",
            "gossip": gossip}


def _chat(node: dict[str, Any], user: str, max_tokens: int = 24, stream: bool = False) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def _sees(node: dict[str, Any], peers: int) -> bool:
    st = httpx.get(node["url"] + "/admin/cluster", timeout=10).json()
    return sum(1 for m in st["members"] if m["state"] == "alive" and m["versions"]) >= peers


def _wait(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.5)
    return False


def _events(node: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in node["log"].read_text(errors="replace").splitlines() if f'"event": "{name}"' in x]


def _pair() -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Nodes A and B, ready (each on a core of its own), and the folder they run in."""
    d, ga, gb = tmp("engine-cluster"), free_port(), free_port()
    a = _node(d, "A", ga, [gb], "0", {})
    b = _node(d, "B", gb, [ga], "1", {})
    try:
        for n in (a, b):
            wait_ready(n["proc"], n["url"] + "/ready", 300, n["log"])
    except BaseException:
        _stop_pair((a, b, d))
        raise
    return a, b, d


def _stop_pair(pair: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    for n in pair[:2]:
        stop(n["proc"], grace=10)


ahead.STARTERS["engine_pair"] = (_pair, _stop_pair)
ahead.ROOMS["engine_pair"] = 2


@pytest.fixture
def engine_pair(smollm2_path: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any], Path]]:
    """Started ahead of the engine tests (tests/ahead.py)."""
    yield ahead.take("engine_pair")
    ahead.finish("engine_pair")


@pytest.mark.timeout(1200)
def test_two_engine_nodes_route_by_cache_fail_over_and_a_third_pulls_weights(
        engine_pair: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    a, b, tmp_path = engine_pair
    gc = free_port()
    nodes = [a, b]
    try:
        assert _wait(lambda: _sees(a, 1) and _sees(b, 1), 30)
        with httpx.Client(timeout=300) as h:
            # The prompt's first run: the node that runs it (placement's pick) caches the prefix,
            # and the other hears of it by gossip. Call it B from here on; A is the other.
            r = h.post(b["url"] + "/v1/chat/completions", json=_chat(b, "When do you open?"))
            assert r.status_code == 200, r.text
            first_ingress = b["name"]
            if r.headers["x-llmd-node"] == "A":
                a, b = b, a
            time.sleep(1.5)
            r = h.post(a["url"] + "/v1/chat/completions", json=_chat(a, "Do you sell coffee?"))
            assert r.status_code == 200, r.text
            assert r.headers["x-llmd-node"] == b["name"]  # sent to A, run on B: its cache holds the prefix
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

            # A third node with an empty weight store joins: it pulls the model from A and B.
            home = tmp_path / "c-home"
            c = _node(tmp_path, "C", gc, [a["gossip"], b["gossip"]], "0", {"LLMD_HOME": str(home)})
            nodes.append(c)
            assert _wait(lambda: bool(_events(c, "cluster_weights_pulled")), 300), c["log"].read_text()[-3000:]
            pulled = _events(c, "cluster_weights_pulled")[0]
            assert len(pulled["chunks_by_peer"]) == 2, pulled  # chunks from both peers
            stop(c["proc"], grace=10)

            # A long answer that runs on B (its cache), read through A; B is killed mid-stream.
            texts: list[str] = []
            with h.stream("POST", a["url"] + "/v1/chat/completions",
                          json=_chat(a, "Tell me about the bakery in detail.", 120, stream=True)) as s:
                assert s.headers["x-llmd-node"] == b["name"]
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    texts += [ch["delta"].get("content") or "" for ch in obj.get("choices", [])]
                    if len(texts) == 8 and b["proc"].poll() is None:
                        os.kill(b["proc"].pid, signal.SIGKILL)
            assert _wait(lambda: not _sees(a, 1), 10)
            whole = h.post(a["url"] + "/v1/chat/completions",
                           json=_chat(a, "Tell me about the bakery in detail.", 120)).json()
            assert "".join(texts) == whole["choices"][0]["message"]["content"]
        assert _events(a, "cluster_failover"), "the stream did fail over"
        with sqlite3.connect(a["db"]) as db:
            rows = db.execute("SELECT status FROM usage").fetchall()
        # A's rows: the coffee question, the resumed stream, the reference (and the first
        # question when A received it); B kept none for the work it ran for A.
        assert rows == [("ok",)] * (3 + (first_ingress == a["name"]))
    finally:
        for n in nodes:
            stop(n["proc"], grace=10)
