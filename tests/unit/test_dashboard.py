"""The dashboard's JSON over real HTTP (fake backend, the official openai SDK as the client):
who may read it (admin or dashboard key, a session cookie; a tenant key is a 403, no key a 401),
the shapes the page reads, the request inspector (live and finished, by our id or the client's),
and the ring of 2-second samples behind the charts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from bench.lib.servers import keys_toml
from llmd.config.slo import SLOConfig
from llmd.dashboard.ring import INTERVAL_S, MAX_SAMPLES, Ring, quantile
from llmd.dashboard.session import COOKIE, Sessions
from tests.conftest import LiveServer, async_wait_until

ADMIN, VIEWER, KEY_A, KEY_B = "sk-llmd-dash-admin", "sk-llmd-dash-viewer", "sk-llmd-dash-a", "sk-llmd-dash-b"
TOML = """
[server]
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 2
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 3.0
[cost.models.fake]
gpu_hour_price = 2.0
""" + keys_toml({"a": KEY_A, "b": KEY_B}, admin=ADMIN, dashboard=VIEWER)
OVERVIEW, REQUESTS = "/dashboard/api/overview", "/dashboard/api/requests/"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def advance(live: LiveServer, seconds: float) -> None:
    """Move the dashboard's clock on, so the current 2-s interval closes without waiting for it."""
    ring = live.node.dashboard.ring
    clock = ring.clock
    ring.clock = lambda: clock() + seconds


async def burst(live: LiveServer, n: int = 6) -> list[str]:
    """n chats per tenant with the openai SDK, each with its own X-Request-ID; returns those ids."""
    ids = []
    for key, tenant in ((KEY_A, "a"), (KEY_B, "b")):
        async with openai.AsyncOpenAI(base_url=live.base, api_key=key) as client:
            for i in range(n):
                rid = f"dash-{tenant}-{i}"
                r = await client.chat.completions.create(
                    model="fake", max_tokens=8, extra_headers={"X-Request-ID": rid},
                    messages=[{"role": "user", "content": f"hello {i}"}])
                assert r.choices[0].message.content
                ids.append(rid)
    return ids


@pytest.fixture
async def live(make_server: Any) -> LiveServer:
    return await make_server(TOML)


def _openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] and err["message"]


async def test_only_admin_and_dashboard_keys_read_it(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
        _openai_error(await c.get(OVERVIEW), 401, "missing_api_key")
        _openai_error(await c.get(OVERVIEW, headers=bearer("sk-llmd-nobody")), 401, "invalid_api_key")
        _openai_error(await c.get(OVERVIEW, headers=bearer(KEY_A)), 403, "dashboard_key_required")
        _openai_error(await c.get(REQUESTS + "x", headers=bearer(KEY_B)), 403, "dashboard_key_required")
        _openai_error(await c.get(REQUESTS + "x"), 401, "missing_api_key")
        for key in (ADMIN, VIEWER):
            assert (await c.get(OVERVIEW, headers=bearer(key))).status_code == 200
        # A dashboard key opens only the dashboard: no admin view, no generation.
        assert (await c.get("/admin/engines", headers=bearer(VIEWER))).status_code == 401
        assert (await c.post("/v1/chat/completions", headers=bearer(VIEWER), json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}]})).status_code == 401
        page = await c.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"] and "uPlot" in page.text
        js = await c.get("/dashboard/static/vendor/uPlot.iife.min.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert js.text.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32)")
        _openai_error(await c.get("/dashboard/static/%2E%2E/ring.py"), 404, "file_not_found")  # only shipped files
        _openai_error(await c.get("/dashboard/static/nope.js"), 404, "file_not_found")


async def test_login_gives_a_signed_httponly_strict_cookie(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
        _openai_error(await c.post("/dashboard/login", json={"key": KEY_A}), 403, "dashboard_key_required")
        _openai_error(await c.post("/dashboard/login", json={"key": "sk-llmd-nobody"}), 401, "invalid_api_key")
        _openai_error(await c.post("/dashboard/login", json={"nope": 1}), 400, None)  # type: ignore[arg-type]
        # A form post (what a cross-site page could send without asking) is refused before the handler.
        assert (await c.post("/dashboard/login", data={"key": VIEWER})).status_code == 415
        assert c.cookies.get(COOKIE) is None
        assert (await c.get("/dashboard/session")).json() == {"ok": False, "open": False}
        r = await c.post("/dashboard/login", json={"key": VIEWER})
        assert r.status_code == 200
        header = r.headers["set-cookie"].lower()
        assert "httponly" in header and "samesite=strict" in header and "path=/dashboard" in header
        assert (await c.get(OVERVIEW)).status_code == 200  # the cookie alone
        assert (await c.get("/dashboard/session")).json() == {"ok": True, "open": False}
        good = c.cookies.get(COOKIE)
        assert good is not None
        tampered = good[:-1] + ("0" if good[-1] != "0" else "1")
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as other:
            assert (await other.get(OVERVIEW, headers={"Cookie": f"{COOKIE}={good}"})).status_code == 200
            _openai_error(await other.get(OVERVIEW, headers={"Cookie": f"{COOKIE}={tampered}"}), 401, "missing_api_key")
        await c.post("/dashboard/logout")
        assert (await c.get(OVERVIEW)).status_code == 401


def test_a_session_names_its_key_and_expires() -> None:
    s = Sessions()
    cookie = s.issue("abc123", now=1000.0)
    assert s.verify(cookie, now=1001.0) == "abc123"
    assert s.verify(cookie, now=1000.0 + 13 * 3600) is None
    assert Sessions().verify(cookie, now=1001.0) is None  # another process's secret
    assert s.verify("abc123.99999999999.00", now=1.0) is None
    assert s.verify(None) is None and s.verify("a.b") is None


async def test_overview_after_a_burst(live: LiveServer) -> None:
    await burst(live)
    advance(live, INTERVAL_S)
    async with httpx.AsyncClient(base_url=live.url, timeout=30, headers=bearer(VIEWER)) as c:
        d = (await c.get(OVERVIEW)).json()
        assert d["interval_s"] == INTERVAL_S and d["points"]
        pts = d["points"]  # the burst may straddle an interval's end: count over all of them
        assert sum(p["rps"] for p in pts) * INTERVAL_S == 12
        assert sum(p["output_tps"] for p in pts) * INTERVAL_S == 12 * 8 and all(p["prompt_tps"] >= 0 for p in pts)
        p = next(p for p in pts if p["rps"])
        assert p["ttft"]["fake"][0] is not None and p["ttft"]["fake"][1] >= p["ttft"]["fake"][0]
        assert p["itl"]["fake"][1] is not None
        g = pts[-1]["models"]["fake"]
        assert set(g["queue"]) == {"interactive", "batch"} and g["seat_limit"] > 0 and 0 <= g["kv"] <= 1
        m = d["models"]["fake"]
        assert m["ready"] and m["engine"] == "up"
        assert m["slo"] == SLOConfig().slo_for("fake").model_dump()  # [slo]'s defaults: this config sets none
        assert [v["weight"] for v in m["versions"]] == [1.0]
        assert {(r["model"], r["tenant"]) for r in d["latency"]} == {("fake", "a"), ("fake", "b")}
        assert all(r["ttft_p95"] >= r["ttft_p50"] > 0 for r in d["latency"])
        # Spend per tenant today: what the ledger billed.
        await live.node.ledger.flush()
        billed = {r["tenant"]: r["cost"] for r in await live.node.ledger.usage(None, None, None, ["tenant"])}
        assert d["spend_today"] == pytest.approx(billed) and all(v > 0 for v in billed.values())
        assert d["prices"]["fake"]["per_mtok_output"] is not None and d["cluster"] is None
        # the GPU-hour cost panel: the last 24 h of this node's ledger and engine uptime (llmd/cost/)
        cost = d["cost"]
        assert cost["object"] == "cost_summary" and [m["model"] for m in cost["models"]] == ["fake"]
        assert cost["models"][0]["total"]["output_tokens"] == 12 * 8
        assert d["statuses"] == {"ok": 12} and d["in_flight"] == 0 and d["batches"] == []
        assert {r["client_request_id"] for r in d["recent"]} >= {"dash-a-0", "dash-b-5"}
        # A poller asks only for what is new.
        assert (await c.get(OVERVIEW, params={"since": d["points"][-1]["t"]})).json()["points"] == []
        _openai_error(await c.get(OVERVIEW, params={"since": "yesterday"}), 400, None)  # type: ignore[arg-type]


async def test_spend_today_is_seeded_from_the_ledger(make_server: Any, tmp_path: Any) -> None:
    db = tmp_path / "seed.db"
    toml = TOML.replace("[server]\n", f'[server]\ndb_path = "{db}"\n')
    first = await make_server(toml)
    await burst(first, 2)
    await first.stop()
    again = await make_server(toml)
    await again.node.ledger.flush()
    billed = {r["tenant"]: r["cost"] for r in await again.node.ledger.usage(None, None, None, ["tenant"])}
    assert again.node.dashboard.ring.spend == pytest.approx(billed) and billed


async def test_inspector_finds_finished_requests_by_either_id(live: LiveServer, records: list[dict]) -> None:
    await burst(live, 2)
    ours = next(r["request_id"] for r in records if r["client_request_id"] == "dash-b-1")
    async with httpx.AsyncClient(base_url=live.url, timeout=30, headers=bearer(ADMIN)) as c:
        for rid in ("dash-b-1", ours):
            d = (await c.get(REQUESTS + rid)).json()
            assert d["request_id"] == ours and d["client_request_id"] == "dash-b-1" and not d["live"]
            assert d["status"] == "ok" and d["http_status"] == 200 and d["tenant"] == "b"
            stages = [s["stage"] for s in d["stages"]]
            assert stages == ["arrived", "dispatched", "first_token", "last_token", "ended"]
            at = [s["at_s"] for s in d["stages"]]
            assert at == sorted(at)
            assert d["replica"].startswith(live.node.config.server.node + "/fake@")
            assert d["output_tokens"] == 8 and d["itl_p95_s"] is not None and d["cost"] > 0
            assert d["endpoint"] == "/v1/chat/completions" and d["stream"] is False
        _openai_error(await c.get(REQUESTS + "req-does-not-exist"), 404, "request_not_found")
        _openai_error(await c.get(REQUESTS + "x" * 500), 404, "request_not_found")


async def test_inspector_shows_a_request_in_flight(make_server: Any) -> None:
    live = await make_server(TOML.replace("step_ms = 2", "step_ms = 50"))
    async with openai.AsyncOpenAI(base_url=live.base, api_key=KEY_A) as client:
        stream = await client.chat.completions.create(
            model="fake", max_tokens=200, stream=True, extra_headers={"X-Request-ID": "slow-one"},
            messages=[{"role": "user", "content": "go on"}])
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        async with httpx.AsyncClient(base_url=live.url, timeout=30, headers=bearer(VIEWER)) as c:
            d = (await c.get(REQUESTS + "slow-one")).json()
            assert d["live"] and d["status"] == "running" and d["tenant"] == "a"
            assert [s["stage"] for s in d["stages"]][:3] == ["arrived", "dispatched", "first_token"]
            assert d["stages"][-1]["stage"] == "running"
        await stream.close()
    assert await async_wait_until(lambda: not live.node.lifecycle.in_flight)


async def test_open_mode_is_the_loopback_users(make_server: Any) -> None:
    live = await make_server('[[models]]\nname = "fake"\nbackend = "fake"\n')
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
        assert (await c.get(OVERVIEW)).status_code == 200
        assert (await c.get(OVERVIEW, headers={"Origin": "https://evil.example"})).status_code == 403


def test_ring_closes_intervals_caps_samples_and_resets_spend_daily() -> None:
    now = [86400.0 * 10 + 1.0]
    gauges = {"m": {"queue": {"interactive": 2}, "running": 1, "seat_limit": 4, "kv_usage": 0.5,
                    "prefix_queries": 10, "prefix_hits": 5, "preemptions": 1}}
    ring = Ring(lambda: now[0], lambda: {k: dict(v) for k, v in gauges.items()})
    ring.seed({"a": 1.5})
    ring.observe({"model": "m", "tenant": "a", "status": "ok", "ttft_s": 0.1, "itl_samples": [0.01] * 5000,
                  "output_tokens": 10, "prompt_tokens": 4, "cost": 0.5, "ts": now[0]})
    ring.observe({"model": "m", "tenant": "a", "status": "shed", "decision": "shed:overload", "ts": now[0]})
    ring.observe({"model": "m", "tenant": "b", "status": "filtered", "filter": "pii/email", "ts": now[0]})
    assert len(ring.cur.itl[("m", "a")]) == MAX_SAMPLES
    assert not ring.tick() and not ring.points
    now[0] += INTERVAL_S
    gauges["m"] |= {"prefix_queries": 20, "prefix_hits": 14, "preemptions": 3}
    assert ring.tick()
    p = ring.points[-1]
    assert p["rps"] == 3 / INTERVAL_S and p["shed"] == 1 and p["filtered"] == 1 and p["errors"] == 2
    assert p["models"]["m"]["prefix_hit"] is None  # no earlier sample to take a difference from
    now[0] += INTERVAL_S
    gauges["m"] |= {"prefix_queries": 30, "prefix_hits": 19, "preemptions": 7}
    ring.tick()
    m = ring.points[-1]["models"]["m"]
    assert m["prefix_hit"] == 0.5 and m["preempted"] == 4 and ring.points[-1]["rps"] == 0
    assert ring.shed == {"overload": 1} and ring.filtered == {"pii/email": 1} and ring.spend == {"a": 2.0}
    assert ring.table[0]["ttft_p50"] == 0.1 and ring.since(ring.points[-1]["t"]) == []
    now[0] = 86400.0 * 11 + 0.5  # the next UTC day
    ring.tick()
    assert ring.spend == {}
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and quantile([], 0.9) is None


async def test_polls_between_closes_do_no_work_per_viewer(live: LiveServer) -> None:
    """Five viewers polling within one interval read the same closed points: the gauges are
    sampled once per interval, not once per poll."""
    await burst(live, 1)
    calls = []
    ring = live.node.dashboard.ring
    inner = ring.gauges
    ring.gauges = lambda: calls.append(1) or inner()
    advance(live, INTERVAL_S)
    async with httpx.AsyncClient(base_url=live.url, timeout=30, headers=bearer(VIEWER)) as c:
        answers = await asyncio.gather(*(c.get(OVERVIEW) for _ in range(5)))
    assert all(a.status_code == 200 for a in answers) and len(calls) == 1
    assert len({len(a.json()["points"]) for a in answers}) == 1
    assert time.time() > 0


async def test_cluster_members_and_the_node_that_ran_a_request(make_server: Any, tmp_path: Any) -> None:
    from tests.unit.test_cluster import ADMIN as CLUSTER_ADMIN
    from tests.unit.test_cluster import KEY as CLUSTER_KEY
    from tests.unit.test_cluster import start_cluster

    a, _ = await start_cluster(make_server, tmp_path, n=2)
    a.node.cluster.draining = True  # its requests run on the other node
    await asyncio.sleep(0.6)  # the peer hears it
    async with openai.AsyncOpenAI(base_url=a.base, api_key=CLUSTER_KEY, max_retries=0) as client:
        await client.chat.completions.create(model="fake", max_tokens=4, extra_headers={"X-Request-ID": "far"},
                                             messages=[{"role": "user", "content": "run me elsewhere"}])
    async with httpx.AsyncClient(base_url=a.url, timeout=30, headers=bearer(CLUSTER_ADMIN)) as c:
        cl = (await c.get(OVERVIEW)).json()["cluster"]
        assert cl["node"] == "n0" and cl["draining"] is True
        members = {m["name"]: m for m in cl["members"]}
        assert set(members) == {"n0", "n1"} and members["n1"]["state"] == "alive"
        assert [v["model"] for v in members["n1"]["versions"]] == ["fake"]
        d = (await c.get(REQUESTS + "far")).json()
        assert d["replica"].startswith("n1/fake@") and d["status"] == "ok"


def test_a_finished_requests_events_are_in_its_timeline() -> None:
    from llmd.dashboard.timeline import from_row

    d = from_row({"request_id": "req-1", "queue_s": 0.01, "ttft_s": 0.05, "last_token_s": 0.9, "total_s": 0.91,
                  "marks": "preempted@0.3,failover:n2@0.4,resumed@0.45,bad", "stream": 1})
    assert [(s["stage"], s["at_s"]) for s in d["stages"]] == [
        ("arrived", 0.0), ("dispatched", 0.01), ("first_token", 0.05), ("preempted", 0.3), ("failover", 0.4),
        ("resumed", 0.45), ("last_token", 0.9), ("ended", 0.91)]
    assert d["stages"][4]["detail"] == "n2" and d["stream"] is True and not d["live"]
