"""A node's cluster part, built whole for one `Node`: membership (gossip), what this node
tells the others and what it knows of them, and the router its jobs run through.

Two small loops on the event loop: one publishes this node's state (load per version in
tokens, prefix-cache changes, the tokens each tenant used here, the registry's revision) for
gossip to push; one reads the peers' latest states, so a routing decision reads decoded
views and never waits on the network. Membership changes arrive from the gossip thread
and fail over the reads waiting on a node that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import structlog

from llmd.backends.base import Prompt
from llmd.backends.kv_chains import KvChains
from llmd.cluster.bootstrap import fetch_missing
from llmd.cluster.calls import registry_snapshot, signed_get
from llmd.cluster.executor import on_standby
from llmd.cluster.forward import Forwarder
from llmd.cluster.gossip import Gossip, MemberInfo
from llmd.cluster.load import NodeState, decode, encode, version_load
from llmd.cluster.prefixes import PeerPrefixes, PrefixIndex, chain_hashes, delta_end, feeder, prefix_key
from llmd.cluster.registry_sync import RegistrySync
from llmd.cluster.router import Router, Target
from llmd.cluster.signing import Keyring, Signer
from llmd.cluster.warm_pool import WarmPool
from llmd.config import Config, ConfigError, ModelConfig
from llmd.config.cluster import ClusterConfig
from llmd.policy.admission import AdmissionController
from llmd.policy.homes import Congestion, HomeTable, Shared
from llmd.policy.placement import POLICIES, Candidate, queued_prefill_s
from llmd.policy.rendezvous import home_key, home_ranks
from llmd.policy.reservations import Reservations
from llmd.policy.warmpool import ClusterLoad
from llmd.registry.registry import Registry
from llmd.runtime import Job

log = structlog.get_logger("llmd.cluster")
READ_EVERY_S = 0.05  # how often peers' new states are decoded
PREFIX_BLOCK_TOKENS = 64
PREFIX_CAPACITY_BLOCKS = 65536
PREFIX_DELTA_BYTES = 400
PREFIX_RESEND = 2  # a push's prefix delta covers the changes since this many pushes back
RESERVATION_TTL_S = 2.0  # a reservation outlives any state push that could have missed it
STORED_REFRESH_S = 10.0  # how often the store is listed for the state's `stored`
TRAFFIC_EVERY_S = 4.0  # how often the prefixes' traffic goes out in the state (balanced homes; < PEER_TTL_S / 2)


@dataclass
class Peer:
    """What this node knows of one peer, decoded from its latest state."""

    info: MemberInfo
    state: NodeState | None = None
    received: float = 0.0
    prefixes: PeerPrefixes = field(default_factory=PeerPrefixes)
    tenant_tokens: dict[str, int] = field(default_factory=dict)  # as last applied to our buckets
    snapshot_task: asyncio.Task[None] | None = None
    sync_task: asyncio.Task[None] | None = None


class ClusterNode:
    def __init__(self, config: Config, registry: Registry, admission: AdmissionController) -> None:
        cc, srv = config.cluster, config.server
        self.name = srv.node
        self.config = cc
        self.registry = registry
        self.admission = admission
        secrets = cc.secrets()
        self.keyring = Keyring(secrets, time.time, cc.rotation_window_s)  # one for both signers: a reload re-keys both
        self.http_signer = Signer(self.name, self.keyring, time.time, cc.replay_window_s, purpose="http")
        scheme = "https" if srv.tls is not None else "http"
        self.url = cc.advertise_url or f"{scheme}://{srv.host}:{srv.port}"
        try:
            self.gossip = Gossip(self.name, (cc.gossip_host, cc.gossip_port), self.url,
                                 [_addr(s) for s in cc.seeds],
                                 Signer(self.name, self.keyring, time.time, cc.replay_window_s, purpose="gossip"), cc)
        except OSError as e:  # the port is taken, or the address is not this host's
            raise ConfigError(f"{config.path or 'config'}: cluster.gossip_host/gossip_port "
                              f"{cc.gossip_host}:{cc.gossip_port}: cannot listen for gossip: {e.strerror}") from None
        # One connection per forwarded stream (no pool cap: a cap would queue streams here, out of
        # every fair queue); reads wait as long as the request's deadline lets them.
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(cc.ca_file)) if cc.ca_file else True
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=1.0), verify=verify,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.forwarder = Forwarder(self.http_signer, self.client)
        # Keyed by the oldest secret at start: during a rotation ([new, old] on some nodes, [old]
        # on the rest) every node still names a prefix the same way; a reload does not re-key it.
        self._prefix_key = prefix_key(secrets[-1])
        self.prefixes = PrefixIndex(PREFIX_CAPACITY_BLOCKS, PREFIX_BLOCK_TOKENS, self._prefix_key)
        self._chains: dict[int, KvChains] = {}  # id(backend) -> its KV events' adapter
        self.peers: dict[str, Peer] = {}
        policy = POLICIES[cc.placement](Reservations(time.monotonic, RESERVATION_TTL_S), random.Random())
        self.homes = HomeTable(time.monotonic)  # repeated prefixes' balanced homes, from the cluster's traffic
        self.congestion = Congestion(time.monotonic)  # whether they bind now
        self.router = Router(self.name, self._targets, self.forwarder, policy, cc.max_failovers, self._ran)
        self.sync = RegistrySync(registry, self._fetch_registry)
        self.warm_pool = WarmPool(registry, cc.warm_pool, self.cluster_load)
        self.draining = False
        self._seq = 0
        self._stored: tuple[float, tuple[str, ...]] = (float("-inf"), ())
        self._exported_at = float("-inf")
        self._tasks: list[asyncio.Task[None]] = []
        self.local_routing = cc.routing == "local"

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.gossip.start(self._member_changed, loop)
        self._tasks = [loop.create_task(self._publish_loop()), loop.create_task(self._read_loop())]
        self.warm_pool.start()
        log.info("cluster_started", node=self.name, url=self.url, gossip_port=self.gossip.bound_port,
                 seeds=self.config.seeds)

    def rekey(self, cc: ClusterConfig, secrets: list[bytes]) -> list[str]:
        """Hold `secrets` (what `cc`'s files or $LLMD_CLUSTER_SECRET hold now: `llmd reload`);
        notes on what changed. The rest of `[cluster]` applies at a restart (`llmd.reload.merge`)."""
        self.config = self.config.model_copy(update={"secret_files": cc.secret_files,
                                                     "rotation_window_s": cc.rotation_window_s})
        return self.keyring.rekey(secrets, cc.rotation_window_s)

    async def fetch_weights(self, models: list[ModelConfig]) -> list[str]:
        """Weights this node lacks, pulled from the peers serving them (before the models load)."""
        states = lambda: [p.state for p in self.peers.values() if p.state is not None and p.info.state == "alive"]  # noqa: E731
        return await fetch_missing(models, self.registry.weights, states, self.client, self.http_signer)

    async def stop(self) -> None:
        """Leave gracefully: the others stop routing here at once, not after a death timeout."""
        self.draining = True
        await self.warm_pool.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await asyncio.get_running_loop().run_in_executor(None, self.gossip.stop, True)
        await self.client.aclose()

    def runner(self) -> Router | None:
        """The router jobs run through, or None: run them here (routing = "local": an external
        router such as llm-d's endpoint picker chose this node)."""
        return None if self.local_routing else self.router

    # -- this node's state -------------------------------------------------------------------
    def state(self, since: int = 0) -> NodeState:
        """This node's state to push; its prefix delta starts at `since` (a few pushes back, so
        a peer that missed one catches up from the next; overlaps are harmless)."""
        self._seq += 1
        return replace(self._state(self._seq, since), traffic=self._traffic())

    def _state(self, seq: int, since: int = 0) -> NodeState:
        reg = self.registry
        loads = tuple(version_load(rt, draining=self.draining, standby=self._standby(model, version))
                      for model, versions in reg.runtimes.items() for version, rt in versions.items())
        delta = self.prefixes.delta(max(since, 0), PREFIX_DELTA_BYTES) or b""
        return NodeState(node=self.name, http_url=self.url, seq=seq, versions=loads,
                         prefix_seq=self.prefixes.seq, prefix_delta=delta,
                         tenant_tokens=dict(self.admission.charged), registry_rev=self._registry_rev(),
                         stored=self._stored_versions())

    def _stored_versions(self) -> tuple[str, ...]:
        """Versions whose weights this node can hand to a joining peer (its store, served or
        not); read at most every STORED_REFRESH_S: a state goes out on every heartbeat."""
        at, versions = self._stored
        now = time.monotonic()
        if now - at >= STORED_REFRESH_S:
            versions = tuple(sorted({m.version for m in self.registry.weights.list()}))
            self._stored = (now, versions)
        return versions

    def _traffic(self) -> tuple[Shared, ...]:
        """The prefixes this node routed most, for its peers' balanced homes: in one push every
        TRAFFIC_EVERY_S, none in between (decayed figures change on every push, and every
        push would carry them; a peer keeps the last it heard)."""
        now = time.monotonic()
        if not self.config.balanced_homes or now - self._exported_at < TRAFFIC_EVERY_S:
            return ()
        self._exported_at = now
        return self.homes.export()

    def _standby(self, model: str, version: str) -> bool:
        return on_standby(self.registry, model, version)

    def _registry_rev(self) -> int:
        return self.registry.revision

    def _name_at(self, url: str) -> str:
        """The peer serving at `url` (a signed call names its receiver)."""
        return next((p.info.name for p in self.peers.values() if p.info.http_url == url
                     or (p.state is not None and p.state.http_url == url)), "")

    async def _fetch_registry(self, peer_url: str) -> dict[str, Any]:
        return await registry_snapshot(self.http_signer, self.client, self._name_at(peer_url), peer_url)

    def cluster_load(self, model: str) -> ClusterLoad:
        """The model's waiting prefill tokens over every node, and the TTFT its least loaded node
        implies (its queue over its prefill rate): what the warm pool watches."""
        loads = [version_load(rt, self.draining, self._standby(model, version))
                 for version, rt in self.registry.runtimes.get(model, {}).items()]
        loads += [v for p in self.peers.values() if p.state is not None and p.info.state == "alive"
                  for v in p.state.versions if v.model == model]
        serving = [v for v in loads if not v.standby and not v.draining]
        waits = [v.waiting_prefill_tokens / v.prefill_tps for v in serving if v.prefill_tps > 0]
        return ClusterLoad(sum(v.waiting_prefill_tokens for v in loads), min(waits) if waits else None)

    def _listen(self) -> None:
        """Every engine that publishes KV events feeds this node's prefix summary (exact); a
        rebuilt engine is a new backend, attached on the next tick."""
        for versions in self.registry.runtimes.values():
            for rt in versions.values():
                be = rt.backend
                if id(be) not in self._chains and be.emits_kv_events:
                    chains = KvChains(lambda t: chain_hashes(t, PREFIX_BLOCK_TOKENS, self._prefix_key),
                                      PREFIX_BLOCK_TOKENS, feeder(self.prefixes))
                    self._chains[id(be)] = chains
                    be.kv_events = chains

    async def _publish_loop(self) -> None:
        sent: deque[int] = deque([0], maxlen=PREFIX_RESEND)  # where the last pushes' deltas ended
        while True:
            try:
                self._listen()
                state = self.state(since=sent[0])
                self.gossip.publish(encode(state))
                sent.append(delta_end(state.prefix_delta) if state.prefix_delta else sent[-1])
            except Exception:
                log.exception("cluster_publish_failed")
            await asyncio.sleep(self.config.load_interval_s)

    # -- the peers' states ---------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            try:
                self._read()
            except Exception:
                log.exception("cluster_read_failed")
            await asyncio.sleep(READ_EVERY_S)

    def _read(self) -> None:
        alive = {m.name: m for m in self.gossip.members()}
        for name, info in alive.items():
            peer = self.peers.setdefault(name, Peer(info))
            peer.info = info
            got = self.gossip.state_of(name)
            if got is None or got[1] <= peer.received:
                continue
            raw, peer.received = got
            try:
                state = decode(raw)
            except ValueError:
                log.warning("cluster_bad_state", peer=name)
                continue
            self._apply(peer, state)

    def _apply(self, peer: Peer, state: NodeState) -> None:
        first, peer.state = peer.state is None, state
        if state.traffic:
            self.homes.merge(peer.info.name, state.traffic)  # as of now: it was taken for this push
        if state.registry_rev and (peer.sync_task is None or peer.sync_task.done()):
            peer.sync_task = asyncio.get_running_loop().create_task(self._sync(state.http_url, state.registry_rev))
        self.router.reservations.seen(peer.info.name, state.seq)
        # A gap (missed pushes, a restarted peer) or a delta left out of a full state: the snapshot.
        if state.prefix_delta:
            in_step = peer.prefixes.apply(state.prefix_delta)
        else:
            in_step = state.prefix_seq in (0, peer.prefixes.seq)
        if not in_step:
            self._fetch_prefixes(peer)
        for tenant, used in state.tenant_tokens.items():  # a tenant's quota holds across nodes
            # A peer's counts are cumulative since it started: the first state heard is the
            # baseline (what it served before is not this minute's); after it, a tenant it had not
            # named yet had used nothing there.
            before = peer.tenant_tokens.get(tenant, None if first else 0)
            if before is not None and used != before:
                self.admission.charge_elsewhere(tenant, used - before)
            peer.tenant_tokens[tenant] = used

    async def _sync(self, url: str, rev: int) -> None:
        try:
            changed = await self.sync.on_peer_rev(url, rev)
        except Exception:
            log.exception("cluster_registry_sync_failed", peer=url)
            return
        if changed:
            log.info("cluster_registry_synced", peer=url, models=changed, revision=self.registry.revision)

    def _fetch_prefixes(self, peer: Peer) -> None:
        if peer.snapshot_task is not None and not peer.snapshot_task.done():
            return

        async def fetch() -> None:
            try:
                r = await signed_get(self.http_signer, self.client, peer.info.name, peer.info.http_url,
                                     "/internal/v1/prefixes")
                peer.prefixes.load(r.content)
            except (httpx.HTTPError, ValueError) as e:
                log.warning("cluster_prefix_snapshot_failed", peer=peer.info.name, error=str(e))

        peer.snapshot_task = asyncio.get_running_loop().create_task(fetch())

    def _member_changed(self, m: MemberInfo) -> None:
        log.info("cluster_member", peer=m.name, state=m.state, incarnation=m.incarnation, t=time.time())
        if m.state in ("dead", "left"):
            self.forwarder.node_lost(m.name)
            self.router.reservations.forget(m.name)
            self.homes.forget(m.name)
            self.sync.forget(m.http_url)
        else:
            self.forwarder.node_suspect(m.name, m.state == "suspect")

    # -- routing ---------------------------------------------------------------------------
    def _targets(self, job: Job, prompt: Prompt) -> list[Target]:
        version, model = job.record.version, job.record.model
        hashes = self.prefixes.hashes(prompt.token_ids)
        now = time.time()
        out: list[Target] = []
        local = self.registry.versions(model or "").get(version or "")
        if local is not None and local.ready:  # on standby here (the warm pool): not a candidate
            load = version_load(local, draining=self.draining, standby=self._standby(model or "", version or ""))
            out.append(Target(Candidate(self.name, load, self.prefixes.cached_tokens(hashes), 0.0, True), None))
        for peer in self.peers.values():
            st = peer.state
            if st is None or peer.info.state != "alive":
                continue
            theirs = next((v for v in st.versions if v.version == version), None)
            if theirs is not None:
                out.append(Target(Candidate(peer.info.name, theirs, peer.prefixes.cached_tokens(hashes),
                                            now - peer.received, False), st.http_url))
        key = home_key(hashes)  # where every ingress sends this prefix when no cache holds it
        if key is None:
            return out
        ranks = home_ranks(key, (t.candidate.node for t in out))
        shares: dict[str, float] = {}
        shared: int | None = None  # of this prompt, the tokens its prefix's requests share (`home_credit`)
        if self.config.balanced_homes:
            self.homes.observe(key, prompt.num_tokens, hashes)
            blocks = self.homes.shared_blocks(key)
            shared = None if blocks is None else blocks * PREFIX_BLOCK_TOKENS
            serving = [t.candidate for t in out if not (t.candidate.load.draining or t.candidate.load.standby)]
            shares = self.homes.homes(key, {c.node: c.load.kv_capacity_tokens for c in serving})
            congested = bool(serving) and self.congestion.update(queued_prefill_s(serving))
            if self.config.homes_bind == "congested" and not congested:
                shares = {}  # below capacity the score places it (`Congestion`): the homes are kept ready
        return [Target(replace(t.candidate, home_rank=ranks[t.candidate.node],
                               home_share=shares.get(t.candidate.node, 0.0), shared_tokens=shared), t.url)
                for t in out]

    @property
    def homes_bound(self) -> bool:
        """Whether this ingress keeps repeated prefixes on their balanced homes now."""
        return self.config.balanced_homes and (self.config.homes_bind == "always" or self.congestion.bound)

    def tokenizer_of(self, model: str, version: str) -> str | None:
        """What renders `version`'s prompts, as a live peer serving it says (None: none says)."""
        for peer in self.peers.values():
            if peer.state is not None and peer.info.state == "alive":
                for v in peer.state.versions:
                    if v.model == model and v.version == version and v.tokenizer:
                        return v.tokenizer
        return None

    def _ran(self, node: str, prompt: Prompt, engine_cached: int) -> None:
        """A choice started on `node`. Where it is this node and its engine sends no KV events,
        the summary is kept approximately: the cache now holds the prompt, and held what the
        engine said it had cached (a peer's own summary says the same of its cache)."""
        if node == self.name and not self._chains:
            hashes = self.prefixes.hashes(prompt.token_ids)
            self.prefixes.correct(hashes, engine_cached)
            self.prefixes.add(hashes)

    def ran_here(self, prompt: Prompt, engine_cached: int) -> None:
        """A peer's choice started on this node's engine (the executor's side of `_ran`)."""
        self._ran(self.name, prompt, engine_cached)

    def status(self) -> dict[str, Any]:
        st = self.gossip.stats
        return {
            "node": self.name, "url": self.url, "routing": self.config.routing, "draining": self.draining,
            "members": [{"name": p.info.name, "state": p.info.state, "incarnation": p.info.incarnation,
                         "url": p.info.http_url, "age_s": round(time.time() - p.received, 3) if p.received else None,
                         "versions": [v.__dict__ for v in p.state.versions] if p.state else [],
                         "prefix_seq": p.prefixes.seq} for p in self.peers.values()],
            "self": {"versions": [v.__dict__ for v in self._state(self._seq).versions],
                     "prefix_seq": self.prefixes.seq, "prefix_blocks": len(self.prefixes),
                     "queued": sum(len(rt.queue) + rt.backend.stats.waiting
                                   for versions in self.registry.runtimes.values() for rt in versions.values()),
                     "tenant_tokens": dict(self.admission.charged)},
            "gossip": {"sent_bytes": st.sent_bytes, "recv_bytes": st.recv_bytes, "dropped": dict(st.dropped)},
            "warm_pool": self.warm_pool.status(),
            "forwarded": self.forwarder.forwarded, "lost": self.forwarder.lost,
            "failovers": self.router.failovers, "placed": dict(self.router.placed),
            "homes": {**self.homes.status(), "congestion_s": round(self.congestion.level, 3),
                      "bound": self.homes_bound, "bind": self.config.homes_bind},
        }


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)
