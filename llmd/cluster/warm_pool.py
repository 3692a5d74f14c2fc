"""The warm pool on this node: versions loaded asleep for it (`llmd registry load --warm-pool`,
or `"warm_pool": true` on the admin API) are woken and made routable here when the cluster
is hot for a while, and put back to sleep after a long calm (llmd/policy/warmpool.py decides).

Only the node holding a pool version acts on it, per model, on the cluster-wide load the
gossip gives every node alike. Promotion never changes the cluster split, only where its
versions run: a pool version outside the split is not promoted (it would be new weights,
a rollout, not capacity). A demoted version stops taking new requests at once and sleeps
once the ones it has finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from llmd.config.cluster import WarmPoolConfig
from llmd.periodic import Periodic
from llmd.policy.warmpool import ClusterLoad, WarmPoolPolicy
from llmd.registry.registry import Registry

log = structlog.get_logger("llmd.cluster.warm_pool")
LoadOf = Callable[[str], ClusterLoad]  # model -> its load across the cluster (the coordinator's gossip view)
TICK_S = 0.5


class WarmPool:
    def __init__(self, registry: Registry, cfg: WarmPoolConfig, load: LoadOf,
                 clock: Callable[[], float] = time.monotonic, every_s: float = TICK_S) -> None:
        self.registry, self.cfg, self.load, self.clock = registry, cfg, load, clock
        self.policies: dict[str, WarmPoolPolicy] = {}
        self.promotions = self.demotions = 0
        self.seen: dict[str, ClusterLoad] = {}  # model -> the load its policy was last fed
        self._loop = Periodic("warm-pool", every_s, self.tick, log, "warm_pool_changed", "warm_pool_failed",
                              "versions")

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def tick(self) -> int:
        """One look at the load for every model with pool versions here; how many versions
        were promoted, demoted or put back to sleep."""
        moved = 0
        for name, pooled in list(self.registry.pool.items()):
            if not pooled:
                continue
            policy = self.policies.setdefault(name, WarmPoolPolicy(self.cfg, self.clock))
            self.seen[name] = load = self.load(name)
            action = policy.observe(load)
            if action == "promote":
                changed = await self.registry.set_promoted(name, True)
                if not changed:  # no pool version in the split (yet): look again next time it is hot
                    policy.reset()
                self.promotions += len(changed)
                moved += len(changed)
            elif action == "demote":
                changed = await self.registry.set_promoted(name, False)
                self.demotions += len(changed)
                moved += len(changed)
            moved += len(await self.registry.settle(name))
        return moved

    def status(self) -> dict[str, Any]:
        """Per model with pool versions here: what its policy last saw and where it stands
        (`since`: when the current hot stretch, or promoted the calm one, began, on the clock)."""
        return {name: {"promoted": p.promoted, "since": p.since, "queue_tokens": self.seen[name].queue_tokens,
                       "ttft_p90_s": self.seen[name].ttft_p90_s}
                for name, p in self.policies.items() if name in self.seen}
