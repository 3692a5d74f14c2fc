"""Serving cost: GPU-hours x [cost] prices, split between the versions loaded side by side, over
the tokens served. A real llmd (fake engines over two stored versions) serves real requests
(openai SDK) into a real SQLite file; `llmd usage --cost` and GET /admin/cost over that file
are checked against figures computed by hand from its rows."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from bench.lib.servers import keys_toml, tiny_versions
from llmd.cli import main as cli_main
from llmd.config import ConfigError, load_config
from llmd.cost.params import parse_bucket, parse_time
from llmd.cost.split import Uptime, served, spread
from llmd.store import WeightStore

KEY_A, KEY_B, ADMIN = "sk-llmd-cost-a", "sk-llmd-cost-b", "sk-llmd-cost-admin"
PRICE, GPUS = 3.6, 2.0
TOML = f"""
[server]
default_deadline_s = 30
db_path = "{{db}}"
[[models]]
name = "m"
source = "tiny"
version = "{{version}}"
backend = "fake"
max_output_tokens = 100
default_max_tokens = 16
[models.fake]
step_ms = 1
step_ms_per_seq = 0.0
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 4.0
[cost]
currency = "EUR"
sample_s = 0.2
[cost.models.m]
gpu_hour_price = {PRICE}
gpus = {GPUS}
""" + keys_toml({"a": KEY_A, "b": KEY_B}, admin=ADMIN)


# -- the rule, on numbers small enough to check by eye ---------------------------------------
def test_versions_side_by_side_split_the_gpus_equally() -> None:
    ups = [Uptime("n1", "m", "v1", 0, 7200), Uptime("n1", "m", "v2", 1800, 5400),
           Uptime("n2", "m", "v1", 3600, 7200)]  # another node: its own GPUs, its own cost
    got = {k: (round(s.share_s, 6), round(s.loaded_s, 6)) for k, s in served(ups, 0, 7200, 3600).items()}
    assert got == {("m", "v1", 0.0): (1800 + 900, 3600), ("m", "v2", 0.0): (900, 1800),
                   ("m", "v1", 3600.0): (900 + 1800 + 3600, 3600 + 3600), ("m", "v2", 3600.0): (900, 1800)}
    # A window that cuts stretches counts only what lies inside it.
    inner = served(ups, 3000, 4000, 3600)
    assert inner[("m", "v1", 0.0)].share_s == pytest.approx(600 / 2) and inner[("m", "v1", 3600.0)].share_s == 200 + 400
    assert spread([("m", "v1", 3500, 3700), ("m", "v1", 3800, 3900)], 0, 7200, 3600) == {
        ("m", "v1", 0.0): 100, ("m", "v1", 3600.0): 200}


def test_params_and_config_errors_name_the_key(tmp_path: Path) -> None:
    assert parse_bucket("15m") == 900 and parse_bucket("1d") == 86400 and parse_bucket("120") == 120
    assert parse_time("2026-12-01", end_of_day=True) - parse_time("2026-12-01") == 86400
    for bad in ("1w", "10", "-1h", "nan"):
        with pytest.raises(ValueError, match="bucket"):
            parse_bucket(bad)
    with pytest.raises(ValueError, match="unix time"):
        parse_time("inf")
    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nbackend = "fake"\n[cost.models.x]\ngpu_hour_price = 1\n')
    with pytest.raises(ConfigError, match=r"cost\.models\.x: 'x' is not a configured model"):
        load_config(p)
    p.write_text('[[models]]\nname = "m"\nbackend = "fake"\n[cost.models.m]\ngpu_hour_price = -1\n')
    with pytest.raises(ConfigError, match=r"cost\.models\.m\.gpu_hour_price: Input should be greater than or equal"):
        load_config(p)


# -- end to end --------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path: Path, smollm2_path: Path) -> tuple[WeightStore, list[str]]:
    """Two stored versions of a tiny model (SmolLM2's tokenizer, different weight bytes)."""
    return tiny_versions(tmp_path / "home", (b"weights one", b"weights two"))


def by_hand(db: Path, v1: str, v2: str) -> dict[str, dict[str, float]]:
    """Each version's GPU-hours, cost and tokens from the rows, the rule spelled out: v1 alone
    until v2's engine came up, then both on the model's GPUs (half each) until the node stopped."""
    conn = sqlite3.connect(db.with_suffix(".uptime.db"))
    (s1, e1), = conn.execute("SELECT t_start, t_end FROM engine_uptime WHERE version = ?", (v1,))
    (s2, e2), = conn.execute("SELECT t_start, t_end FROM engine_uptime WHERE version = ?", (v2,))
    assert s1 < s2 < e2 <= e1  # v2 loaded later; both stopped at the node's last sample
    share = {v1: (s2 - s1) + (e2 - s2) / 2 + (e1 - e2), v2: (e2 - s2) / 2}
    conn = sqlite3.connect(db)
    out = {}
    for v in (v1, v2):
        prompt, output = conn.execute(
            "SELECT SUM(CASE WHEN t_first_token IS NOT NULL THEN prompt_tokens ELSE 0 END), SUM(output_tokens) "
            "FROM usage WHERE version = ?", (v,)).fetchone()
        gpu_h = share[v] / 3600 * GPUS
        out[v] = {"gpu_hours": gpu_h, "cost": gpu_h * PRICE, "output_tokens": output, "total_tokens": prompt + output,
                  "cost_per_m_output": gpu_h * PRICE / output * 1e6,
                  "cost_per_m_total": gpu_h * PRICE / (prompt + output) * 1e6}
    return out


async def ask(c: openai.AsyncOpenAI, model: str, n: int) -> Any:
    return await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=n)


async def serve_some(live: Any, v1: str, v2: str) -> None:
    """v1 alone serves a few; v2 loads beside it; both serve pinned requests; one refusal."""
    a = openai.AsyncOpenAI(base_url=live.base, api_key=KEY_A, max_retries=0, timeout=120)
    b = openai.AsyncOpenAI(base_url=live.base, api_key=KEY_B, max_retries=0, timeout=120)
    await asyncio.gather(*(ask(a, "m", 5) for _ in range(3)))
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as h:
        assert (await h.post("/admin/models/m/versions", json={"version": v2})).status_code == 200
    await asyncio.gather(*(ask(b, f"m@{v2[:12]}", 7) for _ in range(6)), *(ask(a, f"m@{v1[:12]}", 3) for _ in range(2)))
    with pytest.raises(openai.BadRequestError):  # refused before the engine: its prompt is not a token served
        await ask(b, f"m@{v2[:12]}", 1000)
    await asyncio.sleep(0.5)


async def test_usage_cost_matches_the_rows(make_server, tmp_path: Path, store) -> None:
    ws, (v1, v2) = store
    db = tmp_path / "llmd.db"
    cfg_file = tmp_path / "llmd.toml"
    cfg_file.write_text(TOML.format(db=db, version=v1[:12]))
    live = await make_server(cfg_file.read_text(), ws)
    await serve_some(live, v1, v2)
    await live.stop()  # its last sample: both engines' uptime up to the stop
    want = by_hand(db, v1, v2)
    res = CliRunner().invoke(cli_main, ["usage", "--cost", "--json", "--config", str(cfg_file), "--bucket", "1m"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["currency"] == "EUR" and [m["version"] for m in got["models"]] == sorted([v1, v2])
    for m in got["models"]:
        total = m["total"]
        for k, v in want[m["version"]].items():
            assert total[k] == pytest.approx(v, rel=1e-6), (m["version"], k)
        assert sum(b["cost"] for b in m["buckets"]) == pytest.approx(total["cost"])
        assert 0 < total["busy_fraction"] < 1 and 0 < total["idle_cost"] < total["cost"]
    assert got["total"]["cost"] == pytest.approx(sum(w["cost"] for w in want.values()))
    conn = sqlite3.connect(db)
    spend = dict(conn.execute("SELECT tenant, SUM(cost) FROM usage GROUP BY tenant").fetchall())
    assert {t["tenant"]: t["spend"] for t in got["tenants_today"]} == pytest.approx(spend)
    # The table: a TOTAL line per version with the same figures.
    res = CliRunner().invoke(cli_main, ["usage", "--cost", "--config", str(cfg_file), "--bucket", "1h"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("m ") and v2[:12] in x and "TOTAL" in x)
    w = want[v2]
    assert line.split()[-7:] == [f"{w['gpu_hours']:.4f}", f"{w['cost']:.4f}", str(w["output_tokens"]),
                                 str(w["total_tokens"]), f"{w['cost_per_m_output']:.2f}",
                                 f"{w['cost_per_m_total']:.2f}", line.split()[-1]]
    assert "COST (EUR)" in res.output


async def test_admin_cost_endpoint(make_server, tmp_path: Path, store) -> None:
    ws, (v1, v2) = store
    live = await make_server(TOML.format(db=tmp_path / "llmd.db", version=v1[:12]), ws)
    await serve_some(live, v1, v2)
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as h:
        adm = {"Authorization": f"Bearer {ADMIN}"}
        r = await h.get("/admin/cost", params={"bucket": "1m"}, headers=adm)
        assert r.status_code == 200, r.text
        body = r.json()
        costs = {m["version"]: m["total"] for m in body["models"]}
        # Live: the engines' uptime runs up to the request, past the last sample.
        assert costs[v1]["gpu_hours"] > costs[v2]["gpu_hours"] > 0
        assert costs[v2]["output_tokens"] == 6 * 7 and costs[v1]["output_tokens"] == 3 * 5 + 2 * 3
        # Viewers polling at once share an answer for a few seconds, unless they ask for a fresh one.
        again = (await h.get("/admin/cost", params={"bucket": "1m"}, headers=adm)).json()
        assert again["now"] == body["now"] or again["now"] - body["now"] >= 5
        fresh = (await h.get("/admin/cost", params={"bucket": "1m"}, headers=adm | {"Cache-Control": "no-cache"}))
        assert fresh.json()["now"] > body["now"]
        r = await h.get("/admin/cost", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        for params, param in (({"bucket": "fortnight"}, "bucket"), ({"since": "yesterday"}, "since"),
                              ({"since": "2026-12-02", "until": "2026-11-30"}, "since"),
                              ({"bucket": "60", "since": "2000-01-01"}, "bucket")):
            r = await h.get("/admin/cost", params=params, headers=adm)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)


async def test_uptime_stretches_follow_the_loaded_engines(tmp_path: Path) -> None:
    from llmd.cost.uptime import EngineUptime, UptimeStore

    now, loaded = [100.0], [("m", "v1")]
    up = EngineUptime(UptimeStore(tmp_path / "u.db"), "n1", lambda: list(loaded), 60, clock=lambda: now[0])
    await up.start()
    await up.tick()
    now[0], loaded[:] = 160.0, [("m", "v1"), ("m", "v2")]
    await up.tick()
    assert [(u.version, u.start, u.end) for u in up.live()] == [("v1", 100.0, 160.0), ("v2", 160.0, 160.0)]
    now[0], loaded[:] = 220.0, [("m", "v2")]  # v1 unloaded: its stretch ends at its last sample
    await up.tick()
    now[0], loaded[:] = 280.0, [("m", "v1"), ("m", "v2")]  # loaded again: a new stretch
    await up.tick()
    now[0] = 300.0
    await up.stop()  # the stop samples once more
    rows = sqlite3.connect(tmp_path / "u.db").execute(
        "SELECT version, t_start, t_end FROM engine_uptime ORDER BY version, t_start").fetchall()
    assert rows == [("v1", 100.0, 160.0), ("v1", 280.0, 300.0), ("v2", 160.0, 300.0)]


def test_settled_buckets_are_kept_and_give_the_same_figures(tmp_path: Path) -> None:
    from llmd.config.cost import CostConfig, ModelCost
    from llmd.cost.report import cost_summary
    from llmd.cost.settled import Settled
    from llmd.cost.uptime import SCHEMA
    from llmd.ledger_schema import MIGRATIONS

    db, now = tmp_path / "llmd.db", 1_796_000_000.0
    conn = sqlite3.connect(db)
    for m in MIGRATIONS:
        conn.executescript(m)
    rows = [(f"r{i}", "ab"[i % 2], "m", "v1", "ok", 10, 0, 5, 0.01, now - 60 * i, now - 60 * i + 1, now - 60 * i + 90)
            for i in range(1, 12 * 60)]  # one request a minute for 12 hours, each 90 s long
    conn.executemany("INSERT INTO usage (request_id, tenant, model, version, status, prompt_tokens, cached_tokens, "
                     "output_tokens, cost, t_arrival, t_first_token, t_end) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.commit()
    up = sqlite3.connect(tmp_path / "llmd.uptime.db")
    up.executescript(SCHEMA)
    up.execute("INSERT INTO engine_uptime VALUES ('n', 'm', 'v1', ?, ?)", (now - 86400, now))
    up.commit()
    cfg = CostConfig(models={"m": ModelCost(gpu_hour_price=2.0)})
    fresh = cost_summary(db, cfg, now - 86400, now, 3600, now, reach_s=660)
    settled = Settled()
    first = cost_summary(db, cfg, now - 86400, now, 3600, now, reach_s=660, settled=settled)
    conn.execute("UPDATE usage SET output_tokens = 1000 WHERE t_arrival < ?", (now - 7200,))  # old rows: not read again
    conn.commit()
    again = cost_summary(db, cfg, now - 86400, now, 3600, now, reach_s=660, settled=settled)
    assert fresh == first == again
    t = fresh["models"][0]["total"]
    assert t["requests"] == 12 * 60 - 1 and t["output_tokens"] == 5 * t["requests"]
    # Back to back, one busy stretch: from the first arrival to the window's end (the last request ends after it).
    assert t["busy_fraction"] == pytest.approx((12 * 3600 - 60) / 86400)
    assert t["cost"] == pytest.approx(48.0)
