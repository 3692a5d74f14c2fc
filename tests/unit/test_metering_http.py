"""Metering end to end: every request leaves exactly one usage row; /metrics agrees with the ledger;
a SIGKILLed server's open rows come back as `interrupted`."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmd.auth import hash_key
from tests.conftest import LiveServer, async_wait_until, start_server_process, stop_process

KEY_A, KEY_B, ADMIN = "sk-llmd-meter-a", "sk-llmd-meter-b", "sk-llmd-meter-admin"
TOML = f"""
[server]
default_deadline_s = 30
[auth]
admin_keys = ["{hash_key(ADMIN)}"]
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 2000
[models.engine]
max_model_len = 4096
restart_attempts = 0
[models.fake]
step_ms = 5
step_ms_per_seq = 0.0
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 3.0
[[tenants]]
name = "a"
keys = ["{hash_key(KEY_A)}"]
tokens_per_minute = 2000
[[tenants]]
name = "b"
keys = ["{hash_key(KEY_B)}"]
"""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def rows(live: LiveServer) -> list[dict]:
    await live.node.ledger.flush()
    return await live.node.ledger.rows(None, 1000, None)


async def test_every_outcome_leaves_exactly_one_row(make_server) -> None:
    live = await make_server(TOML)
    be = live.backend()
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        ok = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 7}, headers=auth(KEY_A))
        bad = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": "7"},
                           headers=auth(KEY_A))
        big = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2001},
                           headers=auth(KEY_B))
        shed = await h.post("/completions", json={"model": "fake", "prompt": "x" * 10, "max_tokens": 1999},
                            headers=auth(KEY_A) | {"X-Request-Timeout": "30"})
        late = await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 1000},
                            headers=auth(KEY_B) | {"X-Request-Timeout": "0.3"})
        # A cancelled stream: metered with the tokens it actually produced.
        async with h.stream("POST", "/completions", headers=auth(KEY_B),
                            json={"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 6:
                    break
        assert await async_wait_until(lambda: len(be.aborted) == 2)
        # An engine failure mid-stream.
        async with h.stream("POST", "/completions", headers=auth(KEY_B),
                            json={"model": "fake", "prompt": "y", "max_tokens": 1000, "stream": True}) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 4:
                    be.kill()
    assert [ok.status_code, bad.status_code, big.status_code, late.status_code] == [200, 400, 400, 504]
    assert shed.status_code == 429
    got = await rows(live)
    assert len(got) == 7 and len({r["request_id"] for r in got}) == 7
    by_status = Counter(r["status"] for r in got)
    assert by_status == {"ok": 1, "error": 3, "shed": 1, "deadline": 1, "cancelled": 1}
    cancelled = next(r for r in got if r["status"] == "cancelled")
    assert 6 <= cancelled["output_tokens"] < 1000
    dead = [r for r in got if r["status"] == "error" and r["output_tokens"] > 0]
    assert len(dead) == 1 and dead[0]["output_tokens"] >= 3
    first = next(r for r in got if r["status"] == "ok" and r["output_tokens"] == 7)
    assert first["cost"] == pytest.approx((first["prompt_tokens"] * 1.0 + 7 * 3.0) / 1e6)
    assert all(r["status"] != "open" for r in got)


async def test_metrics_parse_and_agree_with_the_ledger(make_server) -> None:
    live = await make_server(TOML)
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        for i in range(5):
            await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3 + i},
                         headers=auth(KEY_A))
        await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 9, "stream": True},
                     headers=auth(KEY_B))
        await h.post("/completions", json={"model": "nope", "prompt": "x"}, headers=auth(KEY_B))
        text = (await h.get(live.url + "/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    req = Counter()
    for s in fams["llmd:requests"].samples:
        if s.name.endswith("_total"):
            req[(s.labels["tenant"], s.labels["status"])] += s.value
    led = Counter((r["tenant"], r["status"]) for r in await rows(live))
    assert {k: v for k, v in req.items() if v} == {(t, "rejected" if s == "error" else s): n
                                                   for (t, s), n in led.items()}
    gen = sum(s.value for s in fams["llmd:generation_tokens"].samples if s.name.endswith("_total"))
    assert gen == sum(r["output_tokens"] for r in await rows(live)) == sum(3 + i for i in range(5)) + 9
    ttft = [s for s in fams["llmd:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in ttft) == 6
    assert any(s.labels.get("class") == "interactive" for s in fams["llmd:queue_depth"].samples)


async def test_usage_endpoint_scopes_tenants(make_server) -> None:
    live = await make_server(TOML)
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 4}, headers=auth(KEY_A))
        await h.post("/completions", json={"model": "fake", "prompt": "x", "max_tokens": 5}, headers=auth(KEY_B))
        await live.node.ledger.flush()
        mine = (await h.get("/usage", headers=auth(KEY_A))).json()["data"]
        assert [(d["tenant"], d["output_tokens"]) for d in mine] == [("a", 4)]
        assert (await h.get("/usage?tenant=b", headers=auth(KEY_A))).status_code == 403
        everyone = (await h.get("/usage?group_by=tenant", headers=auth(ADMIN))).json()["data"]
        assert sorted((d["tenant"], d["output_tokens"]) for d in everyone) == [("a", 4), ("b", 5)]
        raw = (await h.get("/usage?rows=1", headers=auth(KEY_B))).json()["data"]
        assert len(raw) == 1 and raw[0]["tenant"] == "b" and raw[0]["status"] == "ok"
        assert (await h.get("/usage?group_by=colour", headers=auth(ADMIN))).status_code == 400
        assert (await h.get("/usage?since=yesterday", headers=auth(ADMIN))).status_code == 400
        assert (await h.get("/usage")).status_code == 401


CRASH_TOML = """
[server]
host = "127.0.0.1"
port = {port}
db_path = "{db}"
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4000
[models.engine]
max_model_len = 8192
[models.fake]
step_ms = 20
step_ms_per_seq = 0.0
"""


def test_sigkill_mid_stream_leaves_an_interrupted_row(tmp_path: Path) -> None:
    srv = start_server_process(CRASH_TOML, tmp_path, ready_timeout=60)
    try:
        for i in range(3):
            r = httpx.post(srv.base + "/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2 + i},
                           timeout=30)
            assert r.status_code == 200
        seen = 0
        with httpx.stream("POST", srv.base + "/completions", timeout=30,
                          json={"model": "fake", "prompt": "x", "max_tokens": 3000, "stream": True}) as r:
            t0 = time.monotonic()
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if time.monotonic() - t0 > 2.5:  # past two progress checkpoints
                    os.kill(srv.proc.pid, signal.SIGKILL)
                    break
        srv.proc.wait(10)
    finally:
        stop_process(srv.proc)
    srv2 = start_server_process(CRASH_TOML.replace("{port}", "{port}"), tmp_path, ready_timeout=60)
    try:
        data = httpx.get(srv2.base + "/usage?rows=1&limit=100", timeout=10).json()["data"]
    finally:
        stop_process(srv2.proc)
    assert len(data) == 4 and len({d["request_id"] for d in data}) == 4  # none lost, none doubled
    assert sorted(d["status"] for d in data) == ["interrupted", "ok", "ok", "ok"]
    lost = next(d for d in data if d["status"] == "interrupted")
    assert 0 < lost["output_tokens"] <= seen + 1 and lost["closed_at"] is not None
    assert sorted(d["output_tokens"] for d in data if d["status"] == "ok") == [2, 3, 4]
    recovered = [json.loads(x) for x in srv2.log_lines() if "ledger_recovered" in x]
    assert recovered and recovered[0]["interrupted_rows"] == 1
