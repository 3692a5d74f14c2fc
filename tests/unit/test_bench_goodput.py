"""bench/goodput.py: its bench-only variants edit the shipped config.toml into configs llmd accepts,
and its flood client (bench/lib/flood.py) behaves as the misbehaving tenant should."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.goodput import VARIANTS, patch, shipped
from bench.lib.goodput_report import verdicts
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


def _row(good: int, chat: int = 0, rag: int = 0) -> dict[str, object]:
    return {"goodput": good / 45, "chat": {"good": chat}, "rag": {"good": rag}}


def test_verdicts_call_nothing_good_on_both_sides_no_lead_and_skip_a_tenant_with_nothing_to_keep() -> None:
    rows = {"vllm@1": _row(4), "llmd@1": _row(4), "vllm@2": _row(0), "llmd@2": _row(0), "litellm@2": _row(1),
            "llmd@alone": _row(6, chat=6, rag=0), "llmd@flood": _row(5, chat=5, rag=0)}
    got = dict(verdicts({"rows": rows, "loads": [1.0, 2.0]}))
    assert [v for k, v in got.items() if k.startswith("1x")] == [True]
    assert got["2x: llmd goodput 0.000/s >= 2x vllm's 0.000/s"] is False  # 0 against 0 is no lead
    assert got["2x: llmd goodput 0.000/s >= 2x litellm's 0.022/s"] is False
    assert got["flood: llmd chat good 5 >= 0.9x alone (6)"] is False
    assert not any(k.startswith("flood: llmd rag") for k in got)  # nothing good alone: nothing to compare


def test_an_unknown_variant_stops_the_bench_with_the_names_it_knows() -> None:
    with pytest.raises(SystemExit, match=r"unknown variant 'fast'.*itl200"):
        patch("itl200+fast")


async def test_the_flood_client_resubmits_refusals_and_reads_streams_from_its_own_process(
        make_server, tmp_path: Path) -> None:
    """bench/lib/flood.py, against a real server: the misbehaving streams keep resubmitting what is
    refused (no Retry-After honoured, holds off here), and what gets a seat streams to the end."""
    from bench.lib.flood import run_flood
    from bench.lib.goodput_trace import trace
    from bench.lib.servers import keys_toml
    from tests.conftest import fake_toml

    toml = fake_toml(step_ms=5.0).replace("[server]\n", "[server]\nrefusal_hold_s = 0\n")
    live = await make_server(toml + keys_toml({"bulk": "k-bulk"}, max_concurrent=2))
    bodies = trace(4, 600, 8, "fake", 0.05, ("bulk",))
    outs = await run_flood(live.url + "/v1/chat/completions", {"Authorization": "Bearer k-bulk"}, 8, 3.0,
                           bodies, tmp_path, 120)
    done = [o for o in outs if o.completed]
    assert done and all(o.tokens == o.req.max_tokens for o in done)  # read to [DONE], usage included
    assert sum(o.refusals for o in outs) >= 10  # 8 streams on 2 seats: refused, and resubmitted
    refused = [o for o in outs if o.refusals]
    assert all(set(o.codes) == {"concurrency_limit_exceeded"} for o in refused)
    assert any(o.completed and o.attempts > 1 for o in refused)  # a refused one got in on a later try
