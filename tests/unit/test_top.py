"""`llmd top`: the numbers of a frame, from two polls of a real llmd (fake backend) around a
burst of real requests (openai SDK), held against the node's own state; `--once` prints them."""

from __future__ import annotations

import asyncio
import math
import sqlite3
from bisect import bisect_left
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner

from bench.lib.servers import keys_toml
from llmd.api_client import Api
from llmd.cli import main as cli_main
from llmd.metrics import TTFT_BUCKETS
from llmd.top.fetch import Poller
from llmd.top.frame import compute
from llmd.top.scrape import Scrape, quantile

KEY_A, KEY_B, KEY_C, ADMIN = "sk-llmd-top-a", "sk-llmd-top-b", "sk-llmd-top-c", "sk-llmd-top-admin"
TOML = """
[server]
default_deadline_s = 30
db_path = "{db}"
[[models]]
name = "fake"
backend = "fake"
default_max_tokens = 16
[models.fake]
step_ms = 2
step_ms_per_seq = 0.0
max_num_seqs = 8
[models.pricing]
input_per_mtok = 2.0
output_per_mtok = 10.0
[cost]
[cost.models.fake]
gpu_hour_price = 4.0
""" + keys_toml({"a": KEY_A, "b": KEY_B}, admin=ADMIN) + keys_toml({"c": KEY_C}, requests_per_minute=1)


def test_quantile_is_prometheus_histogram_quantile() -> None:
    text = "\n".join(["# TYPE h histogram", 'h_bucket{le="0.1"} 10', 'h_bucket{le="0.5"} 30', 'h_bucket{le="1.0"} 40',
                      'h_bucket{le="+Inf"} 40', "h_count 40", "h_sum 9"]) + "\n"
    b = Scrape.parse(text).buckets("h", ())[()]
    assert b == {0.1: 10, 0.5: 30, 1.0: 40, math.inf: 40}
    assert quantile(0.5, b) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)  # rank 20 in (0.1, 0.5]
    assert quantile(0.95, b) == pytest.approx(0.5 + 0.5 * (38 - 30) / 10)
    assert quantile(0.5, {0.1: 0, math.inf: 0}) is None
    assert quantile(0.99, {0.1: 1, math.inf: 5}) == 0.1  # in +Inf: the largest finite bound


def expected_p(q: float, ttfts: list[float]) -> float | None:
    """The same quantile from the request records' own TTFTs, bucketed as /metrics buckets them."""
    counts = [0] * (len(TTFT_BUCKETS) + 1)
    for v in ttfts:
        counts[bisect_left(TTFT_BUCKETS, v)] += 1
    cum, b = 0, {}
    for le, n in zip([*TTFT_BUCKETS, math.inf], counts, strict=True):
        cum += n
        b[le] = cum
    return quantile(q, b)


async def burst(live: Any, n_a: int, n_b: int) -> None:
    a = openai.AsyncOpenAI(base_url=live.base, api_key=KEY_A, max_retries=0, timeout=120)
    b = openai.AsyncOpenAI(base_url=live.base, api_key=KEY_B, max_retries=0, timeout=120)
    await asyncio.gather(*(a.completions.create(model="fake", prompt="one two three", max_tokens=5)
                           for _ in range(n_a)),
                         *(b.completions.create(model="fake", prompt="four five", max_tokens=7) for _ in range(n_b)))


async def test_frame_matches_the_node(make_server, tmp_path: Path, records: list[dict[str, Any]]) -> None:
    live = await make_server(TOML.format(db=tmp_path / "llmd.db"))
    await burst(live, 4, 1)
    poller = Poller(Api(live.url, ADMIN, prefix=""), cost_every=1)
    before = await asyncio.to_thread(poller.poll)
    be, rt = live.backend(), live.runtime()
    q0, h0 = be.stats.prefix_queries, be.stats.prefix_hits
    seen = len(records)
    await burst(live, 3, 2)
    c = openai.AsyncOpenAI(base_url=live.base, api_key=KEY_C, max_retries=0, timeout=120)
    await c.completions.create(model="fake", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError):  # shed: over its requests per minute
        await c.completions.create(model="fake", prompt="x", max_tokens=1)
    after = await asyncio.to_thread(poller.poll)
    frame = compute(after, before)
    w = frame.window_s
    assert w is not None and w > 0
    (m,) = frame.models
    window = records[seen:]
    served = [r for r in window if r["model"] == "fake"]  # the shed one was refused before routing: no model
    assert m.model == "fake" and m.rps * w == pytest.approx(len(served)) and len(served) == 6
    assert m.out_tps * w == pytest.approx(3 * 5 + 2 * 7 + 1)
    assert m.in_tps * w == pytest.approx(sum(r["prompt_tokens"] for r in window if r["queue_time_s"] is not None))
    ttfts = [r["ttft_s"] for r in window if r["ttft_s"] is not None]
    assert m.ttft.p95 == pytest.approx(expected_p(0.95, ttfts)) and not m.ttft.since_start
    assert m.ttft.p50 == pytest.approx(expected_p(0.5, ttfts))
    assert m.itl.p95 is not None and m.itl.p50 <= m.itl.p95
    assert m.queued == {k: rt.queue.depth(k) for k in rt.queue.classes} == {"interactive": 0, "batch": 0}
    assert (m.running, m.seats) == (len(rt.scheduler.running), rt.scheduler.seat_limit) == (0, 8)
    assert m.kv == be.stats.kv_usage
    assert m.prefix_hit == pytest.approx((be.stats.prefix_hits - h0) / (be.stats.prefix_queries - q0))
    assert m.sheds == 0 and m.preemptions == be.stats.preemptions + rt.scheduler.preempted == 0
    tenants = {t.tenant: t for t in frame.tenants}
    assert tenants["a"].rps * w == pytest.approx(3) and tenants["b"].rps * w == pytest.approx(2)
    assert tenants["c"].rps * w == pytest.approx(2) and [t.sheds for t in frame.tenants] == [0, 0, 1]
    await live.node.ledger.flush()
    conn = sqlite3.connect(tmp_path / "llmd.db")
    spend = dict(conn.execute("SELECT tenant, SUM(cost) FROM usage GROUP BY tenant"))
    assert {t: r.spend_today for t, r in tenants.items()} == pytest.approx(spend)
    cost = after.cost["models"][0]["total"]
    assert m.cost_per_m_out == pytest.approx(cost["cost"] / cost["output_tokens"] * 1e6) and cost["cost"] > 0
    assert frame.members == [] and frame.currency == "USD"
    # The command: one frame over one interval, the same numbers.
    res = await asyncio.to_thread(CliRunner().invoke, cli_main,
                                  ["top", "--once", "--url", live.url, "--key", ADMIN, "--interval", "0.2"])
    assert res.exit_code == 0, res.output
    traffic, engine = [line.split() for line in res.output.splitlines() if line.strip().startswith("fake ")]
    assert engine[:4] == ["fake", "0", "0", "0/8"], engine  # queued per class, running/seats
    assert "INTER" in res.output and "BATCH" in res.output and len(traffic) == 6
    for t in ("a", "b", "c"):
        line = next(x for x in res.output.splitlines() if x.strip().startswith(f"{t} "))
        assert f"{spend[t]:.6f}" in line
    # A tenant key: /metrics is open here (no [auth] metrics_keys), the cost view is not.
    res = await asyncio.to_thread(CliRunner().invoke, cli_main, ["top", "--once", "--url", live.url, "--key", KEY_A,
                                                                 "--interval", "0.1"])
    assert res.exit_code == 0 and "SPEND TODAY (-)" in res.output, res.output
    res = await asyncio.to_thread(CliRunner().invoke, cli_main, ["top", "--once", "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 1 and "cannot reach the server" in res.output, res.output


async def test_cluster_members_are_shown(make_server, tmp_path: Path) -> None:
    from tests.unit.test_cluster import ADMIN as CLUSTER_ADMIN
    from tests.unit.test_cluster import start_cluster

    n0, n1 = await start_cluster(make_server, tmp_path, n=2)
    poller = Poller(Api(n0.url, CLUSTER_ADMIN, prefix=""))
    frame = compute(await asyncio.to_thread(poller.poll), None)
    members = n0.node.cluster.status()["members"]
    assert frame.node == "n0" and [(m["name"], m["state"]) for m in frame.members] == [("n1", "alive")]
    assert [m["url"] for m in frame.members] == [m["url"] for m in members] == [n1.url]
    res = await asyncio.to_thread(CliRunner().invoke, cli_main, ["top", "--once", "--url", n0.url, "--key",
                                                                 CLUSTER_ADMIN, "--interval", "0.1"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("n1 "))
    assert line.split()[:3] == ["n1", "alive", n1.url], line
