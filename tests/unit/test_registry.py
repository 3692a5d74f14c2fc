"""Several versions of one model (fake engines over two stored copies with different content
hashes): a weighted split, sticky conversations, pinning, the served version named in every
response, rollback, drain, unload, a hash mismatch, and the registry surviving a restart."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from bench.lib.servers import tiny_versions
from llmd.auth import hash_key
from llmd.cli import main as cli_main
from llmd.registry.compare import compare
from llmd.registry.routing import RoutingView, Split, parse_model, unit_point
from llmd.store import WeightStore
from tests.conftest import LiveServer

KEY, ADMIN = "sk-llmd-reg-a", "sk-llmd-reg-admin"
TOML = f"""
[server]
default_deadline_s = 30
db_path = "{{db}}"
[auth]
admin_keys = ["{hash_key(ADMIN)}"]
[[models]]
name = "m"
source = "tiny"
version = "{{version}}"
backend = "fake"
[models.fake]
step_ms = 1
step_ms_per_seq = 0.0
max_num_seqs = 64
[[tenants]]
name = "a"
keys = ["{hash_key(KEY)}"]
"""


@pytest.fixture
def store(tmp_path: Path, smollm2_path: Path) -> tuple[WeightStore, list[str]]:
    """Two stored versions of a tiny model (SmolLM2's tokenizer; different weight bytes, as a
    bf16 and a float32 copy would have)."""
    ws, versions = tiny_versions(tmp_path / "home", (b"weights in bf16", b"weights in float32"))
    assert versions[0] != versions[1]
    return ws, versions


def toml(tmp_path: Path, version: str) -> str:
    return TOML.format(db=tmp_path / "llmd.db", version=version[:12])


def admin(live: LiveServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)


def client(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key=KEY, max_retries=0, timeout=30)


async def ask(c: openai.AsyncOpenAI, conversation: str | None, model: str = "m",
              max_tokens: int = 2) -> tuple[str, Any]:
    headers = {"X-Conversation-Id": conversation} if conversation else {}
    raw = await c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, extra_headers=headers)
    return raw.headers["x-llmd-model-version"], raw.parse()


def test_split_routing_is_stable_and_proportional() -> None:
    split = Split.of({"v2": 10, "v1": 90})
    picks = Counter(split.pick(unit_point(f"conv-{i}")) for i in range(20000))
    assert abs(picks["v1"] / 20000 - 0.9) < 0.01
    assert all(split.pick(unit_point("same")) == split.pick(unit_point("same")) for _ in range(10))
    # Shifting weight moves only conversations in the part of [0, 1) that changed hands.
    before = {i: split.pick(unit_point(f"c{i}")) for i in range(5000)}
    after = {i: Split.of({"v1": 80, "v2": 20}).pick(unit_point(f"c{i}")) for i in range(5000)}
    assert all(after[i] == "v2" for i in before if before[i] == "v2")
    view = RoutingView({"m": split}, {"m": frozenset({"abc123", "abd456"})})
    assert view.route("m", pin="abd") == "abd456"
    with pytest.raises(Exception, match="more than one"):
        view.route("m", pin="ab")
    assert parse_model("m@abc") == ("m", "abc") and parse_model("m") == ("m", None)
    with pytest.raises(ValueError, match="at least one version with a weight above 0"):
        Split.of({"v1": 0})


async def test_ninety_ten_split_over_a_thousand_requests(make_server, tmp_path: Path, store) -> None:
    ws, (v1, v2) = store
    live = await make_server(toml(tmp_path, v1), ws)
    async with admin(live) as h:
        r = await h.post("/admin/models/m/versions", json={"version": v2[:12], "cpu_threads_bind": "1"})
        assert r.status_code == 200, r.text
        assert {v["version"]: v["state"] for v in r.json()["versions"]} == {v1: "active", v2: "standby"}
        rts = live.node.registry.runtimes["m"]
        assert rts[v2].cfg.engine.cpu_threads_bind == "1" and rts[v1].cfg.engine.cpu_threads_bind is None
        r = await h.put("/admin/models/m/split", json={"weights": {v1[:12]: 90, v2[:12]: 10}})
        assert r.status_code == 200, r.text
    c = client(live)
    results: list[tuple[str, str, Any]] = []
    for start in range(0, 1000, 50):
        batch = [f"conv-{i % 400}" for i in range(start, start + 50)]  # 400 conversations, 2-3 turns each
        outs = await asyncio.gather(*(ask(c, conv) for conv in batch))
        results += [(conv, ver, resp) for conv, (ver, resp) in zip(batch, outs, strict=True)]
    share = sum(ver == v2 for _, ver, _ in results) / len(results)
    assert abs(share - 0.10) <= 0.03, share
    by_conv: dict[str, set[str]] = {}
    for conv, ver, resp in results:
        by_conv.setdefault(conv, set()).add(ver)
        assert resp.model == f"m@{ver[:12]}"  # the response names the version that served it
    assert all(len(vs) == 1 for vs in by_conv.values())  # every conversation on one version
    # Nothing served by a version other than the one routed: each engine saw exactly its requests.
    engines = live.node.registry.runtimes["m"]
    seen = {v: {e.rsplit("-", 1)[0] for e in engines[v].backend.submitted if e.startswith("req-")} for v in (v1, v2)}
    assert sum(e.startswith("warmup-") for e in engines[v2].backend.submitted) == 3  # warmed up out of rotation
    served = Counter(ver for _, ver, _ in results)
    assert len(seen[v1]) == served[v1] and len(seen[v2]) == served[v2] and not seen[v1] & seen[v2]
    # `llmd compare` reads the same numbers back from the request log and the ledger.
    await live.node.ledger.flush()
    db = live.node.config.server.db_path
    stats = compare(db, "m", [v1[:12], v2[:10]])
    assert [s["requests"] for s in stats] == [served[v1], served[v2]]
    assert all(s["truncated"] == 1.0 and s["out_p50"] == 2 and s["errors"] == 0 for s in stats)
    out = CliRunner().invoke(cli_main, ["compare", "m", v1[:12], v2[:12], "--db", str(db)])
    assert out.exit_code == 0 and v1[:12] in out.output and "truncated" in out.output, out.output
    # A pin overrides the split; an unknown pin is a 404 naming the model.
    ver, resp = await ask(c, "conv-1", model=f"m@{v2[:8]}")
    assert ver == v2
    with pytest.raises(openai.NotFoundError) as e:
        await ask(c, None, model="m@ffffffff")
    assert e.value.body["code"] == "model_version_not_found"


async def test_rollback_applies_to_the_next_request_and_state_survives_a_restart(make_server, tmp_path: Path,
                                                                                 store) -> None:
    ws, (v1, v2) = store
    live = await make_server(toml(tmp_path, v1), ws)
    c = client(live)
    async with admin(live) as h:
        assert (await h.post("/admin/models/m/versions", json={"version": v2})).status_code == 200
        assert (await h.put("/admin/models/m/split", json={"weights": {v2: 1}})).status_code == 200
        assert {(await ask(c, f"k{i}"))[0] for i in range(20)} == {v2}
        r = await h.post("/admin/models/m/rollback")
        assert r.status_code == 200 and r.json()["split"] == {v1: 1.0}
        assert {(await ask(c, f"k{i}"))[0] for i in range(20)} == {v1}  # the very next requests
        assert (await h.put("/admin/models/m/split", json={"weights": {v1: 3, v2: 1}})).status_code == 200
    await live.stop()
    again = await make_server(toml(tmp_path, v1), ws)
    async with admin(again) as h:
        state = (await h.get("/admin/models/m")).json()
    assert state["split"] == {v1: 3.0, v2: 1.0}
    assert {v["version"]: v["state"] for v in state["versions"]} == {v1: "active", v2: "active"}
    assert {(await ask(client(again), f"k{i}"))[0] for i in range(40)} == {v1, v2}


async def test_drain_under_live_streams_breaks_none_then_unload(make_server, tmp_path: Path, store) -> None:
    ws, (v1, v2) = store
    live = await make_server(toml(tmp_path, v1).replace("step_ms = 1", "step_ms = 10"), ws)
    c = client(live)
    async with admin(live) as h:
        assert (await h.post("/admin/models/m/versions", json={"version": v2})).status_code == 200
        assert (await h.put("/admin/models/m/split", json={"weights": {v2: 1}})).status_code == 200

        async def stream() -> tuple[int, str | None]:
            s = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=100, stream=True)
            n, finish = 0, None
            async for chunk in s:
                n += bool(chunk.choices and chunk.choices[0].delta.content)
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            return n, finish

        streams = [asyncio.create_task(stream()) for _ in range(8)]
        rt2 = live.node.registry.runtimes["m"][v2]
        while len(rt2.scheduler.running) < 8:
            await asyncio.sleep(0.01)
        r = await h.post(f"/admin/models/m/versions/{v2[:12]}/drain", json={"timeout_s": 1})
        assert r.status_code == 409  # still in the split: move its traffic first
        assert (await h.put("/admin/models/m/split", json={"weights": {v1: 1}})).status_code == 200
        drain = asyncio.create_task(h.post(f"/admin/models/m/versions/{v2[:12]}/drain", json={"timeout_s": 30}))
        await asyncio.sleep(0.05)
        assert (await ask(c, "new"))[0] == v1  # new requests go elsewhere while it drains
        with pytest.raises(openai.NotFoundError):
            await ask(c, None, model=f"m@{v2[:12]}")  # and it takes no pinned ones either
        r = await drain
        assert r.status_code == 200 and r.json() == {"version": v2, "in_flight": 0, "drained": True}
        assert [await s for s in streams] == [(100, "length")] * 8  # every live stream finished whole
        r = await h.delete(f"/admin/models/m/versions/{v2[:12]}", params={"timeout_s": 5})
        assert r.status_code == 200
        assert [v["version"] for v in (await h.get("/admin/models/m")).json()["versions"]] == [v1]
        r = await h.delete(f"/admin/models/m/versions/{v1[:12]}")
        assert r.status_code == 409 and "configured" in r.json()["error"]["message"]
        assert (await httpx.AsyncClient(base_url=live.url).get("/admin/models/m")).status_code == 401


async def test_a_version_whose_weights_do_not_match_its_hash_refuses_to_load(make_server, tmp_path: Path,
                                                                             store) -> None:
    ws, (v1, v2) = store
    live = await make_server(toml(tmp_path, v1), ws)
    (ws.resolve("tiny", v2).path / "model.safetensors").write_bytes(b"tampered")
    async with admin(live) as h:
        r = await h.post("/admin/models/m/versions", json={"version": v2[:12]})
        assert r.status_code == 400 and "cannot load" in r.json()["error"]["message"]
        assert [v["version"] for v in (await h.get("/admin/models/m")).json()["versions"]] == [v1]
        r = await h.put("/admin/models/m/split", json={"weights": {v2[:12]: 1}})
        assert r.status_code == 404
        r = await h.post("/admin/models/m/versions", json={"version": "0000dead"})
        assert r.status_code == 400


async def test_standby_sleeps_where_the_engine_can_and_wakes_on_promotion(make_server, tmp_path: Path,
                                                                          store) -> None:
    """On a GPU a standby version sleeps (vLLM's sleep mode frees its memory); the fake engine
    plays one with `sleep_mode`. Asleep it takes no pinned requests; put into the split it
    wakes up before any request reaches it; drained, it sleeps again."""
    ws, (v1, v2) = store
    live = await make_server(toml(tmp_path, v1).replace("max_num_seqs = 64", "max_num_seqs = 64\nsleep_mode = true"),
                             ws)
    c = client(live)
    async with admin(live) as h:
        r = await h.post("/admin/models/m/versions", json={"version": v2})
        assert r.status_code == 200
        assert {v["version"]: v["asleep"] for v in r.json()["versions"]} == {v1: False, v2: True}
        eng2 = live.node.registry.runtimes["m"][v2].backend
        assert eng2.sleeping
        with pytest.raises(openai.NotFoundError):
            await ask(c, None, model=f"m@{v2[:12]}")
        assert (await h.put("/admin/models/m/split", json={"weights": {v2: 1}})).status_code == 200
        assert not eng2.sleeping and (await ask(c, "x"))[0] == v2
        assert (await h.put("/admin/models/m/split", json={"weights": {v1: 1}})).status_code == 200
        r = await h.post(f"/admin/models/m/versions/{v2[:12]}/drain", json={"timeout_s": 5})
        assert r.json()["drained"] and eng2.sleeping
        assert (await h.get("/admin/models/m")).json()["versions"][1]["asleep"]


async def test_malformed_admin_requests_get_clear_errors(make_server, tmp_path: Path, store) -> None:
    ws, (v1, v2) = store
    live = await make_server(toml(tmp_path, v1), ws)
    async with admin(live) as h:
        cases = [
            (h.post("/admin/models/m/versions", content=b"{not json", headers={"content-type": "application/json"}),
             400, "invalid_json"),
            (h.post("/admin/models/m/versions", json={}), 400, None),
            (h.post("/admin/models/m/versions", json={"version": v2, "cpu_threads_bind": 3}), 400, None),
            (h.put("/admin/models/m/split", json={"weights": []}), 400, None),
            (h.put("/admin/models/m/split", json={"weights": {v1: {}}}), 400, None),  # was a 500 (fuzzing)
            (h.put("/admin/models/m/split", content=f'{{"weights": {{"{v1}": Infinity}}}}',
                   headers={"content-type": "application/json"}), 400, None),
            (h.put("/admin/models/m/split", json={"weights": {v1: -1}}), 400, "registry_error"),
            (h.put("/admin/models/m/split", json={"weights": {"ffff": 1}}), 404, "registry_error"),
            (h.post("/admin/models/m/rollback"), 409, "registry_error"),  # only one split so far
            (h.post(f"/admin/models/m/versions/{v1[:12]}/drain", json={"timeout_s": "soon"}), 400, None),
            (h.post(f"/admin/models/m/versions/{v1[:12]}/drain", json={"timeout_s": 1}), 409, "registry_error"),
            (h.get("/admin/models/nope"), 404, "registry_error"),
        ]
        for call, status, code in cases:
            r = await call
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["message"] and err["type"] and (code is None or err["code"] == code), r.text


async def test_loading_another_spelling_of_the_loaded_version_keeps_the_running_engine(make_server) -> None:
    """A version that resolves to the one already loaded (the fake engine without a source has
    one fixed version, whatever is asked) keeps that runtime: replacing it would leave its engine
    and scheduler running with nothing to stop them (found by fuzzing the admin routes)."""
    live = await make_server(f"""
[auth]
admin_keys = ["{hash_key(ADMIN)}"]
[[models]]
name = "fake"
backend = "fake"
""")
    before = live.runtime("fake")
    async with admin(live) as h:
        r = await h.post("/admin/models/fake/versions", json={"version": "anything", "warm": False})
    assert r.status_code == 200 and r.json()["loaded"] == before.version, r.text
    assert [v["version"] for v in r.json()["versions"]] == [before.version]
    assert live.node.registry.runtimes["fake"][before.version] is before
