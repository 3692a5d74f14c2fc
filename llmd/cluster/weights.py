"""A version's weights pulled from the peers that hold it, not every node from the origin.

The manifest comes from one peer (its response signed with the cluster's HTTP key, and its
files, every one of them, must hash to the version id before anything is fetched); then every chunk is
fetched from all the given peers at once, a small pool of requests spread over the peers
with the fewest in flight. A chunk that fails or does not hash to its sha256 is fetched again
from another peer; that peer is dropped for that chunk only, and for everything once it has
failed `max_peer_failures` times. A chunk is streamed into place a MiB at a time and hashed as
it arrives, never held whole in memory. The files are written into a staging folder inside the
store's root, re-hashed whole, checked against the version id, then renamed into place in one
step: a pull that fails, is cancelled or is killed leaves no model in the store (a killed
one's staging folder is invisible to the store and swept by the next pull).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from llmd.cluster.manifest import (
    CHUNK_BYTES,
    ChunkRef,
    Manifest,
    WeightServer,
    WeightsUnavailable,
    is_version_id,
    plain_name,
)
from llmd.cluster.signing import HEADER_NONCE, Signer
from llmd.store import (
    BINDS_FILES,
    MANIFEST,
    STREAM_BYTES,
    StoredModel,
    StoreError,
    WeightStore,
    sha256_file,
    version_id,
)

__all__ = ["CHUNK_BYTES", "RESPONSE", "STAGING_PREFIX", "ChunkRef", "Manifest", "PullError", "PullResult",
           "WeightServer", "WeightsUnavailable", "chunk_path", "is_version_id", "manifest_path", "pull"]

HELLO_PATH = "/internal/v1/hello"  # unsigned: the node's name, for a caller that knows only its URL
RESPONSE = "RESPONSE"  # the "method" a peer signs its manifest response under (never a request's)
STAGING_PREFIX = ".pull-"
DEFAULT_CONCURRENCY = 4
PullProgress = Callable[[int, int], None]  # (bytes written, bytes in all)


class PullError(StoreError):
    """No peer could supply the version (or a chunk of it), or what they sent does not verify."""


def manifest_path(version: str) -> str:
    return f"/internal/v1/weights/{version}/manifest"


def chunk_path(version: str, sha256: str) -> str:
    return f"/internal/v1/weights/{version}/chunks/{sha256}"


@dataclass
class PullResult:
    model: StoredModel
    already_stored: bool = False
    chunks: int = 0  # distinct chunks fetched
    bytes_by_peer: Counter[str] = field(default_factory=Counter)
    chunks_by_peer: Counter[str] = field(default_factory=Counter)
    failures: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, reason) -> count


async def pull(version: str, peers: list[str], http: httpx.AsyncClient, signer: Signer, *, store: WeightStore,
               name: str | None = None, concurrency: int = DEFAULT_CONCURRENCY, max_peer_failures: int = 3,
               progress: PullProgress | None = None, nodes: Mapping[str, str] | None = None) -> PullResult:
    """Fetch `version` from `peers` (base URLs) into `store`, under `name` (default: the name
    the peer stores it under). Already stored: nothing is fetched. `nodes` names the node at
    each URL (a signed call names its receiver); a URL not in it is asked (`HELLO_PATH`)."""
    if not peers:
        raise PullError("no peers to pull from")
    if not is_version_id(version):
        raise PullError(f"{version!r} is not a version id (64 hex digits)")
    stored = next((m for m in store.list() if m.version == version and (name is None or m.name == name)), None)
    if stored is not None:
        return PullResult(stored, already_stored=True)
    addressed = _Addressed(signer, {p: (nodes or {}).get(p) or await node_at(http, p) for p in peers})
    manifest = await _fetch_manifest(version, peers, http, addressed)
    try:
        name = plain_name(name or manifest.name)
    except ValueError as e:
        raise PullError(f"model name: {e}") from None
    store.root.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(_sweep_stale, store.root)
    if (free := shutil.disk_usage(store.root).free) < manifest.size:
        raise PullError(f"{manifest.name}@{version[:12]} needs {manifest.size / 1e9:.2f} GB; "
                        f"{store.root} has {free / 1e9:.2f} GB free")
    staging = store.root / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        await asyncio.to_thread(_preallocate, staging, manifest)
        fetch = _Fetch(manifest, staging, peers, http, addressed, max_peer_failures, progress)
        async with asyncio.TaskGroup() as tg:
            for _ in range(max(1, concurrency)):
                tg.create_task(fetch.worker())
        model = await asyncio.to_thread(_install, store, staging, manifest, name)
    except* Exception as eg:  # a worker's failure, not the TaskGroup's wrapper, is what callers see
        raise eg.exceptions[0] from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return PullResult(model, False, fetch.chunks, fetch.bytes_by_peer, fetch.chunks_by_peer, fetch.failures)


class _Addressed:
    """A signer and the node at each peer URL: every call is signed for the node it goes to."""

    def __init__(self, signer: Signer, nodes: Mapping[str, str]) -> None:
        self.signer, self.nodes = signer, nodes

    def call(self, peer: str, method: str, path: str) -> dict[str, str]:
        return self.signer.headers(method, path, to=self.nodes[peer])

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes, reply_to: str,
               sender: str) -> str | None:
        return self.signer.verify(method, path, headers, body, reply_to=reply_to, sender=sender)


async def node_at(http: httpx.AsyncClient, url: str) -> str:
    """The name of the node serving at `url` (its unsigned `HELLO_PATH`: names are no secret,
    they travel in every datagram); "" if it does not say (its calls are then refused)."""
    try:
        r = await http.get(url.rstrip("/") + HELLO_PATH, timeout=5.0)
        node = r.json().get("node") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return ""
    return node if isinstance(node, str) else ""


async def _fetch_manifest(version: str, peers: list[str], http: httpx.AsyncClient, signer: _Addressed) -> Manifest:
    """The first peer's manifest that is signed, well formed and hashes to `version`."""
    why: list[str] = []
    for peer in peers:
        url = peer.rstrip("/") + manifest_path(version)
        path = urlsplit(url).path
        headers = signer.call(peer, "GET", path)
        try:
            r = await http.get(url, headers=headers)
        except httpx.HTTPError as e:
            why.append(f"{peer}: {type(e).__name__}")
            continue
        if r.status_code != 200:
            why.append(f"{peer}: HTTP {r.status_code}")
            continue
        if signer.verify(RESPONSE, path, r.headers, r.content, reply_to=headers[HEADER_NONCE],
                         sender=signer.nodes[peer]) is None:
            why.append(f"{peer}: manifest not signed by a member")
            continue
        try:
            m = Manifest.model_validate_json(r.content)
        except ValidationError as e:
            why.append(f"{peer}: malformed manifest ({e.error_count()} errors)")
            continue
        if m.version != version or version_id(m.digests()) != version:
            why.append(f"{peer}: manifest's files do not hash to {version[:12]}")
            continue
        return m
    raise PullError(f"no peer served the manifest of {version[:12]}: " + "; ".join(why))


class _ChunkFailed(Exception):
    """One fetch of one chunk from one peer went wrong; `reason` is counted."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Fetch:
    """The shared work list of one pull; each worker takes the next chunk and the least busy
    peer that has not failed it."""

    def __init__(self, manifest: Manifest, staging: Path, peers: list[str], http: httpx.AsyncClient,
                 signer: _Addressed, max_peer_failures: int, progress: PullProgress | None) -> None:
        self.manifest, self.staging, self.peers, self.http, self.signer = manifest, staging, peers, http, signer
        self.max_peer_failures, self.progress = max_peer_failures, progress
        self.places = manifest.chunk_places()
        self.todo = list(reversed(self.places))  # popped from the end: file order
        self.failed_on: dict[str, set[str]] = {}  # chunk -> peers that failed it
        self.inflight: Counter[str] = Counter()
        self.peer_failures: Counter[str] = Counter()
        self.bytes_by_peer: Counter[str] = Counter()
        self.chunks_by_peer: Counter[str] = Counter()
        self.failures: Counter[tuple[str, str]] = Counter()
        self.chunks = 0
        self.done_bytes, self.total_bytes = 0, manifest.size

    def _pick(self, sha: str) -> str | None:
        ok = [p for p in self.peers if self.peer_failures[p] < self.max_peer_failures
              and p not in self.failed_on.get(sha, ())]
        return min(ok, key=lambda p: (self.inflight[p], self.bytes_by_peer[p]), default=None)

    async def worker(self) -> None:
        while self.todo:
            sha = self.todo.pop()
            peer = self._pick(sha)
            if peer is None:
                tried = ", ".join(f"{p} {why} x{n}" for (p, why), n in self.failures.items()) or "none"
                raise PullError(f"chunk {sha[:12]} of {self.manifest.version[:12]} could not be fetched from any "
                                f"peer (failures: {tried})")
            length = self.places[sha][0][2]
            self.inflight[peer] += 1
            try:
                await self._get(peer, sha, length)
            except _ChunkFailed as e:
                self.failures[(peer, e.reason)] += 1
                self.peer_failures[peer] += 1
                self.failed_on.setdefault(sha, set()).add(peer)
                self.todo.append(sha)  # next, from another peer
                continue
            finally:
                self.inflight[peer] -= 1
            self.chunks += 1
            self.bytes_by_peer[peer] += length
            self.chunks_by_peer[peer] += 1
            self.done_bytes += length * len(self.places[sha])
            if self.progress:
                self.progress(self.done_bytes, self.total_bytes)

    async def _get(self, peer: str, sha: str, length: int) -> None:
        """Stream one chunk into every place it fills, a MiB at a time, hashing as it comes; a
        chunk that fails leaves bytes there that its refetch overwrites (and the install re-hashes)."""
        url = peer.rstrip("/") + chunk_path(self.manifest.version, sha)
        h, got = hashlib.sha256(), 0
        try:
            async with self.http.stream("GET", url, headers=self.signer.call(peer, "GET", urlsplit(url).path)) as r:
                if r.status_code != 200:
                    raise _ChunkFailed(f"http_{r.status_code}")
                async for piece in r.aiter_bytes(STREAM_BYTES):
                    if got + len(piece) > length:
                        raise _ChunkFailed("too_long")
                    await asyncio.to_thread(_write, self.staging, self.places[sha], got, piece, h)
                    got += len(piece)
        except httpx.HTTPError as e:
            raise _ChunkFailed(type(e).__name__) from None
        if got != length:
            raise _ChunkFailed("short")
        if h.hexdigest() != sha:
            raise _ChunkFailed("sha256_mismatch")


def _preallocate(staging: Path, m: Manifest) -> None:
    for f in m.files:
        with (staging / f.path).open("wb") as out:
            out.truncate(f.size)


def _write(staging: Path, places: list[tuple[str, int, int]], at: int, data: bytes, h: hashlib._Hash) -> None:
    # Opened by path each time: a write still running after a cancelled pull removed the
    # staging folder fails on its own instead of landing in a reused descriptor.
    h.update(data)
    for rel, offset, _ in places:
        with (staging / rel).open("r+b") as f:
            f.seek(offset + at)
            f.write(data)


def _install(store: WeightStore, staging: Path, m: Manifest, name: str) -> StoredModel:
    """Re-hash every file, check the version id over all of them, write the store's manifest,
    rename into place."""
    digests: dict[str, str] = {}
    for f in m.files:
        path = staging / f.path
        digests[f.path] = sha256_file(path)
        if digests[f.path] != f.sha256:
            raise PullError(f"{f.path}: the assembled file does not hash to the manifest's sha256")
        with path.open("rb") as fh:
            os.fsync(fh.fileno())  # on disk before the rename makes it visible
    if version_id(digests) != m.version:
        raise PullError(f"the pulled files do not hash to {m.version[:12]}")
    entry = {"name": name, "version": m.version, "source": m.source, "binds": BINDS_FILES, "size_bytes": m.size,
             "created": m.created, "files": digests}
    (staging / MANIFEST).write_text(json.dumps(entry, indent=2))
    final = store.root / name / m.version
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(final)  # atomic: the store sees the whole version or none of it
    except OSError:
        if not (final / MANIFEST).is_file():
            raise
    return next(x for x in store.list() if x.name == name and x.version == m.version)


def _sweep_stale(root: Path) -> None:
    """Remove staging folders left by pulls whose process died (kill -9, power loss)."""
    for d in root.glob(f"{STAGING_PREFIX}*"):
        try:
            pid = int(d.name[len(STAGING_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            continue  # alive, another user's
