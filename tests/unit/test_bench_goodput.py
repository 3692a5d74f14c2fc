"""bench/goodput.py's bench-only variants edit the shipped config.toml into configs llmd accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.goodput import VARIANTS, patch, shipped
from bench.lib.servers import dump_toml
from llmd.config import load_config


@pytest.mark.parametrize("name", [*VARIANTS, "itl200+no-degrade+on-time"])
def test_each_variant_is_a_valid_config_that_differs_from_the_shipped_one(tmp_path: Path, name: str) -> None:
    cfg = shipped()
    patch(name)(cfg)
    assert cfg != shipped()
    path = tmp_path / "variant.toml"
    path.write_text(dump_toml(cfg))
    model = load_config(path).models[0]
    if "itl200" in name:
        assert model.scheduling.target_itl_ms == 200
    if "no-degrade" in name:
        assert model.degradation.steps == []


def test_an_unknown_variant_stops_the_bench_with_the_names_it_knows() -> None:
    with pytest.raises(SystemExit, match=r"unknown variant 'fast'.*itl200"):
        patch("itl200+fast")
