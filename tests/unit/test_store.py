"""Weight store: content-addressed versions, verification, CLI listing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from llmd.cli import main
from llmd.store import StoreError, WeightStore, sha256_file, tokenizer_id, version_id


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
    assert m.version == version_id({"model.safetensors": sha256_file(src / "model.safetensors")})
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
    """Versions hash their weights only; what renders their prompts is fingerprinted apart."""
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
