"""The warm pool: the pure policy under a fake clock (promote after a sustained crossing, not on
a blip; demote only after a long calm, with a calm level below the bound), then the runtime
side on a real registry whose pool version sleeps (the fake engine's sleep mode): woken and
routed to when the cluster is hot, back to sleep and refused after the calm."""

from __future__ import annotations

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
    assert await for_s(1.5) == 1 and pool.promotions == 1
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
