"""Weight store: content-addressed versions (every file bound to the id), verification, legacy
weights-only versions and their re-binding, CLI listing."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest
import structlog
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from llmd.cli import main
from llmd.cluster.manifest import Manifest, WeightServer, WeightsUnavailable, build_manifest
from llmd.store import MANIFEST, StoredModel, StoreError, WeightStore, sha256_file, tokenizer_id, version_id


def hf_dir(root: Path, seed: int = 0) -> Path:
    d = root / f"model{seed}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "tokenizer.json").write_text("{}")
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(16, 16, generator=g)}, str(d / "model.safetensors"))
    return d


def test_import_is_content_addressed(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "home")
    src = hf_dir(tmp_path)
    m = store.import_path(src, "tiny")
    assert m.version == version_id({f.name: sha256_file(f) for f in src.iterdir()}) and not m.legacy
    assert (m.path / "tokenizer.json").is_file() and m.source.startswith("hf:")
    again = store.import_path(src, "tiny")
    assert again.version == m.version and len(store.list()) == 1
    other = store.import_path(hf_dir(tmp_path, seed=1), "tiny")
    assert other.version != m.version and len(store.list()) == 2
    assert store.resolve("tiny", m.version[:8]).version == m.version
    store.verify(m)


def test_resolve_errors(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "home")
    with pytest.raises(StoreError, match="llmd models pull"):
        store.resolve("ghost")
    m = store.import_path(hf_dir(tmp_path), "tiny")
    with pytest.raises(StoreError):
        store.resolve("tiny", "ffffffff" if not m.version.startswith("ffffffff") else "00000000")


def test_tampered_weights_are_refused(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "home")
    m = store.import_path(hf_dir(tmp_path), "tiny")
    w = m.path / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="refusing to load mismatched weights"):
        store.verify(m)
    w.unlink()
    with pytest.raises(StoreError, match="missing"):
        store.verify(m)


def test_import_rejects_non_models(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "home")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(StoreError, match=r"no config\.json"):
        store.import_path(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(StoreError, match="safetensors"):
        store.import_path(empty)
    with pytest.raises(StoreError, match="unknown model"):
        store.pull("no-such-model")


def test_cli_import_and_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    r = runner.invoke(main, ["models", "import", str(hf_dir(tmp_path)), "--name", "tiny"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["models", "list"])
    assert "tiny" in r.output and "hf:" in r.output
    listed = json.loads(runner.invoke(main, ["models", "list", "--json"]).output)
    assert listed[0]["name"] == "tiny" and len(listed[0]["version"]) == 64
    r = runner.invoke(main, ["models", "verify", "tiny"])
    assert r.exit_code == 0 and "ok" in r.output
    r = runner.invoke(main, ["models", "import", str(tmp_path / "ghost")])
    assert r.exit_code != 0


def test_cast_copy_is_a_new_version_of_the_same_model(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"w": torch.ones(4, dtype=torch.bfloat16), "ids": torch.arange(3)}, src / "model.safetensors")
    ws = WeightStore(tmp_path / "home")
    a = ws.add_hf_dir(src, "tiny", "test")
    b = ws.cast_copy(a, "float32")
    assert b.name == "tiny" and b.version != a.version and b.source == "test as float32"
    t = load_file(b.path / "model.safetensors")
    assert t["w"].dtype == torch.float32 and t["ids"].dtype == torch.int64  # only floats are cast
    assert (b.path / "config.json").is_file()
    ws.verify(b)
    other = WeightStore(tmp_path / "other")
    linked = other.link_from(a)
    assert linked.version == a.version and (linked.path / "model.safetensors").stat().st_ino == \
        (a.path / "model.safetensors").stat().st_ino  # hard links, no copy
    with pytest.raises(StoreError):
        ws.cast_copy(a, "int8")


def test_the_tokenizer_id_changes_with_the_tokenizer_or_template_and_only_with_them(tmp_path: Path) -> None:
    """What renders their prompts is fingerprinted apart from the version (a cluster compares it)."""
    a, b = hf_dir(tmp_path, seed=0), hf_dir(tmp_path, seed=1)  # other weights, the same tokenizer
    assert tokenizer_id(a) == tokenizer_id(b) != tokenizer_id(None) == "simple"
    (b / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert tokenizer_id(a) != tokenizer_id(b)
    (a / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert tokenizer_id(a) == tokenizer_id(b)
    (a / "config.json").write_text("{}")  # not the tokenizer's
    assert tokenizer_id(a) == tokenizer_id(b)
    assert tokenizer_id(a, "org/other-tokenizer") != tokenizer_id(a)  # the engine told to use another
    assert tokenizer_id(b, str(a)) == tokenizer_id(a)  # a folder named instead: hashed as that folder


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "chat_template.jinja", "generation_config.json"])
def test_every_file_of_a_version_is_bound_to_its_id(tmp_path: Path, name: str) -> None:
    store = WeightStore(tmp_path / "home")
    src = hf_dir(tmp_path)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "generation_config.json").write_text("{}")
    m = store.import_path(src, "tiny")
    assert set(m.files) == {f.name for f in src.iterdir()}
    (src / name).write_text('{"changed": true}')
    assert store.import_path(src, "tiny").version != m.version  # another tokenizer/config: another version
    (m.path / name).write_text('{"changed": true}')  # the stored copy altered in place: refused
    with pytest.raises(StoreError, match=f"file {name} has sha256 .* refusing to load"):
        store.verify(m)


def test_a_file_added_to_or_missing_from_a_version_is_refused(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "home")
    m = store.import_path(hf_dir(tmp_path), "tiny")
    (m.path / "chat_template.jinja").write_text("{{ evil }}")  # vLLM would read it: not this version
    with pytest.raises(StoreError, match=r"file chat_template\.jinja is not part of this version"):
        store.verify(m)
    (m.path / "chat_template.jinja").unlink()
    store.verify(m)
    (m.path / "tokenizer.json").unlink()
    with pytest.raises(StoreError, match=r"file tokenizer\.json is missing"):
        store.verify(m)


def legacy_copy(store: WeightStore, m: StoredModel) -> StoredModel:
    """`m` as a store from before issue M wrote it: the id over the weights only, no `binds`."""
    weights = {f: d for f, d in m.files.items() if f.endswith(".safetensors")}
    old = version_id(weights)
    shutil.copytree(m.path, m.path.parent / old)
    entry = json.loads((m.path / MANIFEST).read_text())
    del entry["binds"]
    (m.path.parent / old / MANIFEST).write_text(json.dumps({**entry, "version": old, "files": weights,
                                                            "created": entry["created"] - 100}))
    store.remove(m)
    return store.resolve(m.name, old)


def test_a_legacy_weights_only_version_loads_with_a_warning_and_is_rebound_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    store = WeightStore(home)
    old = legacy_copy(store, store.import_path(hf_dir(tmp_path), "tiny"))
    assert old.legacy and set(old.files) == {"model.safetensors"}
    with structlog.testing.capture_logs() as logs:
        store.verify(old)  # still loads: its weights verify
    warned = [e for e in logs if e["event"] == "weights_only_version"]
    assert warned and f"llmd models import {old.path} --name tiny --link" in warned[0]["note"]
    ws = WeightServer(store)
    assert ws.versions() == []  # never advertised to peers
    with pytest.raises(WeightsUnavailable, match="weights-only id") as e:
        ws.manifest_bytes(old.version)
    assert e.value.status == 409 and e.value.code == "weights_only_version"

    monkeypatch.setenv("LLMD_HOME", str(home))
    runner = CliRunner()
    assert "weights-only id" in runner.invoke(main, ["models", "list"]).output
    r = runner.invoke(main, ["models", "import", str(old.path), "--name", "tiny", "--link"])
    assert r.exit_code == 0, r.output
    new = store.resolve("tiny")  # the newest: what an unpinned config now loads
    assert not new.legacy and new.version != old.version and set(new.files) == {"config.json", "tokenizer.json",
                                                                                "model.safetensors"}
    assert (new.path / "model.safetensors").stat().st_ino == (old.path / "model.safetensors").stat().st_ino
    assert new.source == old.source  # where it came from, not the store's own folder
    store.verify(new)
    assert ws.versions() == [new.version] and Manifest.model_validate_json(ws.manifest_bytes(new.version))
    assert store.resolve("tiny", old.version[:12]).legacy  # a config pinned to the old id still loads it


def test_pull_if_missing_rebinds_a_weights_only_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make model` (`pull --if-missing`) on a box set up before issue M upgrades its store, so the
    model can be pulled by peers; a store already bound is left alone."""
    home = tmp_path / "home"
    store = WeightStore(home)
    old = legacy_copy(store, store.import_path(hf_dir(tmp_path), "tiny"))
    monkeypatch.setenv("LLMD_HOME", str(home))
    r = CliRunner().invoke(main, ["models", "pull", "tiny", "--if-missing"])
    assert r.exit_code == 0 and "re-bound" in r.output, r.output
    new = store.resolve("tiny")
    assert not new.legacy and new.version != old.version
    again = CliRunner().invoke(main, ["models", "pull", "tiny", "--if-missing"])
    assert again.exit_code == 0 and "re-bound" not in again.output and new.short_version in again.output
    assert store.resolve("tiny").version == new.version


def test_hashing_a_version_streams_a_mib_at_a_time(tmp_path: Path) -> None:
    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(bytes(range(256)) * (24 * 4096))  # 24 MiB
    store = WeightStore(tmp_path / "home")
    m = store.import_path(src, "big")
    tracemalloc.start()
    try:
        store.verify(m)
        manifest = build_manifest(m, chunk_bytes=16 * 1024 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [c.length for f in manifest.files for c in f.chunks if f.path == "model.safetensors"] == [16 << 20, 8 << 20]
    assert peak < 3 * 1024 * 1024  # a 16 MiB chunk is hashed without ever being held whole
