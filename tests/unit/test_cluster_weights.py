"""Weights from peers: a version is pulled in hash-checked chunks from two real llmd servers
at once, a corrupted chunk is refetched from the other peer, unsigned calls are refused, and an
interrupted pull (cancelled, or its process killed) leaves no model in the store."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmd.cluster import manifest as manifest_module
from llmd.cluster.signing import Signer
from llmd.cluster.weights import STAGING_PREFIX, PullError, WeightServer, chunk_path, manifest_path, pull
from llmd.store import WeightStore
from tests.conftest import async_wait_until, free_port

SECRET, OTHER = b"weights-secret-0123456789", b"another-secret-0123456789"
CHUNK = 16 * 1024  # small chunks: the fake model has dozens of them
REPO = Path(__file__).resolve().parents[2]


def fake_model(root: Path) -> Path:
    """A Hugging Face-shaped folder: two weight shards (not a multiple of CHUNK) and the extras."""
    d = root / "src"
    d.mkdir()
    rng = random.Random(7)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "model-00001-of-00002.safetensors").write_bytes(rng.randbytes(10 * CHUNK + 123))
    (d / "model-00002-of-00002.safetensors").write_bytes(rng.randbytes(5 * CHUNK) + bytes(2 * CHUNK))
    return d


def node_toml(node: str, secret_file: Path) -> str:
    return f"""
[server]
node = "{node}"
[cluster]
enabled = true
gossip_port = 0
secret_files = ["{secret_file}"]
[[models]]
name = "fake"
backend = "fake"
"""


@dataclass
class Peers:
    a: Any  # LiveServer
    b: Any
    store_a: WeightStore
    store_b: WeightStore
    version: str
    src: Path


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_module, "CHUNK_BYTES", CHUNK)


@pytest.fixture
async def peers(make_server: Any, tmp_path: Path, small_chunks: None) -> Peers:
    """Two real llmd servers (fake backend, cluster on), each with its own store holding the model."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    src = fake_model(tmp_path)
    stores = [WeightStore(tmp_path / name) for name in ("a", "b")]
    version = {s.import_path(src, "tiny").version for s in stores}.pop()
    a = await make_server(node_toml("a", secret), stores[0])
    b = await make_server(node_toml("b", secret), stores[1])
    return Peers(a, b, stores[0], stores[1], version, src)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


A = "a"  # the node the direct calls below are signed for


def signer(secret: bytes = SECRET) -> Signer:
    return Signer("c", [secret], time.time, purpose="http")


def staging_dirs(store: WeightStore) -> list[Path]:
    return list(store.root.glob(f"{STAGING_PREFIX}*")) if store.root.is_dir() else []


async def test_a_version_is_pulled_from_both_peers_at_once_and_verifies(peers: Peers, http: httpx.AsyncClient,
                                                                       tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "c")
    seen: list[tuple[int, int]] = []
    res = await pull(peers.version, [peers.a.url, peers.b.url], http, signer(), store=store,
                     progress=lambda done, total: seen.append((done, total)))
    m = res.model
    assert m.version == peers.version and m.name == "tiny" and not res.already_stored
    store.verify(m)  # re-hashes: the pulled weights are the version they claim to be
    for f in peers.src.iterdir():
        assert (m.path / f.name).read_bytes() == f.read_bytes()
    # 1 + 11 + 7 + 1 chunks, two of them equal (zero padding): 19 distinct ones, fetched once each.
    assert res.chunks == 19 and sum(res.chunks_by_peer.values()) == 19 and not res.failures
    assert res.chunks_by_peer[peers.a.url] >= 3 and res.chunks_by_peer[peers.b.url] >= 3
    assert seen[-1][0] == seen[-1][1] == m.size_bytes
    assert [x.version for x in store.list()] == [peers.version] and not staging_dirs(store)
    again = await pull(peers.version, [peers.a.url], http, signer(), store=store)
    assert again.already_stored and again.chunks == 0


async def test_a_corrupted_chunk_is_refetched_from_the_other_peer(peers: Peers, http: httpx.AsyncClient,
                                                                  tmp_path: Path) -> None:
    # A computes its manifest from good weights, then its disk rots: a byte flipped in every
    # chunk of the first shard. A still serves (it does not re-hash per chunk); the puller must catch it.
    ws = WeightServer(peers.store_a)
    ws.manifest_bytes(peers.version)
    shard = peers.store_a.resolve("tiny").path / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    for at in range(100, len(data), CHUNK):
        data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    with (shard.parent / "model-00002-of-00002.safetensors").open("r+b") as f:
        f.truncate(3 * CHUNK + 10)  # and the second shard lost its tail: short chunks, cut connections

    store = WeightStore(tmp_path / "c")
    res = await pull(peers.version, [peers.a.url, peers.b.url], http, signer(), store=store, max_peer_failures=100)
    store.verify(res.model)
    assert res.model.version == peers.version
    assert res.failures[(peers.a.url, "sha256_mismatch")] >= 1 and not res.failures[(peers.b.url, "sha256_mismatch")]
    # Dropped for the bad chunks only: A still serves good ones after them (the second shard's head).
    assert res.chunks_by_peer[peers.a.url] >= 2
    assert sum(n for (p, why), n in res.failures.items() if p == peers.a.url and why != "sha256_mismatch") >= 1
    assert res.chunks_by_peer[peers.b.url] >= 11  # every chunk of the rotten shard came from B

    # With only the rotten peer, the pull fails and stores nothing.
    lone = WeightStore(tmp_path / "d")
    with pytest.raises(PullError, match="could not be fetched from any peer"):
        await pull(peers.version, [peers.a.url], http, signer(), store=lone)
    assert lone.list() == [] and not staging_dirs(lone)


async def test_a_dead_peer_is_dropped_and_the_others_supply_everything(peers: Peers, http: httpx.AsyncClient,
                                                                       tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    store = WeightStore(tmp_path / "c")
    res = await pull(peers.version, [dead, peers.a.url, peers.b.url], http, signer(), store=store)
    store.verify(res.model)
    failed = sum(n for (p, _), n in res.failures.items() if p == dead)
    # Dropped after 3 failures; at most the 4 fetches already in flight fail on top of the first 2.
    assert res.chunks_by_peer[dead] == 0 and 3 <= failed <= 6


async def test_unsigned_forged_and_replayed_calls_get_401_unknown_ones_404(peers: Peers,
                                                                         http: httpx.AsyncClient) -> None:
    path = manifest_path(peers.version)
    url = peers.a.url + path
    unsigned = await http.get(url)
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "invalid_signature"
    forged = await http.get(url, headers=signer(OTHER).headers("GET", path, to=A))
    assert forged.status_code == 401 and forged.json()["error"]["code"] == "invalid_signature"
    headers = signer().headers("GET", path, to=A)
    ok = await http.get(url, headers=headers)
    assert ok.status_code == 200 and ok.json()["version"] == peers.version
    assert (await http.get(url, headers=headers)).status_code == 401  # the same signature again: a replay
    sha = ok.json()["files"][0]["chunks"][0]["sha256"]
    cpath = chunk_path(peers.version, sha)
    assert (await http.get(peers.a.url + cpath)).status_code == 401
    got = await http.get(peers.a.url + cpath, headers=signer().headers("GET", cpath, to=A))
    assert got.status_code == 200 and got.content == (peers.src / "config.json").read_bytes()
    for p in (manifest_path("f" * 64), chunk_path(peers.version, "0" * 64), manifest_path("../../etc")):
        r = await http.get(peers.a.url + p, headers=signer().headers("GET", p, to=A))
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", p


async def test_a_cancelled_pull_leaves_nothing_in_the_store(peers: Peers, http: httpx.AsyncClient,
                                                            tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "c")
    chunks_written = 0

    def progress(done: int, total: int) -> None:
        nonlocal chunks_written
        chunks_written += 1
        if chunks_written == 5:
            task.cancel()

    task = asyncio.create_task(pull(peers.version, [peers.a.url, peers.b.url], http, signer(), store=store,
                                    progress=progress))
    with pytest.raises(asyncio.CancelledError):
        await task
    # >= 5: a worker already past its await may land one more chunk before the cancel reaches it.
    assert chunks_written >= 5 and store.list() == [] and not staging_dirs(store)
    assert not (store.root / "tiny").exists()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[int]]]:
    """Peers serve 4 chunks, then hold every further one until the event is set."""
    release, served = threading.Event(), [0]
    serve = WeightServer.serve_chunk

    def held(self: WeightServer, version: str, sha: str) -> Any:
        served[0] += 1
        if served[0] > 4:
            release.wait(60)
        return serve(self, version, sha)

    monkeypatch.setattr(WeightServer, "serve_chunk", held)
    yield release, served
    release.set()


async def test_a_pull_killed_mid_way_leaves_no_model_and_the_next_pull_sweeps_its_leftovers(
        peers: Peers, http: httpx.AsyncClient, tmp_path: Path, gate: tuple[threading.Event, list[int]]) -> None:
    release, served = gate
    home = tmp_path / "c-home"
    env = {**os.environ, "LLMD_HOME": str(home), "LLMD_CLUSTER_SECRET": SECRET.decode(), "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmd", "models", "pull-peer", f"tiny@{peers.version}", "--peer", peers.a.url,
        "--peer", peers.b.url, "--config", str(tmp_path / "none.toml"), env=env, cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert await async_wait_until(lambda: served[0] >= 6, timeout=120)  # 4 written, the rest held
    finally:
        proc.kill()
        await proc.wait()
    release.set()
    store = WeightStore(home)
    left = staging_dirs(store)
    assert store.list() == [] and len(left) == 1 and not (store.root / "tiny").exists()
    res = await pull(peers.version, [peers.a.url, peers.b.url], http, signer(), store=store)
    store.verify(res.model)
    assert not staging_dirs(store) and [m.version for m in store.list()] == [peers.version]


async def test_the_cli_pulls_from_both_peers(peers: Peers, tmp_path: Path) -> None:
    home = tmp_path / "c-home"
    env = {**os.environ, "LLMD_HOME": str(home), "LLMD_CLUSTER_SECRET": SECRET.decode(), "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmd", "models", "pull-peer", f"copy@{peers.version}", "--peer", peers.a.url,
        "--peer", peers.b.url, "--config", str(tmp_path / "none.toml"), env=env, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert f"stored copy@{peers.version[:12]}" in text and f"{peers.a.url}: " in text
    m = WeightStore(home).resolve("copy")
    WeightStore(home).verify(m)
    bad = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmd", "models", "pull-peer", "copy@abc", "--peer", peers.a.url,
        env=env, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await bad.communicate()
    assert bad.returncode == 2 and b"NAME@VERSION" in err


class Tamper(httpx.AsyncBaseTransport):
    """Real HTTP underneath; a man in the middle rewrites what the manifest says."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        r = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/manifest"):
            return r
        body = (await r.aread()).replace(b'"source": "hf:', b'"source": "evil:')
        return httpx.Response(r.status_code, headers=[(k, v) for k, v in r.headers.items()
                                                       if k.lower() != "content-length"], content=body)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_manifest_altered_in_transit_is_refused(peers: Peers, tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "c")
    async with httpx.AsyncClient(transport=Tamper(), timeout=30) as tampered:
        with pytest.raises(PullError, match="manifest not signed by a member"):
            await pull(peers.version, [peers.a.url, peers.b.url], tampered, signer(), store=store)
    assert store.list() == [] and not staging_dirs(store)


def test_building_one_manifest_does_not_hold_up_another_versions_chunks(tmp_path: Path, small_chunks: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store = WeightStore(tmp_path / "a")
    first = store.import_path(fake_model(tmp_path), "tiny")
    other_src = tmp_path / "other"
    other_src.mkdir()
    (other_src / "config.json").write_text("{}")
    (other_src / "model.safetensors").write_bytes(b"\1" * (3 * CHUNK))
    second = store.import_path(other_src, "other")
    ws = WeightServer(store)
    sha = manifest_module.Manifest.model_validate_json(ws.manifest_bytes(first.version)).files[0].chunks[0].sha256
    entered, release = threading.Event(), threading.Event()
    build = manifest_module.cached_manifest

    def slow(model: Any, chunk_bytes: int) -> Any:
        entered.set()
        release.wait(30)
        return build(model, chunk_bytes)

    monkeypatch.setattr(manifest_module, "cached_manifest", slow)
    t = threading.Thread(target=ws.manifest_bytes, args=(second.version,))
    t.start()
    try:
        assert entered.wait(30)
        served: list[Any] = []
        u = threading.Thread(target=lambda: served.append(ws.serve_chunk(first.version, sha)))
        u.start()
        u.join(30)
        assert served and served[0].length > 0 and not release.is_set()  # served while the other build is held
    finally:
        release.set()
        t.join()
    assert ws.manifest_bytes(second.version)


async def test_a_node_advertises_the_versions_it_stores_and_a_joiner_finds_a_pinned_one_there(peers: Peers) -> None:
    from llmd.cluster.bootstrap import holders
    from llmd.config import ModelConfig

    cluster = peers.a.node.cluster
    state = cluster.state()
    assert state.stored == (peers.version,)  # stored, though what it serves is the fake model
    pinned = ModelConfig(name="tiny", backend="fake", source="tiny", version=peers.version[:12])
    assert holders([state], pinned) == {peers.version: [cluster.url]}
    # unpinned, a stored version id does not say which model it is: only a node serving the model counts
    assert holders([state], ModelConfig(name="tiny", backend="fake", source="tiny")) == {}
    assert holders([state], ModelConfig(name="tiny", backend="fake", source="tiny", version="0" * 12)) == {}


async def test_a_peer_whose_tokenizer_is_not_its_versions_is_not_pulled_from(peers: Peers, http: httpx.AsyncClient,
                                                                             tmp_path: Path) -> None:
    # The id binds every file: A's tokenizer changed on disk (weights intact) makes A's copy
    # another model under that id; A refuses to offer it and the puller takes B's.
    (peers.store_a.resolve("tiny").path / "tokenizer.json").write_text('{"version": "evil"}')
    url = peers.a.url + manifest_path(peers.version)
    r = await http.get(url, headers=signer().headers("GET", manifest_path(peers.version), to=A))
    assert r.status_code == 500 and r.json()["error"]["code"] == "weights_corrupt"
    store = WeightStore(tmp_path / "c")
    res = await pull(peers.version, [peers.a.url, peers.b.url], http, signer(), store=store)
    store.verify(res.model)
    assert (res.model.path / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert res.chunks_by_peer[peers.a.url] == 0


async def test_a_weights_only_version_is_refused_to_peers(peers: Peers, http: httpx.AsyncClient) -> None:
    from tests.unit.test_store import legacy_copy

    old = legacy_copy(peers.store_a, peers.store_a.resolve("tiny"))
    path = manifest_path(old.version)
    r = await http.get(peers.a.url + path, headers=signer().headers("GET", path, to=A))
    assert r.status_code == 409 and r.json()["error"]["code"] == "weights_only_version"
    assert "llmd models import" in r.json()["error"]["message"]


async def test_a_pull_streams_chunks_without_holding_one_whole(make_server: Any, tmp_path: Path,
                                                               http: httpx.AsyncClient) -> None:
    import tracemalloc

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(random.Random(3).randbytes(32 << 20))  # two 16 MiB chunks
    store_a = WeightStore(tmp_path / "a")
    version = store_a.import_path(src, "big").version
    a = await make_server(node_toml("a", secret), store_a)
    WeightServer(store_a).manifest_bytes(version)  # the manifest built (and cached) before the measure
    store = WeightStore(tmp_path / "c")
    tracemalloc.start()
    try:
        res = await pull(version, [a.url], http, signer(), store=store, concurrency=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    store.verify(res.model)
    assert res.chunks == 3  # config.json and the two halves of the weights
    # Two 16 MiB chunks in flight at once, server and puller in this process: together they
    # never hold as much as one chunk (a buffered fetch holds each whole, and a copy of it).
    assert peak < 16 << 20
