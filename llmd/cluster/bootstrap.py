"""A node that joins without a configured model's weights pulls them from the peers that serve
that model (weights.py: hashed chunks from all of them at once), before it loads its models,
so a new node needs the config and the cluster secret, not a copy from the origin."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import structlog

from llmd.cluster.load import NodeState
from llmd.cluster.signing import Signer
from llmd.cluster.weights import PullError, pull
from llmd.config import ModelConfig
from llmd.store import StoreError, WeightStore

log = structlog.get_logger("llmd.cluster")
PEER_WAIT_S = 20.0  # how long a joining node waits to hear of a peer serving the model
ALL_PEERS_S = 2.0  # then how long it listens for more (each peer's state comes within a heartbeat)


def holders(states: list[NodeState], m: ModelConfig) -> dict[str, list[str]]:
    """Version -> base URLs of the peers that can hand it over, for the configured model: those
    serving it and, for a pinned version, those that only store it (a node that rolled it back,
    or keeps it on standby unloaded): a version id names the weights, not the model, so an
    unpinned model is found by what serves it."""
    out: dict[str, list[str]] = {}
    for st in states:
        found = {v.version for v in st.versions
                 if v.model == m.name and (m.version is None or v.version.startswith(m.version))}
        if m.version:
            found |= {v for v in st.stored if v.startswith(m.version)}
        for version in sorted(found):
            out.setdefault(version, []).append(st.http_url)
    return out


async def fetch_missing(models: list[ModelConfig], store: WeightStore, states: Callable[[], list[NodeState]],
                        http: httpx.AsyncClient, signer: Signer, wait_s: float = PEER_WAIT_S) -> list[str]:
    """Pull every configured model this node's store lacks; returns what was pulled. A model no
    peer serves is left alone: its load then fails as it would without a cluster, saying why."""
    pulled = []
    for m in models:
        if not m.source or _stored(store, m):
            continue
        found = await _heard(lambda: holders(states(), m), wait_s)  # noqa: B023 - awaited before the loop moves on
        if found:  # the first state heard: the others' come within a heartbeat; pull from all at once
            await asyncio.sleep(ALL_PEERS_S)
            found = holders(states(), m)
        if not found:
            log.warning("cluster_weights_no_peer", model=m.name, source=m.source)
            continue
        version, urls = max(found.items(), key=lambda kv: len(kv[1]))
        t0 = time.monotonic()
        try:
            nodes = {st.http_url: st.node for st in states()}
            res = await pull(version, urls, http, signer, store=store, name=m.source, nodes=nodes)
        except PullError as e:
            log.error("cluster_weights_pull_failed", model=m.name, version=version[:12], error=str(e))
            continue
        log.info("cluster_weights_pulled", model=m.name, version=version[:12], seconds=round(time.monotonic() - t0, 2),
                 chunks_by_peer=dict(res.chunks_by_peer), bytes_by_peer=dict(res.bytes_by_peer))
        pulled.append(f"{m.source}@{version[:12]}")
    return pulled


def _stored(store: WeightStore, m: ModelConfig) -> bool:
    try:
        store.resolve(m.source or m.name, m.version)
    except StoreError:
        return False
    return True


async def _heard(look: Callable[[], dict[str, list[str]]], wait_s: float) -> dict[str, list[str]]:
    """What `look` finds once gossip has told this node of a peer serving it, or {} after wait_s
    (the states arrive by polling the gossip view: there is no event to wait on)."""
    end = time.monotonic() + wait_s
    found = look()
    while not found and time.monotonic() < end:
        await asyncio.sleep(0.2)
        found = look()
    return found

