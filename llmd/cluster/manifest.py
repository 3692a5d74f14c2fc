"""A stored version's chunk manifest, and the chunks a peer serves from it.

The manifest lists every file of a version (relative path, size, sha256) cut into fixed-size
chunks, each with its own sha256, so a node can fetch chunks from several peers at once and
check each one as it arrives. It is built once from a verified copy and cached next to the
stored model (`<name>/<version>.chunks-<bytes>.json`): a version is content-addressed, so the
cache can only go stale by losing its files, which serving notices.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmd.store import MANIFEST, STREAM_BYTES, StoredModel, StoreError, WeightStore, version_id

CHUNK_BYTES = 16 * 1024 * 1024  # 16 MiB: a 1 GB model is ~60 chunks, a lost one costs well under a second
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
Sha256 = Annotated[str, Field(pattern=_HEX64.pattern)]


def is_version_id(s: str) -> bool:
    return bool(_HEX64.match(s))


def plain_name(p: str) -> str:
    """`p` if it is one plain file or folder name (a model's name, a stored file's): never a
    path out of the store, whatever a peer sends."""
    if not p or p in {".", ".."} or p.startswith(".") or any(c in p for c in "/\\\0"):
        raise ValueError(f"{p!r} is not a plain name")
    return p


class WeightsUnavailable(StoreError):
    """This node cannot serve what was asked: an unknown version or chunk (404), or its own copy
    no longer verifies (500)."""

    def __init__(self, message: str, status: int = 404, code: str = "not_found") -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Chunk(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    sha256: Sha256
    offset: Annotated[int, Field(ge=0)]
    length: Annotated[int, Field(gt=0)]


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    size: Annotated[int, Field(ge=0)]
    sha256: Sha256
    chunks: tuple[Chunk, ...]

    @field_validator("path")
    @classmethod
    def _flat(cls, p: str) -> str:
        if p == MANIFEST:  # the store writes its own
            raise ValueError(f"{p!r} is reserved")
        return plain_name(p)  # a store's model folder is flat

    @model_validator(mode="after")
    def _contiguous(self) -> FileEntry:
        at = 0
        for c in self.chunks:
            if c.offset != at:
                raise ValueError(f"{self.path}: chunks do not tile the file at byte {at}")
            at += c.length
        if at != self.size:
            raise ValueError(f"{self.path}: chunks cover {at} bytes of {self.size}")
        return self


class Manifest(BaseModel):
    """What a peer says a version holds; the puller checks it hashes to the version id."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: Sha256
    name: str
    source: str
    created: float
    chunk_bytes: Annotated[int, Field(gt=0)]
    files: tuple[FileEntry, ...]

    @field_validator("name")
    @classmethod
    def _name(cls, n: str) -> str:
        return plain_name(n)

    @field_validator("files")
    @classmethod
    def _unique(cls, files: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
        if len({f.path for f in files}) != len(files):
            raise ValueError("a file is listed twice")
        return files

    def digests(self) -> dict[str, str]:
        """The digests the version id is computed from (the store's rule: every file)."""
        return {f.path: f.sha256 for f in self.files}

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_places(self) -> dict[str, list[tuple[str, int, int]]]:
        """Each distinct chunk (by sha256) and every (file, offset, length) it fills: equal
        chunks (zero padding, repeated tensors) are fetched once."""
        out: dict[str, list[tuple[str, int, int]]] = {}
        for f in self.files:
            for c in f.chunks:
                out.setdefault(c.sha256, []).append((f.path, c.offset, c.length))
        return out


def build_manifest(model: StoredModel, chunk_bytes: int = CHUNK_BYTES) -> Manifest:
    """Hash every file of `model` in chunks (read a MiB at a time); refuse if its files no longer
    verify (500), or if its id binds the weights only (409): a node never offers peers anything
    other than the version it names, tokenizer and config included."""
    if model.legacy:
        raise WeightsUnavailable(f"{model.name}@{model.short_version} has a weights-only id (its tokenizer and "
                                 f"config are not bound); not offered to peers until re-bound: "
                                 f"`{model.rebind_hint()}`", 409, "weights_only_version")
    entries = [_file_entry(p, chunk_bytes)
               for p in sorted(p for p in model.path.iterdir() if p.is_file() and p.name != MANIFEST)]
    m = Manifest(version=model.version, name=model.name, source=model.source, created=model.created,
                 chunk_bytes=chunk_bytes, files=tuple(entries))
    if m.digests() != model.files or version_id(m.digests()) != model.version:
        raise WeightsUnavailable(f"{model.name}@{model.short_version}: the stored files do not verify; "
                                 "not serving them", 500, "weights_corrupt")
    return m


def _file_entry(path: Path, chunk_bytes: int) -> FileEntry:
    whole, chunks, at = hashlib.sha256(), [], 0
    with path.open("rb") as f:
        while True:
            part, length = hashlib.sha256(), 0
            while length < chunk_bytes and (data := f.read(min(STREAM_BYTES, chunk_bytes - length))):
                whole.update(data)
                part.update(data)
                length += len(data)
            if not length:
                break
            chunks.append(Chunk(sha256=part.hexdigest(), offset=at, length=length))
            at += length
    return FileEntry(path=path.name, size=at, sha256=whole.hexdigest(), chunks=tuple(chunks))


def cache_path(model: StoredModel, chunk_bytes: int) -> Path:
    return model.path.parent / f"{model.version}.chunks-{chunk_bytes}.json"


def cached_manifest(model: StoredModel, chunk_bytes: int = CHUNK_BYTES) -> Manifest:
    """The manifest cached next to the model, or built (hashing every byte) and cached."""
    path = cache_path(model, chunk_bytes)
    try:
        m = Manifest.model_validate_json(path.read_bytes())
        if m.version == model.version and m.chunk_bytes == chunk_bytes and m.digests() == model.files:
            return m
    except (OSError, ValidationError):
        pass
    m = build_manifest(model, chunk_bytes)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(m.model_dump_json())
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    return m


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk's bytes lie on this node's disk."""

    path: Path
    offset: int
    length: int


class WeightServer:
    """Serves this node's stored versions to peers: manifests and chunk locations. Building a
    manifest hashes the whole model, so callers run these methods in a thread."""

    def __init__(self, store: WeightStore, chunk_bytes: int | None = None) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES  # read now: tests shrink the module's default
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}  # one per version: a build never blocks another's chunks
        self._served: dict[str, tuple[StoredModel, bytes, dict[str, ChunkRef]]] = {}

    def versions(self) -> list[str]:
        """Version ids this node can serve (what it advertises as `stored`): weights-only ones are not."""
        return sorted({m.version for m in self.store.list() if not m.legacy})

    def manifest_bytes(self, version: str) -> bytes:
        return self._get(version)[1]

    def serve_chunk(self, version: str, sha256: str) -> ChunkRef:
        model, _, index = self._get(version)
        ref = index.get(sha256)
        if ref is None:
            raise WeightsUnavailable(f"version {version[:12]} has no chunk {sha256[:12]}", 404, "unknown_chunk")
        if not ref.path.is_file():  # removed from the store since: forget it
            with self._lock:
                self._served.pop(version, None)
            raise WeightsUnavailable(f"{model.name}@{model.short_version} is no longer stored", 404, "unknown_version")
        return ref

    def _get(self, version: str) -> tuple[StoredModel, bytes, dict[str, ChunkRef]]:
        if (got := self._served.get(version)) is not None:
            return got
        missing = WeightsUnavailable(f"version {version[:64]!r} is not stored on this node", 404, "unknown_version")
        if not is_version_id(version):
            raise missing
        with self._lock:
            building = self._building.setdefault(version, threading.Lock())
        with building:  # one build per version, even when several peers ask at once
            if (got := self._served.get(version)) is not None:
                return got
            model = next((m for m in self.store.list() if m.version == version), None)
            if model is None:
                raise missing
            m = cached_manifest(model, self.chunk_bytes)
            index = {c.sha256: ChunkRef(model.path / f.path, c.offset, c.length) for f in m.files for c in f.chunks}
            got = self._served[version] = (model, json.dumps(m.model_dump(), sort_keys=True).encode(), index)
            return got
