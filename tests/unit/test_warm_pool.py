"""The warm pool: the pure policy under a fake clock (promote after a sustained crossing, not on
a blip; demote only after a long calm, with a calm level below the bound), then the runtime
side on a real registry whose pool version sleeps (the fake engine's sleep mode): woken and
routed to when the cluster is hot, back to sleep and refused after the calm."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.lib.servers import tiny_versions
from llmd.cluster.warm_pool import WarmPool
from llmd.config import Config
from llmd.config.cluster import WarmPoolConfig
from llmd.policy.warmpool import ClusterLoad, WarmPoolPolicy
from llmd.registry.registry import Registry, RegistryError
from llmd.registry.routing import NotServedHere
from llmd.registry.store import RegistryStore
from llmd.runtime import build_runtime
from llmd.store import WeightStore

CFG = WarmPoolConfig(promote_queue_tokens=10_000, promote_ttft_s=2.0, sustain_s=5.0, demote_after_s=300.0)
HOT, CALM, LUKEWARM = ClusterLoad(12_000, 0.5), ClusterLoad(1_000, 0.3), ClusterLoad(6_000, 0.5)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def run(policy: WarmPoolPolicy, clock: Clock, load: ClusterLoad, seconds: float, step: float = 0.5) -> list[str]:
    """Feed `load` every `step` s for `seconds`; the actions taken."""
    out = []
    for _ in range(int(seconds / step)):
        clock.t += step
        if action := policy.observe(load):
            out.append(action)
    return out


def test_promotes_after_the_bound_is_crossed_for_sustain_s_not_on_a_blip() -> None:
    clock = Clock()
    policy = WarmPoolPolicy(CFG, clock)
    assert run(policy, clock, HOT, 4.0) == []
    assert run(policy, clock, CALM, 0.5) == []  # a blip: the timer starts again
    assert run(policy, clock, HOT, 4.5) == [] and not policy.promoted
    assert run(policy, clock, HOT, 1.0) == ["promote"] and policy.promoted
    assert run(policy, clock, HOT, 60) == []  # once
    # TTFT alone crosses too.
    ttft = WarmPoolPolicy(CFG, clock)
    assert run(ttft, clock, ClusterLoad(0, 2.5), 5.5) == ["promote"]
    # With no bound configured nothing is ever promoted.
    never = WarmPoolPolicy(WarmPoolConfig(), clock)
    assert run(never, clock, ClusterLoad(10**9, 100.0), 60) == []


def test_demotes_only_after_demote_after_s_of_calm_and_not_while_lukewarm() -> None:
    clock = Clock()
    policy = WarmPoolPolicy(CFG, clock)
    assert run(policy, clock, HOT, 6) == ["promote"]
    assert run(policy, clock, CALM, 299) == []
    assert run(policy, clock, LUKEWARM, 1) == []  # over half the bound: not calm, the timer restarts
    assert run(policy, clock, CALM, 299) == [] and policy.promoted
    assert run(policy, clock, LUKEWARM, 600) == []  # hovering under the bound: stays up
    assert run(policy, clock, CALM, 300.5) == ["demote"] and not policy.promoted
    assert run(policy, clock, CALM, 600) == []


# -- the runtime side: a registry with a sleeping pool version ---------------------------------
TOML = """
[[models]]
name = "m"
source = "tiny"
version = "{version}"
backend = "fake"
[models.fake]
step_ms = 1
step_ms_per_seq = 0.0
sleep_mode = true
"""


@pytest.fixture
def versions(tmp_path: Path, smollm2_path: Path) -> tuple[WeightStore, str, str]:
    ws, (v1, v2) = tiny_versions(tmp_path / "home", (b"weights v1", b"weights v2"))
    return ws, v1, v2


async def start(tmp_path: Path, ws: WeightStore, configured: str, clustered: bool = True) -> Registry:
    cfg = Config.model_validate(tomllib.loads(TOML.format(version=configured[:12])))
    reg = Registry(cfg.models, RegistryStore(tmp_path / "registry.db"), ws,
                   lambda c, b: build_runtime(c, b, cfg.tenants), node="pool", clustered=clustered)
    await reg.store.start()
    await reg.load_configured()
    await reg.restore()
    return reg


@pytest.fixture
async def pool_node(tmp_path: Path, versions) -> AsyncIterator[tuple[Registry, str, str]]:
    """A node configured with v2 that holds v1 in the warm pool."""
    ws, v1, v2 = versions
    reg = await start(tmp_path, ws, v2)
    assert await reg.load("m", v1, warm=False, pool=True) == v1
    yield reg, v1, v2
    await reg.stop()


def refused(reg: Registry) -> bool:
    try:
        reg.route("m", "conv", None)
    except NotServedHere:
        return True
    return False


async def test_a_sleeping_pool_version_is_promoted_under_load_and_put_back_after_the_calm(pool_node) -> None:
    reg, v1, _ = pool_node
    await reg.set_split("m", {v1: 1})
    engine = reg.runtimes["m"][v1].backend
    assert engine.sleeping and refused(reg) and reg.describe("m")["versions"][1]["pool"]
    clock, load = Clock(), [CALM]
    pool = WarmPool(reg, CFG, lambda model: load[0], clock)

    async def for_s(seconds: float) -> int:
        moved = 0
        for _ in range(int(seconds / 0.5)):
            clock.t += 0.5
            moved += await pool.tick()
        return moved

    assert await for_s(10) == 0 and engine.sleeping
    load[0] = HOT
    assert await for_s(4) == 0 and engine.sleeping and refused(reg)  # not yet sustained
    hot_since = pool.status()["m"]["since"]
    assert hot_since is not None and pool.status()["m"]["queue_tokens"] == HOT.queue_tokens
    assert await for_s(1.5) == 1 and pool.promotions == 1
    assert pool.status()["m"]["promoted"] and pool.status()["m"]["since"] is None
    assert clock.t - hot_since >= CFG.sustain_s
    assert not engine.sleeping and reg.route("m", "conv", None).backend.version == v1
    assert reg.states["m"][v1] == "active" and (await reg.store.versions("m"))[v1] == "pool"  # a restart: calm
    load[0] = CALM
    assert await for_s(290) == 0 and not engine.sleeping
    assert await for_s(11) == 2 and pool.demotions == 1  # demoted, then (nothing in flight) asleep
    assert engine.sleeping and refused(reg)


async def test_a_pool_version_outside_the_split_is_not_promoted(pool_node) -> None:
    """Promotion adds places for the split's weights, never new weights: v1 is not in the split."""
    reg, v1, v2 = pool_node
    await reg.set_split("m", {v2: 1})
    clock = Clock()
    pool = WarmPool(reg, CFG, lambda model: HOT, clock)
    for _ in range(30):
        clock.t += 0.5
        await pool.tick()
    assert pool.promotions == 0 and reg.runtimes["m"][v1].backend.sleeping
    assert {reg.route("m", f"c{i}", None).backend.version for i in range(20)} == {v2}
    await reg.set_split("m", {v1: 1, v2: 1})  # now it is: promoted after the load has lasted again
    for _ in range(12):
        clock.t += 0.5
        await pool.tick()
    assert pool.promotions == 1 and not reg.runtimes["m"][v1].backend.sleeping


async def test_the_configured_version_itself_waits_in_the_pool_across_a_restart(tmp_path: Path, versions) -> None:
    """The usual pool node: configured with the split's version, which it serves only when promoted."""
    ws, v1, _ = versions
    reg = await start(tmp_path, ws, v1)
    try:
        await reg.set_split("m", {v1: 1})
        assert not refused(reg)
        await reg.load("m", v1, pool=True)
        assert refused(reg)
        pool = WarmPool(reg, CFG, lambda model: CALM, Clock())
        assert await pool.tick() == 1 and reg.runtimes["m"][v1].backend.sleeping  # nothing in flight: asleep
    finally:
        await reg.stop()
    again = await start(tmp_path, ws, v1)
    try:
        assert refused(again) and again.pool["m"] == {v1}
        assert await again.set_promoted("m", True) == [v1] and not refused(again)
    finally:
        await again.stop()
    alone = await start(tmp_path, ws, v1, clustered=False)
    try:
        assert not refused(alone)  # out of a cluster, the pool means nothing: the version serves
        with pytest.raises(RegistryError, match="cluster"):
            await alone.load("m", v1, pool=True)
    finally:
        await alone.stop()


# -- across real nodes: the pool node's own requests -------------------------------------------
async def test_a_pool_version_runs_nothing_on_its_node_until_promoted_not_even_that_nodes_own_requests(
        make_server, tmp_path: Path) -> None:
    """n1's only version waits in the pool: a request entering n1 runs on n0 (n1's router does not
    count its own standby version as a place to run), and a run forwarded to n1 for that version
    (a peer's stale view) is refused as 'not here', so the ingress tries another node. Once
    promoted, n1 runs both again."""
    import httpx
    import openai

    from llmd.cluster.wire import RUN_PATH, RunRequest
    from tests.conftest import async_wait_until
    from tests.unit.test_cluster import ADMIN, JSON, KEY, start_cluster

    n0, n1 = await start_cluster(make_server, tmp_path, n=2, fake="sleep_mode = true")
    version = n1.node.registry.primary("fake").version
    run = RunRequest(request_id="r1", engine_id="e1", tenant="a", klass="interactive", model="fake", version=version,
                     prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 2}, seconds_left=10.0)
    body = run.model_dump_json().encode()

    async def forwarded(h: httpx.AsyncClient) -> int:
        signed = n0.node.cluster.http_signer.headers("POST", RUN_PATH, body, to="n1")
        return (await h.post(n1.url + RUN_PATH, content=body, headers=signed | JSON)).status_code

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as h:
        r = await h.post(n1.url + "/admin/models/fake/versions", json={"version": version, "warm_pool": True})
        assert r.status_code == 200, r.text
        assert await async_wait_until(lambda: any(v.standby for p in n0.node.cluster.peers.values() if p.state
                                                  for v in p.state.versions), timeout=10)
        client = openai.AsyncOpenAI(base_url=n1.base, api_key=KEY, max_retries=0, timeout=30)
        nodes = set()
        for i in range(8):
            out = await client.chat.completions.with_raw_response.create(
                model="fake", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4)
            nodes.add(out.headers["x-llmd-node"])
        assert nodes == {"n0"}
        async def pool_view() -> dict:  # what its policy watches: an entry once its first tick ran
            return (await h.get(n1.url + "/admin/cluster")).json()["warm_pool"]  # type: ignore[no-any-return]

        for _ in range(50):
            if "fake" in (pool := await pool_view()):
                break
            await asyncio.sleep(0.1)
        assert pool["fake"]["promoted"] is False and pool["fake"]["queue_tokens"] == 0
        assert await forwarded(h) == 404
        assert await n1.node.registry.set_promoted("fake", True) == [version]
        assert await forwarded(h) == 200
