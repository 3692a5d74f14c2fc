"""Config validation: errors name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from llmd.cli import main
from llmd.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]

GOOD = """
[server]
port = 9000
[[models]]
name = "m"
backend = "fake"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "llmd.toml"
    p.write_text(text)
    return p


def test_example_config_is_valid() -> None:
    cfg = load_config(REPO / "config.toml")
    assert cfg.models[0].name == "smollm2" and cfg.models[0].backend == "vllm"
    sc = cfg.models[0].scheduling  # no ITL target on the 2-core box (the file says why)
    assert sc.target_itl_ms is None and sc.itl_step_model and sc.batch_seats_with_interactive == 0
    assert sc.batch_ramp_s == 30.0


def test_example_config_written_back_reads_the_same(tmp_path: Path) -> None:
    """bench/filters.py --engine vllm starts `llmd serve` on config.toml rewritten with bench.lib.servers.dump_toml."""
    import tomllib

    from bench.lib.servers import dump_toml

    raw = tomllib.loads((REPO / "config.toml").read_text(encoding="utf-8"))
    assert tomllib.loads(dump_toml(raw)) == raw
    again, example = load_config(write(tmp_path, dump_toml(raw))), load_config(REPO / "config.toml")
    assert again.model_dump(exclude={"path"}) == example.model_dump(exclude={"path"})


def test_good_config_and_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, GOOD)
    monkeypatch.setenv("LLMD_CONFIG", str(p))
    cfg = load_config()
    assert cfg.server.port == 9000 and cfg.path == p
    assert cfg.models[0].prompt_limit == cfg.models[0].engine.max_model_len - 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD.replace("port = 9000", "port = 'x'"), "server.port"),
        (GOOD.replace("port = 9000", "prot = 9000"), "server.prot: unknown key"),
        (GOOD.replace("port = 9000", 'strict_parameters = "sometimes"'), "server.strict_parameters"),
        (GOOD.replace("port = 9000", "refusal_hold_s = -1"), "server.refusal_hold_s"),
        (GOOD.replace("port = 9000", "refusal_hold_s = 120"), "server.refusal_hold_s"),
        (GOOD.replace("port = 9000", 'refusal_demote_s = "long"'), "server.refusal_demote_s"),
        (GOOD.replace("port = 9000", "refusal_hold_s = 5\nrefusal_hold_max_s = 2"),
         "refusal_hold_max_s must not be under refusal_hold_s"),
        (GOOD + "[models.engine]\nmax_model_len = -5\n", "models[0].engine.max_model_len (model 'm')"),
        (GOOD + "[models.engine]\nkv_cache_gib = 0.5\n", "models[0].engine.kv_cache_gib"),
        (GOOD + "[models.scheduling]\nlate_after_s = -1\n", "models[0].scheduling.late_after_s"),
        (GOOD + "[models.scheduling]\nbatch_ramp_s = -1\n", "models[0].scheduling.batch_ramp_s"),
        (GOOD.replace('backend = "fake"', 'backend = "tpu"'), "models[0].backend"),
        (GOOD.replace('backend = "fake"', 'backend = "vllm"'), "needs `source`"),
        (GOOD + '[[models]]\nname = "m"\nbackend = "fake"\n', "appears twice"),
        ("[server]\nport = 1\n", "models: Field required"),
        (GOOD.replace("port = 9000", "default_deadline_s = 900"), "default_deadline_s must not exceed"),
        (GOOD + "max_prompt_tokens = 5000\n", "max_prompt_tokens must be below"),
        ("[server\n", "not valid TOML"),
        (GOOD + '[models.filters]\noutput = ["nope"]\n', "model 'm' filters.output: unknown filter 'nope'"),
        (GOOD + '[[filters]]\nname = "b"\ntype = "blocklist"\npatterns = ["(unclosed"]\n',
         "filters[0].patterns"),
        (GOOD + '[[filters]]\nname = "b"\ntype = "blocklist"\n', "needs `words` or `patterns`"),
        (GOOD + '[[filters]]\nname = "g"\ntype = "classifier"\nmodel = "x"\n', "classifier model 'x'"),
        (GOOD + '[models.filters]\noutput = ["g"]\n[[filters]]\nname = "g"\ntype = "classifier"\nmodel = "m"\n',
         "a classifier filter screens prompts only"),
        (GOOD + '[[filters]]\nname = "p"\ntype = "pii"\nkinds = ["ssn"]\n', "filters[0].kinds[0]"),
        (GOOD + '[[filters]]\nname = "x"\ntype = "no_such_pkg.mod:Filter"\n', "cannot load filter class"),
        (GOOD + '[[tenants]]\nname = "t"\nclasses = ["urgent"]\n', "tenants[0].classes[0]"),
        (GOOD + '[[tenants]]\nname = "t"\ndefault_class = "urgent"\n', "unknown priority class 'urgent'"),
        (GOOD + "[slo]\nttft_p95_s = 0.3\n", "slo.ttft_p95_s: 0.3 is not a bucket edge"),
        (GOOD + "[slo]\navailability = 1.0\n", "slo.availability"),
        (GOOD + "[slo]\nlatency_s = 1.0\n", "slo.latency_s: unknown key"),
        (GOOD + "[slo.models.ghost]\nitl_p95_s = 0.1\n", "slo.models.ghost: no model 'ghost' is configured"),
        (GOOD + "[slo.models.m]\nitl_p95_s = 0.12\n", "slo.models.m.itl_p95_s: 0.12 is not a bucket edge"),
    ],
)
def test_errors_name_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value)
    assert expected in str(e.value)


def test_slo_defaults_and_per_model_overrides(tmp_path: Path) -> None:
    from llmd.config import slo_for

    example = load_config(REPO / "config.toml").slo
    assert (example.ttft_p95_s, example.itl_p95_s, example.availability) == (1.0, 0.2, 0.995)
    assert slo_for(load_config(write(tmp_path, GOOD)).slo, "m").ttft_p95_s == 1.0  # no [slo]: the defaults
    cfg = load_config(write(tmp_path, GOOD + '[[models]]\nname = "n"\nbackend = "fake"\n'
                            "[slo]\nttft_p95_s = 2.5\navailability = 0.99\n[slo.models.n]\nitl_p95_s = 0.1\n"))
    m, n = slo_for(cfg.slo, "m"), slo_for(cfg.slo, "n")
    assert (m.ttft_p95_s, m.itl_p95_s, m.availability) == (2.5, 0.2, 0.99)
    assert (n.ttft_p95_s, n.itl_p95_s, n.availability) == (2.5, 0.1, 0.99)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_serve_reports_config_errors_without_traceback(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("port = 9000", "port = 'x'"))
    r = CliRunner().invoke(main, ["serve", "--config", str(p)])
    assert r.exit_code != 0
    assert "server.port" in r.output and str(p) in r.output and "Traceback" not in r.output


def test_serve_reports_missing_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path / "home"))
    p = write(tmp_path, GOOD.replace('backend = "fake"', 'backend = "vllm"\nsource = "ghost"'))
    r = CliRunner().invoke(main, ["serve", "--config", str(p)])
    assert r.exit_code != 0 and "models[0].source" in r.output and "llmd models pull" in r.output
