"""Workload generators: arrival rates, burstiness, diurnal shape, length distributions, tenant and
class shares and shared-prefix popularity are statistically right over large samples (generous
tolerances: several standard errors); the same seed gives identical arrays; a trace survives
save/load; bad specs are one-line PlanErrors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmd.plan.errors import PlanError
from llmd.plan.sim.arrivals import Arrivals
from llmd.plan.sim.lengths import Lengths, parse_lengths
from llmd.plan.sim.trace import COLUMNS, Trace
from llmd.plan.sim.workload import Prefixes, TenantShare, WorkloadSpec, generate
from llmd.plan.sim.workload_spec import load_workload, parse_workload

BRIEF = {"workload": "diurnal", "rate": "280", "duration": "3600", "prompt": "lognormal:1000:0.5",
         "output": "lognormal:300:0.6", "tenants": "a:0.7,b:0.3", "batch_share": "0.2"}


def _gaps(t: np.ndarray) -> tuple[float, float]:
    g = np.diff(t)
    return float(g.mean()), float(g.std() / g.mean())


def test_constant_is_poisson_at_the_rate() -> None:
    t = Arrivals("constant", rate=200, duration=1000).sample(np.random.default_rng(1))
    n = 200 * 1000
    assert abs(len(t) - n) < 5 * math.sqrt(n)
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 1000
    mean, cv = _gaps(t)
    assert mean == pytest.approx(1 / 200, rel=0.02) and cv == pytest.approx(1.0, abs=0.03)
    per_s = np.bincount(t.astype(int), minlength=1000)  # Poisson counts: variance = mean
    assert per_s.var() / per_s.mean() == pytest.approx(1.0, abs=0.15)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_gaps_have_the_cv_and_keep_the_mean_rate(cv: float) -> None:
    t = Arrivals("bursty", rate=100, duration=2000, cv=cv).sample(np.random.default_rng(2))
    n = 100 * 2000
    assert abs(len(t) - n) < 6 * cv * math.sqrt(n)  # a renewal count's sd ≈ cv·√n
    mean, got = _gaps(t)
    assert mean == pytest.approx(0.01, rel=0.05) and got == pytest.approx(cv, rel=0.05)


def test_bursty_defaults_to_cv_3_and_cv_0_is_evenly_spaced() -> None:
    assert Arrivals("bursty", rate=1).gap_cv == 3.0 and Arrivals("constant", rate=1).gap_cv == 1.0
    t = Arrivals("constant", rate=10, duration=100, cv=0).sample(np.random.default_rng(3))
    assert len(t) in (999, 1000) and np.allclose(np.diff(t), 0.1)


def test_diurnal_follows_its_rate_curve() -> None:
    a = Arrivals("diurnal", rate=300, duration=7200, amplitude=0.8)
    t = a.sample(np.random.default_rng(4))
    edges = np.linspace(0, 7200, 25)
    want = np.diff(a.cumulative(edges))
    got = np.histogram(t, edges)[0]
    assert np.all(np.abs(got - want) < 6 * np.sqrt(want))
    assert len(t) == pytest.approx(300 * (1 - 0.8 / 2) * 7200, rel=0.01)  # mean rate = peak·(1 − amp/2)
    assert a.rate_at(np.array([3600.0]))[0] == pytest.approx(300)  # peak mid-run by default
    assert a.rate_at(np.array([0.0]))[0] == pytest.approx(60)  # trough = peak·(1 − amplitude)


def test_diurnal_with_a_period_and_bursts() -> None:
    a = Arrivals("diurnal", rate=100, duration=4000, amplitude=0.5, period=1000, peak_at=250, cv=2.0)
    t = a.sample(np.random.default_rng(5))
    phase = np.histogram(t % 1000, np.linspace(0, 1000, 5))[0]
    assert phase.argmax() in (0, 1) and phase.argmin() in (2, 3)  # peak at 250 of each 1,000 s
    assert len(t) == pytest.approx(a.expected(), rel=0.05)


@pytest.mark.parametrize(("text", "mean", "cv"), [("lognormal:1000:0.5", 1000, 0.5), ("lognormal:300:1.2", 300, 1.2),
                                                  ("uniform:100:300", 200, 100 / math.sqrt(3) / 200),
                                                  ("fixed:700", 700, 0.0), ("42", 42, 0.0)])
def test_lengths_have_their_mean_and_cv(text: str, mean: float, cv: float) -> None:
    x = parse_lengths(text).sample(np.random.default_rng(6), 400_000)
    assert x.dtype == np.int32 and x.min() >= 1
    assert x.mean() == pytest.approx(mean, rel=0.02)
    assert x.std() / x.mean() == pytest.approx(cv, abs=0.03 + 0.05 * cv)


def test_lengths_are_clipped_to_their_max() -> None:
    x = parse_lengths("lognormal:1000:1.0:2000").sample(np.random.default_rng(7), 100_000)
    assert x.max() == 2000 and (x == 2000).mean() > 0.05 and x.mean() < 1000
    assert str(parse_lengths("lognormal:1000:1:2000")) == "lognormal:1000:1:2000"
    u = parse_lengths("uniform:5:8").sample(np.random.default_rng(8), 10_000)
    assert set(np.unique(u)) == {5, 6, 7, 8}


def test_the_briefs_example_draws_its_shares() -> None:
    tr = generate(parse_workload({**BRIEF, "seed": "11"}))
    n = len(tr)
    assert n == pytest.approx(280 * 0.75 * 3600, rel=0.01)
    assert tr.tenants == ("a", "b") and (tr.tenant == 0).mean() == pytest.approx(0.7, abs=0.005)
    assert tr.klass.mean() == pytest.approx(0.2, abs=0.005)
    assert tr.prompt_tokens.mean() == pytest.approx(1000, rel=0.01)
    assert tr.output_tokens.mean() == pytest.approx(300, rel=0.01)
    assert np.all(tr.prefix == -1) and np.all(tr.prefix_tokens == 0)
    assert {c: getattr(tr, c).dtype for c in COLUMNS} == {
        "t": np.float64, "tenant": np.int32, "klass": np.int8, "prompt_tokens": np.int32,
        "output_tokens": np.int32, "prefix": np.int32, "prefix_tokens": np.int32}


def test_per_tenant_batch_shares() -> None:
    spec = WorkloadSpec(Arrivals(rate=100, duration=1000), tenants=(TenantShare("x", 1), TenantShare("y", 3, 0.5)),
                        batch_share=0.1)
    tr = generate(spec)
    x, y = tr.tenant == 0, tr.tenant == 1
    assert x.mean() == pytest.approx(0.25, abs=0.01)
    assert tr.klass[x].mean() == pytest.approx(0.1, abs=0.01) and tr.klass[y].mean() == pytest.approx(0.5, abs=0.01)


def test_prefix_groups_by_zipf_popularity() -> None:
    spec = WorkloadSpec(Arrivals(rate=200, duration=1000), prompt=Lengths("lognormal", 600, 0.5),
                        prefixes=Prefixes(4, (100, 200, 300, 900), zipf=1.0, share=0.8), seed=3)
    tr = generate(spec)
    has = tr.prefix >= 0
    assert has.mean() == pytest.approx(0.8, abs=0.01)
    share = np.bincount(tr.prefix[has], minlength=4) / has.sum()
    assert share == pytest.approx(np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12), abs=0.01)
    assert np.array_equal(tr.prefix_tokens[has], np.array([100, 200, 300, 900])[tr.prefix[has]])
    assert np.all(tr.prefix_tokens[~has] == 0) and np.all(tr.prompt_tokens > tr.prefix_tokens)


def test_same_seed_same_arrays_other_seed_other_arrays() -> None:
    spec = parse_workload({**BRIEF, "workload": "bursty", "cv": "2", "duration": "600", "prefixes": "8:400:1.1:0.8"})
    a, b = generate(spec), generate(spec)
    c = generate(parse_workload({**BRIEF, "workload": "bursty", "cv": "2", "duration": "600",
                                 "prefixes": "8:400:1.1:0.8", "seed": "1"}))
    for col in COLUMNS:
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert not np.array_equal(a.prompt_tokens[:100], c.prompt_tokens[:100])


def test_a_million_rows(tmp_path: Path) -> None:
    """Seed scale: 280 req/s for an hour; saved and loaded unchanged."""
    tr = generate(parse_workload({**BRIEF, "workload": "constant", "prefixes": "8:400:1.1:0.8"}))
    assert len(tr) > 950_000 and tr.duration < 3600
    tr.save(tmp_path / "trace")  # no suffix added: the name given is the file written
    back = Trace.load(tmp_path / "trace")
    assert back.tenants == tr.tenants
    for col in COLUMNS:
        a, b = getattr(back, col), getattr(tr, col)
        assert np.array_equal(a, b) and a.dtype == b.dtype


def test_loading_something_else_is_a_plan_error(tmp_path: Path) -> None:
    (tmp_path / "x.npz").write_text("not a zip")
    with pytest.raises(PlanError, match="not a workload trace"):
        Trace.load(tmp_path / "x.npz")
    np.savez(tmp_path / "y.npz", t=np.zeros(3))
    with pytest.raises(PlanError, match=r"y\.npz: not a workload trace"):
        Trace.load(tmp_path / "y.npz")
    cols = {c: np.zeros(2, dtype=np.int32) for c in COLUMNS}
    np.savez(tmp_path / "z.npz", tenants=np.array(["a"]), **{**cols, "t": np.array([2.0, 1.0])})
    with pytest.raises(PlanError, match="arrivals out of order"):
        Trace.load(tmp_path / "z.npz")
    with pytest.raises(PlanError, match=r"missing\.npz"):
        Trace.load(tmp_path / "missing.npz")


def test_a_toml_workload_with_overrides(tmp_path: Path) -> None:
    (tmp_path / "w.toml").write_text('[workload]\nworkload = "bursty"\nrate = 50\nduration = "10m"\ncv = 2.5\n'
                                     'tenants = {a = 3, b = {share = 1, batch_share = 1.0}}\n'
                                     'prefixes = {groups = 3, tokens = [10, 20, 30], zipf = 0.5}\n')
    spec = load_workload(tmp_path / "w.toml", {"rate": "60", "seed": None})
    assert spec.arrivals == Arrivals("bursty", rate=60, duration=600, cv=2.5)
    assert spec.tenants == (TenantShare("a", 3), TenantShare("b", 1, 1.0))
    assert spec.prefixes == Prefixes(3, (10, 20, 30), zipf=0.5)


@pytest.mark.parametrize(("d", "match"), [
    ({"rate": "10", "colour": "red"}, "unknown key colour"),
    ({"workload": "weekly", "rate": "1"}, "workload 'weekly' is not one of"),
    ({"duration": "1h"}, "give a rate"),
    ({"rate": "-3"}, "rate = -3.0 is out of range"),
    ({"rate": "ten"}, "rate = 'ten' is not a number"),
    ({"rate": "1", "duration": "1 fortnight"}, "duration = '1 fortnight' is not a duration"),
    ({"rate": "1", "amplitude": "0.5"}, "only apply to workload = \"diurnal\""),
    ({"workload": "diurnal", "rate": "1", "amplitude": "1"}, "amplitude = 1.0 is out of range"),
    ({"rate": "1", "cv": "50"}, "cv = 50.0 is out of range"),
    ({"rate": "1", "prompt": "gaussian:3:1"}, "prompt: unknown distribution 'gaussian'"),
    ({"rate": "1", "prompt": "lognormal:1000"}, "lognormal takes 2 numbers and an optional max"),
    ({"rate": "1", "output": "uniform:300:100"}, "output: uniform lengths: high 100 must be at least low 300"),
    ({"rate": "1", "output": "fixed:0"}, "out of range"),
    ({"rate": "1", "output": "fixed:10:5.5"}, "whole number"),
    ({"rate": "1", "tenants": "a=0.7"}, "'a=0.7' is not name:share"),
    ({"rate": "1", "tenants": "a:x"}, "shares must be numbers"),
    ({"rate": "1", "tenants": "a:0.5,a:0.5"}, "unique"),
    ({"rate": "1", "tenants": "a:0"}, "share must be > 0"),
    ({"rate": "1", "batch_share": "1.5"}, "batch share 1.5"),
    ({"rate": "1", "prefixes": "4"}, "not groups:tokens"),
    ({"rate": "1", "prefixes": "4:100/200"}, "one per group"),
    ({"rate": "1", "prefixes": "4:100:1:2"}, "share 2 must be between 0 and 1"),
    ({"rate": "1", "seed": "1.5"}, "seed = '1.5' is not a whole number"),
    ({"rate": "1", "speed": "2"}, "only apply to workload = \"replay\""),
    ({"workload": "replay"}, "needs a ledger"),
    ({"ledger": "x.db", "rate": "3"}, "rate cannot apply to a replayed ledger"),
    ({"ledger": "x.db", "since": "yesterday"}, "since = 'yesterday' is neither epoch seconds nor a date"),
    ({"rate": "1e9", "duration": "1d"}, "expected requests; at most"),
])
def test_bad_specs_say_what_is_wrong(d: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match) as e:
        parse_workload(d, "w.toml")
    assert str(e.value).startswith("w.toml: ") and "\n" not in str(e.value)


def test_bad_toml_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read workload file"):
        load_workload(tmp_path / "none.toml")
    (tmp_path / "b.toml").write_text("rate = \n")
    with pytest.raises(PlanError, match=r"b\.toml: not TOML"):
        load_workload(tmp_path / "b.toml")


def test_the_workload_command_summarises_and_saves(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmd.cli import main

    args = ["plan", "workload", "--workload", "bursty", "--rate", "50", "--duration", "10m", "--tenants", "a:3,b:1",
            "--batch-share", "0.25", "--prefixes", "4:100", "--seed", "9", "--out", str(tmp_path / "w.npz")]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    tr = Trace.load(tmp_path / "w.npz")
    assert s["requests"] == len(tr) and s["mean_rps"] == pytest.approx(50, rel=0.1)
    assert s["tenants"]["a"] == pytest.approx(0.75, abs=0.02) and s["classes"]["batch"] == pytest.approx(0.25, abs=0.02)
    assert s["prefix_groups"] == 4 and s["with_shared_prefix"] == 1.0
    assert np.array_equal(tr.t, generate(parse_workload({"workload": "bursty", "rate": "50", "duration": "600",
                                                         "tenants": "a:3,b:1", "batch_share": "0.25",
                                                         "prefixes": "4:100", "seed": "9"})).t)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "peak_minute_rps" in r.output and "saved" in r.output
    r = CliRunner().invoke(main, ["plan", "workload", "--rate", "5", "--tenants", "a"])
    assert r.exit_code == 1 and r.output.strip() == "Error: options: tenants: 'a' is not name:share[:batch_share]"
