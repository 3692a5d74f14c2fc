"""The one wiring point: every collaborator of a node is built here, and each is handed
only the narrow things it uses (the ledger, the registry, the lifecycle), never the node.

`build_node` constructs; `Node.open` opens the stores (the idempotency store, then the
ledger, so rows a crash left open are closed, as `interrupted` or with the numbers an
idempotent outcome kept, before anything runs) and resumes unfinished
batches; `Node.load` loads the models; `Node.close` stops it all in the reverse order.
`Node.reload` is the one point where a re-read config reaches the collaborators that read
tenants, keys, quotas, filters and prices (llmd/reload.py says what it leaves alone).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.auth import Authenticator
from llmd.backends import build_backend, unknown_tool_parser
from llmd.batch.runner import BatchRunner
from llmd.batch.store import BatchStore
from llmd.cluster.metrics import ClusterCollector
from llmd.cluster.node import ClusterNode
from llmd.config import Config, ConfigError
from llmd.cost.summaries import CostSummaries
from llmd.cost.uptime import EngineUptime, UptimeStore, uptime_path
from llmd.dashboard import Dashboard
from llmd.exposure import check_exposure
from llmd.filters import Filters
from llmd.filters.guard import Guard
from llmd.idempotency import IdempotencyStore, IdempotentRuns
from llmd.lifecycle import Lifecycle
from llmd.metering import Ledger, Price
from llmd.metrics import Metrics
from llmd.policy.admission import AdmissionController
from llmd.policy.pacing import RefusalPacer
from llmd.prompt_pool import PromptPool
from llmd.registry.registry import Registry
from llmd.registry.store import RegistryStore
from llmd.reload import database, merge
from llmd.runtime import build_runtime
from llmd.service import Service, degraders
from llmd.store import WeightStore
from llmd.supervisor import Supervisor
from llmd.telemetry import log


@dataclass(eq=False)
class Node:
    """One llmd node's collaborators, as the gateway and the CLI reach them."""

    config: Config
    ledger: Ledger
    registry: Registry
    admission: AdmissionController
    metrics: Metrics
    lifecycle: Lifecycle
    service: Service
    runs: IdempotentRuns
    batches: BatchStore
    batch_runner: BatchRunner
    auth: Authenticator
    supervisor: Supervisor
    dashboard: Dashboard  # /dashboard's data: live views, 2-s samples, the request inspector
    cluster: ClusterNode | None = None  # [cluster] enabled: gossip, routing between nodes, failover
    uptime: EngineUptime | None = None  # which engines were loaded when: what serving costs (llmd/cost/)
    costs: CostSummaries | None = None  # GET /admin/cost and the dashboard's cost panel
    pacer: RefusalPacer | None = None  # holds the refusals of a tenant that ignores Retry-After

    async def open(self) -> None:
        await self.runs.store.start()  # first: the ledger's recovery reads the finals kept with outcomes
        recovered = await self.ledger.start(self.runs.store.finals)
        if recovered:
            log.warning("ledger_recovered", interrupted_rows=recovered)
        await self.registry.store.start()
        await self.dashboard.open()  # today's spend per tenant, before anything runs
        await self.batches.start()
        if self.uptime is not None:
            await self.uptime.start()
        await self.batch_runner.start()  # unfinished batches resume (their items wait for the models)
        if self.cluster is not None:
            await self.cluster.start()  # joins at once; peers route here once its versions are loaded

    async def load(self) -> None:
        """Load every configured model, then the other versions the registry had and its splits."""
        self.supervisor.start()
        if self.cluster is not None:
            await self.cluster.fetch_weights(self.config.models)  # a joining node's weights come from its peers
        await self.registry.load_configured()
        await self.registry.restore()
        if self.uptime is not None:
            await self.uptime.tick()  # their uptime counts from now, not from the next sample

    async def close(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()  # leave first: peers stop routing here before anything stops
        await self.supervisor.stop()  # no engine is rebuilt while the node stops
        if self.uptime is not None:
            await self.uptime.stop()  # the engines' uptime up to now, before they stop
        await self.batch_runner.stop()  # its items in flight are metered as interrupted
        await self.runs.stop()
        await self.runs.store.stop()
        await self.registry.stop()
        await self.ledger.stop()
        await self.batches.stop()
        self.service.pool.close()

    @property
    def ready(self) -> bool:
        return self.registry.ready

    def reload(self, new: Config) -> list[str]:
        """Run `new`'s tenants, keys, quotas, filters and prices from now on; returns notes on what
        the file changes that a reload does not apply. Everything that can fail is built first
        (raising ConfigError, the config in force untouched); the swap itself has no await, so
        every request sees the old config or the new one, never a mix. Requests already
        admitted finish under the config they were admitted with."""
        config, notes = merge(self.config, new)
        check_exposure(config, config.server.host)
        filters = Filters(config, self.service.filters.ask)
        auth = Authenticator(config)
        prices = _prices(config)
        secrets = _secrets(config) if self.cluster is not None else []
        self.config, self.auth, self.service.filters = config, auth, filters
        self.ledger.prices = self.lifecycle.ledger.prices = prices  # the same ledger, unless a bench swapped one in
        self.admission.reconfigure(config.tenants)
        for versions in self.registry.runtimes.values():
            for rt in versions.values():
                rt.set_tenants(config.tenants)
                rt.set_ttft_objective(config.slo.slo_for(rt.cfg.name).ttft_p95_s)
        self.batch_runner.config = config
        if self.cluster is not None:
            notes += self.cluster.rekey(config.cluster, secrets)
        return notes

    @property
    def healthy(self) -> bool:
        """False once every loaded model's engine is dead and cannot be rebuilt: the node is
        no use as it is, so /health says so and an orchestrator restarts it."""
        rts = [rt for rt in self.registry.primaries().values() if rt is not None]
        return not rts or any(rt.backend.healthy or rt.watch.recoverable for rt in rts)


def _secrets(config: Config) -> list[bytes]:
    """The cluster secrets the files hold now (read before anything is swapped: a reload that
    cannot read them is refused whole)."""
    try:
        secrets = config.cluster.secrets()
    except OSError as e:
        raise ConfigError(f"{config.path or 'config'}: invalid configuration\n  cluster.secret_files: "
                          f"{e.filename}: {e.strerror}") from None
    if not secrets:
        raise ConfigError(f"{config.path or 'config'}: invalid configuration\n  cluster.secret_files: no secret")
    return secrets


def build_node(config: Config, store: WeightStore | None = None, ledger: Ledger | None = None) -> Node:
    """Everything a node runs, wired. `ledger` replaces the SQLite ledger (benchmarks' stand-ins)."""
    _check_tool_parsers(config)
    db = database(config)
    ledger = ledger or Ledger(db, config.server.node, _prices(config))
    weights = store or WeightStore()
    supervisor = Supervisor(lambda: [rt for versions in registry.runtimes.values() for rt in versions.values()],
                            functools.partial(build_backend, store=weights))
    # Versions loaded later (the registry) get the tenants in force then: after a reload, the new ones.
    registry = Registry(config.models, RegistryStore(db.with_suffix(".registry.db")), weights,
                        lambda cfg, backend: build_runtime(cfg, backend, node.config.tenants, watch=supervisor.watch,
                                                           ttft_s=node.config.slo.slo_for(cfg.name).ttft_p95_s),
                        config.server.node, config.cluster.enabled)
    admission = AdmissionController(config.tenants, time.monotonic)
    metrics = Metrics(registry, lambda: node.config.slo)  # read at each scrape: a reload changes it

    def observe(rec: dict[str, Any]) -> None:  # each finished request: Prometheus, then the dashboard
        metrics.observe(rec)
        dashboard.observe(rec)

    lifecycle = Lifecycle(ledger, admission, observe)
    filters = Filters(config, Guard(lambda model: service.route(model).backend))
    pacer = RefusalPacer(time.monotonic, config.server.refusal_hold_s, demote_s=config.server.refusal_demote_s,
                         hold_max_s=config.server.refusal_hold_max_s)
    service = Service(config.server.node, registry, admission, filters, degraders(config.models),
                      PromptPool(config.server.prompt_workers), pacer.hammering)
    runs = IdempotentRuns(IdempotencyStore(db.with_suffix(".idempotency.db"), config.server.idempotency_ttl_s),
                          lifecycle, config.server.resume_grace_s)
    ttl = config.batch.file_ttl_days
    batches = BatchStore(db.with_suffix(".batches.db"), config.batch.data_dir or _files_dir(db),
                         ttl * 86400 if ttl is not None else None)
    runner = BatchRunner(batches, config, lifecycle, service)
    dashboard = Dashboard(registry, ledger, lifecycle.in_flight, batches, runner)
    node = Node(config, ledger, registry, admission, metrics, lifecycle, service, runs, batches, runner,
                Authenticator(config), supervisor, dashboard)
    if config.cluster.enabled:
        node.cluster = ClusterNode(config, registry, admission)
        service.router = node.cluster.runner()
        service.peer_tokenizer = node.cluster.tokenizer_of
        metrics.registry.register(ClusterCollector(node.cluster))
        dashboard.cluster = node.cluster
    node.pacer = pacer
    node.uptime = uptime = EngineUptime(UptimeStore(uptime_path(db)), config.server.node,
                                        functools.partial(_loaded, registry), config.cost.sample_s)
    node.costs = CostSummaries(lambda: database(node.config), lambda: node.config.cost, ledger.flush, uptime.live,
                               lambda: node.config.server.max_deadline_s + 60)
    dashboard.cost = node.costs.today
    dashboard.slo = lambda model: node.config.slo.slo_for(model).model_dump()  # read per poll: a reload changes it
    return node


def _loaded(registry: Registry) -> list[tuple[str, str]]:
    return [(model, version) for model, versions in registry.runtimes.items() for version in versions]


def _prices(config: Config) -> dict[str, Price]:
    return {m.name: Price(m.pricing.input_per_mtok, m.pricing.output_per_mtok) for m in config.models}


def _check_tool_parsers(config: Config) -> None:
    """Each `tool_parser` names one its backend has, in config.toml's terms (file and key): the
    config's own validation cannot ask the backends, which alone may import their engines."""
    for i, m in enumerate(config.models):
        if (why := unknown_tool_parser(m)) is not None:
            raise ConfigError(f"{config.path or 'config'}: invalid configuration\n"
                              f"  models[{i}].tool_parser (model {m.name!r}): {why}")


def _files_dir(db: Path) -> Path:
    return db.parent / f"{db.stem}-files"
