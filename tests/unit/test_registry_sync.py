"""The registry across nodes: two (or three) real registries (fake engines over stored versions
with different content hashes, real SQLite), each merging the other's snapshot as the gossip
would have it fetched: splits and rollbacks travel, concurrent changes converge by last writer
wins, a split naming a version a node lacks never runs its requests on other weights there,
and the revisions survive a restart. Then the same over real HTTP: two servers with the
cluster on, the snapshot route signed (401 otherwise)."""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.lib.servers import tiny_versions
from llmd.cluster.registry_sync import RegistrySync
from llmd.cluster.signing import Signer
from llmd.config import Config
from llmd.registry.registry import Registry
from llmd.registry.routing import NotServedHere, Split, unit_point
from llmd.registry.store import RegistryStore
from llmd.runtime import build_runtime
from llmd.store import WeightStore

SECRET = "s" * 32
MODELS = """
[[models]]
name = "{name}"
source = "tiny"
version = "{version}"
backend = "fake"
[models.fake]
step_ms = 1
step_ms_per_seq = 0.0
"""


@pytest.fixture
def store(tmp_path: Path, smollm2_path: Path) -> tuple[WeightStore, list[str]]:
    """Three stored versions of a tiny model (different weight bytes, so different hashes)."""
    return tiny_versions(tmp_path / "home", (b"weights v1", b"weights v2", b"weights v3"))


class Clock:
    """Wall time in ns, set by the test (a node whose clock lags, ties)."""

    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


Make = Callable[..., Awaitable[Registry]]


@pytest.fixture
async def make(tmp_path: Path, store: tuple[WeightStore, list[str]]) -> AsyncIterator[Make]:
    """A started registry named `node` (its SQLite under tmp_path/node), models m (and n)."""
    ws, versions = store
    made: list[Registry] = []

    async def _make(node: str, clock: Callable[[], int] | None = None, models: tuple[str, ...] = ("m",),
                    clustered: bool = True) -> Registry:
        toml = "".join(MODELS.format(name=m, version=versions[0][:12]) for m in models)
        cfg = Config.model_validate(tomllib.loads(toml))
        kwargs: dict[str, Any] = {"clock_ns": clock} if clock is not None else {}
        reg = Registry(cfg.models, RegistryStore(tmp_path / node / "registry.db"), ws,
                       lambda c, b: build_runtime(c, b, cfg.tenants), node=node, clustered=clustered, **kwargs)
        await reg.store.start()
        await reg.load_configured()
        await reg.restore()
        made.append(reg)
        return reg

    yield _make
    for reg in made:
        if reg.runtimes:
            await reg.stop()


def over_json(reg: Registry) -> Callable[[str], Awaitable[dict[str, Any]]]:
    """A fetch that reads `reg`'s snapshot the way a peer gets it: as JSON."""
    async def fetch(url: str) -> dict[str, Any]:
        return json.loads(json.dumps(RegistrySync(reg, fetch).snapshot()))
    return fetch


async def sync(to: Registry, src: Registry) -> list[str]:
    """`to` hears `src`'s gossiped revision and merges its registry."""
    return await RegistrySync(to, over_json(src)).on_peer_rev(src.node, src.revision)


def routed(reg: Registry, model: str = "m", n: int = 400) -> dict[str, str | None]:
    """Where n conversations go on this node: a version id, or None when refused here."""
    out: dict[str, str | None] = {}
    for i in range(n):
        try:
            out[f"c{i}"] = reg.route(model, f"c{i}", None).backend.version
        except NotServedHere:
            out[f"c{i}"] = None
    return out


async def test_a_split_on_a_reaches_b_and_a_rollback_on_b_reaches_a(make: Make, store) -> None:
    _, (v1, v2, _) = store
    a, b = await make("a"), await make("b")
    for reg in (a, b):
        await reg.load("m", v2, warm=False)
    await a.set_split("m", {v1: 90, v2: 10}, note="canary")
    assert b.cluster_split("m") == {v1: 1.0}
    assert await sync(b, a) == ["m"]
    assert b.cluster_split("m") == {v1: 90.0, v2: 10.0} and b.splits["m"].rev == a.splits["m"].rev
    assert b.splits["m"].origin == "a" and b.splits["m"].note == "canary" and b.revision >= a.revision
    assert routed(b) == routed(a) and set(routed(b).values()) == {v1, v2}  # same conversations, same versions
    # Two changes on a before b hears of them: b's own history skips the first, yet the
    # rollback made on b restores what the current split replaced, as it would on a.
    await a.set_split("m", {v1: 50, v2: 50})
    await a.set_split("m", {v2: 1})
    await sync(b, a)
    await b.rollback("m")
    assert b.cluster_split("m") == {v1: 50.0, v2: 50.0}
    assert await sync(a, b) == ["m"]
    assert a.cluster_split("m") == {v1: 50.0, v2: 50.0} and set(routed(a).values()) == {v1, v2}
    assert a.describe("m")["revision"] == b.splits["m"].rev and a.splits["m"].origin == "b"
    # Nothing newer: nothing applied, either way.
    assert await sync(a, b) == [] and await sync(b, a) == []


async def test_concurrent_changes_converge_by_last_writer_wins_whatever_the_order(make: Make, store) -> None:
    _, (v1, v2, _) = store
    a, b = await make("a", Clock(2_000)), await make("b", Clock(1_000))  # b's clock lags a's
    for reg in (a, b):
        await reg.load("m", v2, warm=False)
    await a.set_split("m", {v2: 1})
    await b.set_split("m", {v1: 1, v2: 1})  # later in real time, but an older revision
    await sync(a, b)
    await sync(b, a)
    assert a.cluster_split("m") == b.cluster_split("m") == {v2: 1.0}
    assert a.splits["m"].order == b.splits["m"].order == (2_000, "a")
    # Having seen a's revision, b's next change outranks it although b's clock still lags.
    await b.set_split("m", {v1: 1})
    assert b.splits["m"].rev > 2_000
    await sync(a, b)
    assert a.cluster_split("m") == {v1: 1.0}
    # A tie on the revision: the greater node name wins, on both.
    c = await make("c", Clock(b.revision + 10))
    d = await make("d", Clock(b.revision + 10))
    for reg in (c, d):
        await reg.load("m", v2, warm=False)
    await c.set_split("m", {v2: 3, v1: 1})
    await d.set_split("m", {v2: 1, v1: 3})
    await sync(c, d)
    await sync(d, c)
    assert c.cluster_split("m") == d.cluster_split("m") == {v2: 1.0, v1: 3.0}


async def test_a_change_with_an_older_revision_on_another_model_still_travels(make: Make, store) -> None:
    """Why a node fetches when a peer's revision *changed*, not only when it is newer than its
    own: b's clock lags, so its split of model n has a lower revision than a's registry."""
    _, (v1, v2, _) = store
    a, b = await make("a", Clock(5_000), ("m", "n")), await make("b", Clock(1_000), ("m", "n"))
    fetches: list[str] = []

    async def fetch(url: str) -> dict[str, Any]:
        fetches.append(url)
        return await over_json(b)(url)

    a_hears_b = RegistrySync(a, fetch)
    assert await a_hears_b.on_peer_rev("b", b.revision) == []  # first sight: fetched once
    assert await a_hears_b.on_peer_rev("b", b.revision) == [] and len(fetches) == 1  # unchanged: not again
    for reg in (a, b):
        await reg.load("n", v2, warm=False)
    await a.set_split("m", {v1: 2})
    await b.set_split("n", {v2: 1})
    assert b.revision < a.revision
    assert await a_hears_b.on_peer_rev("b", b.revision) == ["n"]
    assert a.cluster_split("n") == {v2: 1.0} and a.cluster_split("m") == {v1: 2.0}


async def test_a_split_naming_a_version_b_lacks_never_runs_b_requests_on_other_weights(make: Make, store) -> None:
    _, (v1, _, v3) = store
    a, b = await make("a"), await make("b")
    await a.load("m", v3, warm=False)
    await a.set_split("m", {v1: 1, v3: 1})
    await sync(b, a)
    assert b.cluster_split("m") == {v1: 1.0, v3: 1.0}  # the cluster's split is kept whole
    cluster = Split.of(b.cluster_split("m"))
    where = routed(b)
    # A conversation the split gives v3 is refused on b (a peer serves it); every other runs on v1.
    assert where == {k: (v1 if cluster.pick(unit_point(k)) == v1 else None) for k in where}
    assert None in where.values() and v1 in where.values()
    assert b.describe("m")["split"] == {v1: 1.0}  # the local part
    # A request with no conversation to keep is drawn among the versions served here.
    assert {b.route("m", None, None).backend.version for _ in range(50)} == {v1}
    # All of it on v3: nothing runs here at all (not the configured v1 either).
    await a.set_split("m", {v3: 1})
    await sync(b, a)
    assert set(routed(b).values()) == {None}
    with pytest.raises(NotServedHere):
        b.route("m", None, None)
    # Once b loads v3 it serves its share.
    await b.load("m", v3, warm=False)
    assert set(routed(b).values()) == {v3}


def _retemplated(ws: WeightStore, like: str, payload: bytes) -> str:
    """Another version of `tiny` whose chat template differs from `like`'s (its own weights too)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        shutil.copytree(ws.resolve("tiny", like).path, src)
        (src / "llmd-manifest.json").unlink()
        (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
        (src / "model.safetensors").write_bytes(payload)
        return ws.add_hf_dir(src, "tiny", "test:retemplated").version


async def test_a_version_only_peers_serve_is_rendered_by_a_local_one_with_its_tokenizer_or_refused(
        make: Make, store) -> None:
    """The split gives a conversation a version only a peer serves: this node renders and counts
    its prompt with a version it serves. Only one with the same tokenizer and template will do
    (token ids are the text only under the tokenizer that made them); with none, a clear 503.
    The executor refuses ids made by another tokenizer than its copy's (the same weights stored
    with another template), as 'not here', so the ingress tries elsewhere."""
    from llmd.cluster.executor import runtime_for
    from llmd.cluster.wire import RunRequest
    from llmd.errors import APIError
    from llmd.service import Service

    ws, (v1, _, v3) = store
    v4 = _retemplated(ws, v1, b"weights v4")
    v5 = _retemplated(ws, v1, b"weights v5")
    a, b = await make("a"), await make("b")
    for v in (v3, v4):
        await a.load("m", v, warm=False)
    ids = {v: rt.backend.tokenizer_id for v, rt in a.versions("m").items()}
    assert ids[v1] == ids[v3] != ids[v4] and all(ids.values())
    service = Service("b", b, None, None, {}, None)  # type: ignore[arg-type]  # locate reads the registry only
    service.router = object()  # type: ignore[assignment]  # a cluster: peers run what b does not serve
    service.peer_tokenizer = lambda model, version: ids.get(version)
    await a.set_split("m", {v3: 1, v4: 1})
    await sync(b, a)
    cluster = Split.of(b.cluster_split("m"))
    picks = {k: cluster.pick(unit_point(k)) for k in (f"c{i}" for i in range(40))}
    assert set(picks.values()) == {v3, v4}
    for key, picked in picks.items():
        if picked == v3:  # v1 renders as v3 does: served by a peer, prepared here on v1
            rt, version = service.locate("m", None, key)
            assert (rt.version, version) == (v1, v3)
            continue
        with pytest.raises(APIError) as e:
            service.locate("m", None, key)
        assert (e.value.status, e.value.code) == (503, "version_not_served_here")
        assert "tokenizer or chat template" in e.value.message
    await b.load("m", v5, warm=False)  # v5 renders as v4: it prepares v4's requests
    key = next(k for k, v in picks.items() if v == v4)
    rt, version = service.locate("m", None, key)
    assert (rt.version, version) == (v5, v4)
    v6 = _retemplated(ws, v1, b"weights v6")
    await b.load("m", v6, warm=False)
    b.versions("m")[v5].backend.kill()  # a dead renderer is passed over for a ready one
    assert service.locate("m", None, key)[0].version == v6
    b.versions("m")[v6].backend.kill()  # none ready: wait, as for a loading model
    with pytest.raises(APIError) as e:
        service.locate("m", None, key)
    assert (e.value.status, e.value.code) == (503, "model_loading")

    def run_request(tokenizer: str) -> RunRequest:
        return RunRequest(request_id="r", engine_id="e", tenant="default", klass="interactive", model="m",
                          version=v4, prompt_token_ids=[1, 2], sampling={}, seconds_left=5, tokenizer=tokenizer)

    assert runtime_for(a, run_request(ids[v4])).version == v4
    assert runtime_for(a, run_request("")).version == v4  # an ingress that does not say: as before
    with pytest.raises(APIError) as e:
        runtime_for(a, run_request(ids[v1]))
    assert (e.value.status, e.value.code) == (404, "tokenizer_mismatch")


async def test_revisions_and_the_cluster_split_survive_a_restart(make: Make, store) -> None:
    _, (v1, _, v3) = store
    a, b = await make("a"), await make("b")
    await a.load("m", v3, warm=False)
    await a.set_split("m", {v3: 1})
    await sync(b, a)
    rev, revision = b.splits["m"].rev, b.revision
    await b.stop()
    again = await make("b")
    assert again.revision == revision and again.splits["m"].rev == rev and again.splits["m"].origin == "a"
    assert again.cluster_split("m") == {v3: 1.0}
    assert set(routed(again).values()) == {None}  # not fallen back to the configured version
    # Alone (no cluster), the old rule holds: nothing loaded serves the split, the configured version does.
    await again.stop()
    alone = await make("b", clustered=False)
    assert set(routed(alone).values()) == {v1}
    assert alone.splits["m"].rev == 0 and alone.splits["m"].note == "configured version"


async def test_a_configured_default_does_not_travel_and_a_bad_peer_changes_nothing(make: Make, store) -> None:
    _, (v1, v2, _) = store
    z, b = await make("z"), await make("b")
    await b.load("m", v2, warm=False)
    # z's split is its configured default (revision 0): a node's config is its own, it never
    # travels (or nodes configured with different versions would take each other's).
    assert await sync(b, z) == [] and b.splits["m"].origin == "b"

    async def garbled(url: str) -> dict[str, Any]:
        return {"node": "x", "revision": 9, "models": {"m": {"weights": {v1: -1}, "rev": 10**20, "origin": "x"},
                                                       "zz": {"weights": "no"}}}

    async def down(url: str) -> dict[str, Any]:
        raise httpx.ConnectError("refused")

    assert await RegistrySync(b, garbled).on_peer_rev("x", 9) == []
    sync_down = RegistrySync(b, down)
    assert await sync_down.on_peer_rev("y", 3) == [] and sync_down.failures == 1 and "y" not in sync_down.fetched
    assert b.cluster_split("m") == {v1: 1.0}


# -- over HTTP: two servers with the cluster on ------------------------------------------------
CLUSTER_TOML = """
[server]
node = "{node}"
db_path = "{db}"
[cluster]
enabled = true
gossip_port = 0
secret_files = ["{secret}"]
[[models]]
name = "m"
source = "tiny"
version = "{version}"
backend = "fake"
[models.fake]
step_ms = 1
step_ms_per_seq = 0.0
"""


async def test_over_signed_http_a_split_on_a_reaches_b_and_unsigned_calls_are_refused(
        make_server, tmp_path: Path, store) -> None:
    ws, (v1, _, v3) = store
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    live = {}
    for node in ("a", "b"):
        toml = CLUSTER_TOML.format(node=node, db=tmp_path / f"{node}.db", secret=secret, version=v1[:12])
        live[node] = await make_server(toml, ws)
    signer = Signer("b", [SECRET.encode()], time.time, purpose="http")

    async def fetch(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url) as h:
            r = await h.get("/internal/v1/registry", headers=signer.headers("GET", "/internal/v1/registry", to="a"))
            r.raise_for_status()
            return dict(r.json())

    a, b = live["a"].node.registry, live["b"].node.registry
    await a.load("m", v3, warm=False)
    await a.set_split("m", {v1: 1, v3: 1})
    assert await RegistrySync(b, fetch).on_peer_rev(live["a"].url, a.revision) == ["m"]
    assert b.cluster_split("m") == {v1: 1.0, v3: 1.0}
    # b's own clients: v3's conversations are refused with a clear 503, the rest served by v1.
    c = openai.AsyncOpenAI(base_url=live["b"].base, api_key="x", max_retries=0, timeout=30)
    cluster, served, refused = Split.of(b.cluster_split("m")), set(), []
    for i in range(30):
        ask = c.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_headers={"X-Conversation-Id": f"c{i}"})
        if cluster.pick(unit_point(f"c{i}")) == v1:
            served.add((await ask).headers["x-llmd-model-version"])
            continue
        with pytest.raises(openai.APIStatusError) as e:
            await ask
        refused.append((e.value.status_code, e.value.body["code"]))
    assert served == {v1} and refused and set(refused) == {(503, "version_not_served_here")}
    async with httpx.AsyncClient(base_url=live["a"].url) as h:
        r = await h.get("/internal/v1/registry")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_signature"
        forged = Signer("b", [b"o" * 32], time.time, purpose="http")
        r = await h.get("/internal/v1/registry", headers=forged.headers("GET", "/internal/v1/registry"))
        assert r.status_code == 401


async def test_a_registry_store_from_before_revisions_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.registry.db"
    with sqlite3.connect(path) as db:  # the schema as it was before revisions
        db.executescript("""CREATE TABLE splits (id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL,
                            weights TEXT NOT NULL, created_at REAL NOT NULL, note TEXT);
                            INSERT INTO splits (model, weights, created_at, note)
                            VALUES ('m', '{"v1": 1.0}', 1, 'x');""")
    st = RegistryStore(path)
    await st.start()
    try:
        old = (await st.splits("m", 1))[0]
        assert (old.weights, old.rev, old.origin, old.previous) == ({"v1": 1.0}, 0, "", None)
        await st.add_split("m", {"v2": 1.0}, "y", 7, "a", {"v1": 1.0})
        new = (await st.splits("m", 1))[0]
        assert (new.rev, new.origin, new.previous) == (7, "a", {"v1": 1.0}) and await st.revision() == 0
    finally:
        await st.stop()
