"""Each model's loaded versions (one engine, queue and scheduler each) and the live routing
view. The registry owns every served version: it loads the configured ones at start, more
through its admin API, and stops them all. The view is rebuilt and swapped in whole after
every change, and every change is written to the registry's SQLite first, so a restart
comes back with the same versions and the same split. A request is routed to a version
once, before admission; from then on it only ever touches that version's engine, so it can
never be served by other weights.

In a cluster (docs/cluster.md, "Registry across nodes") a model's split is the one the cluster
agreed (`cluster_split`); a version of it not served here keeps its share, and a request that
picks it is refused here (a peer serves it), never served by other weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from llmd.backends import Backend, build_backend
from llmd.config import ModelConfig
from llmd.registry.routing import RoutingError, RoutingView, Split
from llmd.registry.store import RegistryStore, SplitRow
from llmd.registry.warmup import warm_up
from llmd.runtime import ModelRuntime
from llmd.store import WeightStore

log = structlog.get_logger("llmd.registry")
RuntimeFactory = Callable[[ModelConfig, Backend], ModelRuntime]  # a started engine -> its served version


class RegistryError(Exception):
    """A lifecycle step that cannot be done (unknown version, still in the split, ...)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class Registry:
    def __init__(self, models: list[ModelConfig], store: RegistryStore, weights: WeightStore,
                 make_runtime: RuntimeFactory, node: str = "llmd", clustered: bool = False,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.configs = {m.name: m for m in models}
        self.store, self.weights, self._make_runtime = store, weights, make_runtime
        self.runtimes: dict[str, dict[str, ModelRuntime]] = {}  # model -> version id -> runtime
        self.configured: dict[str, str] = {}  # model -> the version its config loaded
        self.load_errors: dict[str, str] = {}  # model -> why its configured version failed to load
        self.states: dict[str, dict[str, str]] = {}
        self.view = RoutingView()
        self._weights: dict[str, dict[str, float]] = {}  # model -> the current split's weights
        self.asleep: dict[str, set[str]] = {}  # versions whose engine sleeps (GPU memory freed)
        self._lock = asyncio.Lock()  # one lifecycle change at a time
        self.node, self.clustered, self._clock_ns = node, clustered, clock_ns
        self.splits: dict[str, SplitRow] = {}  # model -> the cluster split as agreed (with its revision)
        self.revision = 0  # hybrid clock: >= every split revision held; moves on every split applied
        self.pool: dict[str, set[str]] = {}  # warm-pool versions: routable only while promoted
        self.promoted: dict[str, set[str]] = {}

    # -- what is served --------------------------------------------------------------------
    def config(self, model: str) -> ModelConfig | None:
        return self.configs.get(model)

    def primary(self, model: str) -> ModelRuntime | None:
        """The configured version, once loaded."""
        version = self.configured.get(model)
        return self.runtimes[model][version] if version is not None else None

    def primaries(self) -> dict[str, ModelRuntime | None]:
        """Every configured model, in config order, with its configured version (None until loaded)."""
        return {name: self.primary(name) for name in self.configs}

    def versions(self, model: str) -> Mapping[str, ModelRuntime]:
        return self.runtimes.get(model, {})

    def load_error(self, model: str) -> str | None:
        return self.load_errors.get(model)

    @property
    def ready(self) -> bool:
        return all(rt is not None and rt.ready for rt in self.primaries().values())

    # -- start and stop --------------------------------------------------------------------
    async def load_configured(self) -> None:
        """Load every configured model and route to it at once; one that fails to load is
        reported (on /ready and in each request for it), the others still serve."""
        for name, cfg in self.configs.items():
            t0 = time.monotonic()
            try:
                backend = await build_backend(cfg, self.weights)
                await backend.start()
            except Exception as e:
                self.load_errors[name] = str(e)
                log.error("model_load_failed", model=name, error=str(e))
                continue
            self.runtimes[name] = {backend.version: self._make_runtime(cfg, backend)}
            self.configured[name] = backend.version
            self.states[name] = {backend.version: "active"}
            self._weights = {**self._weights, name: await self._first(name, backend.version)}
            self._publish()
            log.info("model_loaded", model=name, version=backend.version, seconds=round(time.monotonic() - t0, 2))

    async def _first(self, name: str, version: str) -> dict[str, float]:
        """Until `restore`: the configured version, unless (in a cluster) the split or the pool says no."""
        if not self.clustered:
            return {version: 1.0}
        last, pooled = await self.store.splits(name, 1), (await self.store.versions(name)).get(version) == "pool"
        return {} if pooled or (last and last[0].rev > 0 and last[0].weights.get(version, 0) <= 0) else {version: 1.0}

    async def restore(self) -> None:
        """After the configured versions loaded: load the other versions the registry had
        loaded (minutes on a real engine) and put back each model's last split (or keep all
        traffic on the configured version)."""
        self.revision = max(self.revision, await self.store.revision())
        for name, primary in list(self.configured.items()):
            saved = await self.store.versions(name)
            for version, state in saved.items():
                if version != primary and state in ("active", "standby", "pool"):
                    try:
                        await self._load(name, version, warm=False)
                    except Exception as e:
                        log.error("version_restore_failed", model=name, version=version, error=str(e))
                        await self.store.set_state(name, version, "unloaded")
            self.pool[name] = {v for v, st in saved.items() if st == "pool" and v in self.runtimes[name]
                               and self.clustered}  # alone, a pool version just serves
            if last := await self.store.splits(name, 1):
                self.splits[name] = last[0]
            weights = self._local(name, last[0].weights) if last else {}
            if not weights and not (self.clustered and last and last[0].rev > 0):
                # Nothing here serves the last split: alone, the configured version takes the
                # traffic; in a cluster, a split agreed there stays and peers serve it.
                weights = {primary: 1.0}
                self.splits[name] = await self.store.add_split(name, weights, "configured version", 0, self.node)
            await self._apply(name, weights)
            self._publish()

    async def stop(self) -> None:
        for rt in [rt for versions in self.runtimes.values() for rt in versions.values()]:
            await rt.stop()
        self.runtimes.clear()
        self.configured.clear()
        await self.store.stop()

    # -- routing ---------------------------------------------------------------------------
    def route(self, model: str, key: str | None, pin: str | None) -> ModelRuntime:
        version = self.view.route(model, key, pin)
        return self.runtimes[model][version]

    def _publish(self) -> None:
        """The local view: each model's cluster split laid out whole on [0, 1) (the same
        conversation picks the same version on every node), its versions not active here absent."""
        splits: dict[str, Split] = {}
        loaded: dict[str, frozenset[str]] = {}
        absent: dict[str, frozenset[str]] = {}  # split versions not active here: their requests are refused
        for name, states in self.states.items():
            active = {v: w for v, w in self._weights.get(name, {}).items() if w > 0 and states.get(v) == "active"}
            layout = row.weights if (row := self.splits.get(name)) is not None and self.clustered else active
            if any(w > 0 for w in layout.values()):
                splits[name] = Split.of(layout)
                absent[name] = frozenset(v for v, _ in splits[name].weights if v not in active)
            asleep = self.asleep.get(name, set())
            loaded[name] = frozenset(v for v, s in states.items()
                                     if s == "active" or (s == "standby" and v not in asleep))
        self.view = RoutingView(splits, loaded, absent)  # one assignment: requests see old or new, never a mix

    def _local(self, name: str, weights: Mapping[str, float]) -> dict[str, float]:
        """The part of a cluster split this node serves: its versions loaded here, not draining,
        and (warm-pool ones) promoted. Every other version is left out, never replaced."""
        states, pooled, up = self.states.get(name, {}), self.pool.get(name, set()), self.promoted.get(name, set())
        return {v: w for v, w in weights.items()
                if w > 0 and states.get(v) in ("active", "standby", "pool") and (v not in pooled or v in up)}

    async def _apply(self, name: str, weights: dict[str, float]) -> None:
        states, pooled = self.states[name], self.pool.get(name, set())
        for v in weights:  # a version put into rotation wakes up before any request reaches it
            if weights[v] > 0 and v in self.asleep.get(name, set()):
                await self.runtimes[name][v].backend.wake_up()
                self.asleep[name].discard(v)
        for v in self.runtimes[name]:
            idle = "standby" if states.get(v) in ("active", None) else states[v]
            idle = "pool" if v in pooled and idle != "draining" else idle
            want = "active" if weights.get(v, 0) > 0 else idle
            if states.get(v) != want:
                states[v] = want
                await self.store.set_state(name, v, "pool" if v in pooled else want)  # pool: comes back calm
        self._weights = {**self._weights, name: dict(weights)}

    async def _commit(self, name: str, weights: dict[str, float], note: str | None, rev: int, origin: str,
                      previous: dict[str, float] | None) -> SplitRow:
        """Record a cluster split (made here or by a peer), then route by its local part."""
        row = await self.store.add_split(name, weights, note, rev, origin, previous)
        self.splits[name] = row
        self.revision = max(self.revision + 1, rev, self._clock_ns())
        await self.store.set_revision(self.revision)
        await self._apply(name, self._local(name, weights))
        self._publish()
        return row

    def _tick(self) -> int:
        """A new revision: wall time, but after every one this node has seen (clocks drift)."""
        return max(self._clock_ns(), self.revision + 1)

    # -- lifecycle -------------------------------------------------------------------------
    def _model(self, name: str) -> dict[str, ModelRuntime]:
        if name not in self.runtimes:
            raise RegistryError(f"model {name!r} is not configured or not loaded yet", 404)
        return self.runtimes[name]

    def resolve(self, name: str, prefix: str) -> str:
        found = [v for v in self._model(name) if v.startswith(prefix)]
        if len(found) != 1:
            raise RegistryError(f"model {name!r} has {'no' if not found else 'more than one'} loaded version "
                                f"matching {prefix!r}", 404)
        return found[0]

    async def load(self, name: str, version: str, warm: bool = True, cpu_threads_bind: str | None = None,
                   pool: bool = False) -> str:
        """Load a stored version (its weights re-hashed first: a mismatch refuses to load), warm
        it up out of rotation, and keep it on standby. Returns its full id. `cpu_threads_bind`
        pins a CPU engine to its own cores (vLLM's VLLM_CPU_OMP_THREADS_BIND, e.g. "2-3"), so
        two engines in one process do not fight over the same ones. `pool`: a warm-pool
        version, routed to only while promoted. One the cluster split names serves its share."""
        if pool and not self.clustered:
            raise RegistryError("the warm pool is a cluster's ([cluster] enabled = true)", 400)
        async with self._lock:
            self._model(name)
            vid = await self._load(name, version, warm, cpu_threads_bind)
            for held in (self.pool, self.promoted):
                held.setdefault(name, set()).discard(vid)
            if pool:
                self.pool[name].add(vid)
                self.states[name][vid] = "pool"
            elif self.states[name].get(vid) not in ("active", "standby"):  # a draining one is back on standby
                self.states[name][vid] = "standby"
            await self.store.set_state(name, vid, self.states[name][vid])
            if vid in self.cluster_split(name):
                await self._apply(name, self._local(name, self.cluster_split(name)))
            self._publish()
            return vid

    async def _load(self, name: str, version: str, warm: bool, cpu_threads_bind: str | None = None) -> str:
        cfg = self.configs[name]
        existing = [v for v in self.runtimes.get(name, {}) if v.startswith(version)]
        if len(existing) == 1:
            return existing[0]
        vcfg = cfg.model_copy(update={"version": version})
        if cpu_threads_bind:
            vcfg.engine = cfg.engine.model_copy(update={"cpu_threads_bind": cpu_threads_bind})
        t0 = time.monotonic()
        try:
            backend = await build_backend(vcfg, self.weights)
        except Exception as e:
            raise RegistryError(f"cannot load {name}@{version}: {e}", 400) from None
        if backend.version in self.runtimes.get(name, {}):  # another spelling of a loaded one: keep that one
            return backend.version
        await backend.start()
        rt = self._make_runtime(vcfg, backend)
        if warm:
            await warm_up(rt)
        if await backend.sleep():  # standby costs no accelerator memory where sleep mode exists
            self.asleep.setdefault(name, set()).add(backend.version)
        self.runtimes.setdefault(name, {})[backend.version] = rt
        self.states.setdefault(name, {})[backend.version] = "standby"
        log.info("version_loaded", model=name, version=backend.version, seconds=round(time.monotonic() - t0, 2))
        return backend.version

    async def set_split(self, name: str, weights: dict[str, float], note: str | None = None) -> dict[str, float]:
        """Route by these weights from the next request on (versions by id or unique prefix)."""
        async with self._lock:
            full = {self.resolve(name, v): float(w) for v, w in weights.items()}
            for v in full:
                if self.states[name].get(v) not in ("active", "standby", "pool"):
                    raise RegistryError(f"{name}@{v[:12]} is {self.states[name].get(v)}; load it first")
            return await self._set(name, full, note)

    async def _set(self, name: str, full: dict[str, float], note: str | None) -> dict[str, float]:
        try:
            Split.of(full)
        except ValueError as e:
            raise RegistryError(str(e), 400) from None
        current = self.splits.get(name)
        await self._commit(name, full, note, self._tick(), self.node, current.weights if current else None)
        log.info("split_changed", model=name, weights={v[:12]: w for v, w in full.items()}, note=note,
                 revision=self.revision)
        return full

    async def rollback(self, name: str) -> dict[str, float]:
        """Restore the split before the current one: one registry write. In a cluster that is
        the split the current one replaced (the same on every node), even where a version of
        it is not loaded here (peers serve that part)."""
        self._model(name)
        current = self.splits.get(name)
        if current is not None and current.previous is not None:
            if self.clustered:
                async with self._lock:
                    return await self._set(name, current.previous, f"rollback of split {current.id}")
            return await self.set_split(name, current.previous, note=f"rollback of split {current.id}")
        rows = await self.store.splits(name, 2)
        if len(rows) < 2:
            raise RegistryError(f"model {name!r} has no earlier split to roll back to")
        return await self.set_split(name, rows[1].weights, note=f"rollback of split {rows[0].id}")

    # -- across nodes (llmd/cluster/registry_sync.py) ----------------------------------------
    def cluster_split(self, model: str) -> dict[str, float]:
        """The split as the cluster agreed it (versions this node may not hold included)."""
        return dict(row.weights) if (row := self.splits.get(model)) is not None else {}

    async def merge(self, name: str, row: SplitRow) -> bool:
        """A peer's split: applied if it is newer (last writer wins). A configured default
        (revision 0) never travels; a model not configured here is not ours to keep."""
        if name not in self.runtimes or row.rev <= 0:
            return False
        Split.of(row.weights)  # a malformed one raises before anything changes
        async with self._lock:
            current = self.splits.get(name)
            if current is not None and row.order <= current.order:
                return False
            await self._commit(name, dict(row.weights), row.note, row.rev, row.origin, row.previous)
        log.info("split_merged", model=name, weights={v[:12]: w for v, w in row.weights.items()}, origin=row.origin)
        return True

    async def set_promoted(self, name: str, up: bool) -> list[str]:
        """Warm pool: route to this model's pool versions here (woken first) or stop. Only
        versions in the cluster split are promoted: more places serve the same weights."""
        async with self._lock:
            split, up_now = self.cluster_split(name), self.promoted.get(name, set())
            if not (changed := sorted(self.pool.get(name, set()) & set(split) - up_now if up else up_now)):
                return []
            self.promoted[name] = up_now | set(changed) if up else set()
            await self._apply(name, self._local(name, split))
            self._publish()
        log.info("warm_pool_promoted" if up else "warm_pool_demoted", model=name, versions=[v[:12] for v in changed])
        return changed

    async def settle(self, name: str) -> list[str]:
        """Put demoted pool versions back to sleep once their last request ended."""
        done = []
        for v in self.pool.get(name, set()) - self.promoted.get(name, set()) - self.asleep.get(name, set()):
            rt = self.runtimes[name].get(v)
            if rt is not None and not rt.in_flight and self.states[name].get(v) == "pool" and await rt.backend.sleep():
                self.asleep.setdefault(name, set()).add(v)
                done.append(v)
        return done

    async def drain(self, name: str, version: str, timeout_s: float) -> dict[str, Any]:
        """No new requests for this version; wait (up to `timeout_s`) for the ones it has to
        finish. Nothing is killed: what is left after the timeout keeps running."""
        async with self._lock:
            vid = self.resolve(name, version)
            if self._weights.get(name, {}).get(vid, 0) > 0:
                raise RegistryError(f"{name}@{vid[:12]} is in the split; move its traffic away first")
            self.states[name][vid] = "draining"
            await self.store.set_state(name, vid, "draining")
            self._publish()
        rt = self.runtimes[name][vid]
        end = time.monotonic() + timeout_s
        while rt.in_flight and time.monotonic() < end:  # noqa: ASYNC110 - no event fires when a version empties
            await asyncio.sleep(0.05)
        left = rt.in_flight
        if not left and vid not in self.asleep.get(name, set()) and await rt.backend.sleep():
            self.asleep.setdefault(name, set()).add(vid)
        log.info("version_drained", model=name, version=vid, left=left)
        return {"version": vid, "in_flight": left, "drained": left == 0}

    async def unload(self, name: str, version: str, timeout_s: float) -> dict[str, Any]:
        """Drain, then stop the engine. The configured version stays loaded."""
        vid = self.resolve(name, version)
        if vid == self.configured.get(name):
            raise RegistryError(f"{name}@{vid[:12]} is the configured version; change the config to drop it")
        out = await self.drain(name, vid, timeout_s)
        if not out["drained"]:
            raise RegistryError(f"{name}@{vid[:12]} still has {out['in_flight']} requests after {timeout_s} s; "
                                "it stays loaded (draining)")
        async with self._lock:
            rt = self.runtimes[name].pop(vid)
            self.states[name].pop(vid, None)
            for held in (self.asleep, self.pool, self.promoted):
                held.get(name, set()).discard(vid)
            await self.store.set_state(name, vid, "unloaded")
            self._publish()
        await rt.stop()
        return out

    def describe(self, name: str) -> dict[str, Any]:
        rts = self._model(name)
        weights = self._weights.get(name, {})
        row = self.splits.get(name)
        return {"model": name, "split": dict(weights.items()), "cluster_split": self.cluster_split(name),
                "revision": row.rev if row else 0, "origin": row.origin if row else None,
                "versions": [{"version": v, "state": self.states[name].get(v), "weight": weights.get(v, 0.0),
                              "asleep": v in self.asleep.get(name, set()), "pool": v in self.pool.get(name, set()),
                              "configured": v == self.configured.get(name), "in_flight": rt.in_flight,
                              "ready": rt.ready} for v, rt in rts.items()]}


__all__ = ["Registry", "RegistryError", "RoutingError"]
