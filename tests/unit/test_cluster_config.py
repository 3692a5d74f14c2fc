"""`[cluster]` is validated at start, with errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd.config import ConfigError, load_config

MODEL = '[[models]]\nname = "m"\nbackend = "vllm"\nsource = "smollm2"\n'


def _load(tmp_path: Path, cluster: str, env: pytest.MonkeyPatch | None = None) -> object:
    p = tmp_path / "config.toml"
    p.write_text(f"[cluster]\n{cluster}\n{MODEL}")
    return load_config(p)


def test_a_cluster_needs_a_secret_of_16_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMD_CLUSTER_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"config.toml: invalid configuration\n  cluster: .*shared secret"):
        _load(tmp_path, "enabled = true")
    short = tmp_path / "short.key"
    short.write_text("too short")
    with pytest.raises(ConfigError, match=r"cluster.secret_files: .*short.key: a cluster secret needs at least 16"):
        _load(tmp_path, f'enabled = true\nsecret_files = ["{short}"]')
    monkeypatch.setenv("LLMD_CLUSTER_SECRET", "x" * 16)
    cfg = _load(tmp_path, "enabled = true")
    assert cfg.cluster.secrets() == [b"x" * 16]  # type: ignore[attr-defined]


def test_seeds_timing_and_unknown_keys_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_CLUSTER_SECRET", "x" * 16)
    with pytest.raises(ConfigError, match=r"cluster.seeds: .*'10.0.0.1' is not host:port"):
        _load(tmp_path, 'enabled = true\nseeds = ["10.0.0.1"]')
    with pytest.raises(ConfigError, match=r"cluster: .*probe_timeout_s must be less than probe_interval_s"):
        _load(tmp_path, "probe_interval_s = 0.2\nprobe_timeout_s = 0.3")
    with pytest.raises(ConfigError, match=r"cluster.placement: "):
        _load(tmp_path, 'placement = "random"')
    with pytest.raises(ConfigError, match=r"config.toml: invalid configuration\n  cluster.balanced_homes: .*boolean"):
        _load(tmp_path, 'balanced_homes = "sometimes"')
    assert _load(tmp_path, "balanced_homes = true").cluster.balanced_homes  # type: ignore[attr-defined]
    assert not _load(tmp_path, "balanced_homes = false").cluster.balanced_homes  # type: ignore[attr-defined]
    assert _load(tmp_path, "").cluster.homes_bind == "always"  # type: ignore[attr-defined]
    assert _load(tmp_path, 'homes_bind = "congested"').cluster.homes_bind == "congested"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"config.toml: invalid configuration\n  cluster.homes_bind: .*'always'"):
        _load(tmp_path, 'homes_bind = "sometimes"')
    with pytest.raises(ConfigError, match=r"cluster.gosip_port: unknown key"):
        _load(tmp_path, "gosip_port = 1")


def test_kv_events_are_on_in_a_cluster_unless_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_CLUSTER_SECRET", "x" * 16)
    assert _load(tmp_path, "enabled = true").models[0].engine.kv_events is True  # type: ignore[attr-defined]
    assert _load(tmp_path, "enabled = false").models[0].engine.kv_events is False  # type: ignore[attr-defined]
    p = tmp_path / "config.toml"
    p.write_text(f"[cluster]\nenabled = true\n{MODEL}[models.engine]\nkv_events = false\n")
    assert load_config(p).models[0].engine.kv_events is False


def test_kv_events_published_on_a_tcp_port_are_on_and_a_bad_endpoint_is_named(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text(f'{MODEL}[models.engine]\nkv_events_endpoint = "tcp://*:5557"\nkv_events_topic = "kv@pod@m"\n')
    engine = load_config(p).models[0].engine
    assert engine.kv_events is True and engine.kv_events_endpoint == "tcp://*:5557"  # on without a cluster
    for bad in ("tcp://10.0.0.1:5557", "ipc:///tmp/x", "tcp://*:0", "tcp://*:99999"):
        p.write_text(f'{MODEL}[models.engine]\nkv_events_endpoint = "{bad}"\n')
        named = r"config.toml: invalid configuration\n  models\[0\].engine.kv_events_endpoint \(model .m.\): "
        with pytest.raises(ConfigError, match=named + r".*tcp://\*:PORT"):
            load_config(p)
    p.write_text(f'{MODEL}[models.engine]\nkv_events_endpoint = "tcp://*:5557"\nkv_events = false\n')
    with pytest.raises(ConfigError, match=r"models\[0\].engine \(model .m.\): .*needs kv_events on"):
        load_config(p)
