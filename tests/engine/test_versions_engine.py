"""Two versions of SmolLM2 (bf16 and float32 weights, two content hashes) loaded in one llmd
on the real engine, answering at the same time, each response naming its version. The server is
the session's `engine_server` (the bf16 version, configured): the test loads the float32 one
beside it, and unloads it again at the end (the server's other tests see one version)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import EngineServer

pytestmark = pytest.mark.engine


async def test_two_versions_answer_concurrently(two_versions: tuple[Path, str, str],
                                                engine_server: EngineServer) -> None:
    _, v_bf16, v_f32 = two_versions
    srv = engine_server
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as h:
            r = await h.post("/admin/models/smollm2/versions", json={"version": v_f32[:12]})
            assert r.status_code == 200, r.text
            assert {v["version"]: v["state"] for v in r.json()["versions"]} == {v_bf16: "active", v_f32: "standby"}

            async def ask(version: str) -> tuple[str, str, float, float]:
                t0 = time.monotonic()
                resp = await h.post("/v1/chat/completions", json={
                    "model": f"smollm2@{version[:12]}", "temperature": 0, "max_tokens": 24,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]})
                assert resp.status_code == 200, resp.text
                body = resp.json()
                assert body["model"] == f"smollm2@{version[:12]}"
                text = body["choices"][0]["message"]["content"]
                return resp.headers["x-llmd-model-version"], text, t0, time.monotonic()

            out = await asyncio.gather(*(ask(v) for v in (v_bf16, v_f32, v_bf16, v_f32)))
            assert [o[0] for o in out] == [v_bf16, v_f32, v_bf16, v_f32]
            assert all("Paris" in o[1] for o in out), [o[1] for o in out]
            a_start, a_end = min(o[2] for o in out[::2]), max(o[3] for o in out[::2])
            b_start, b_end = min(o[2] for o in out[1::2]), max(o[3] for o in out[1::2])
            assert a_start < b_end and b_start < a_end  # both engines were answering at the same time
            # And by split: half the conversations on each version.
            r = await h.put("/admin/models/smollm2/split", json={"weights": {v_bf16: 1, v_f32: 1}})
            assert r.status_code == 200, r.text
            seen = set()
            for i in range(12):
                resp = await h.post("/v1/chat/completions", headers={"X-Conversation-Id": f"c{i}"}, json={
                    "model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
                assert resp.status_code == 200
                seen.add(resp.headers["x-llmd-model-version"])
            assert seen == {v_bf16, v_f32}
    finally:  # back to the configured version alone, for the tests that share the server
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as h:
            await h.put("/admin/models/smollm2/split", json={"weights": {v_bf16: 1}})
            await h.delete(f"/admin/models/smollm2/versions/{v_f32[:12]}")
            described = (await h.get("/admin/models/smollm2")).json()
    assert [(v["version"], v["state"]) for v in described["versions"]] == [(v_bf16, "active")], described
