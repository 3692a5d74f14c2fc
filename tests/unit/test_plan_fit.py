"""The step-time model's fit (NNLS, relative error, k-fold over grid points), its stamp, the
datasheet prior, and `llmd plan calibrate`'s command line on the fake backend."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmd.calibrate.cli import STAMP_KEYS, local_stamp
from llmd.cli import main
from llmd.plan.errors import PlanError
from llmd.plan.fit import Sample, cross_validate, error_summary, error_table, fit, fit_coef, samples_from_json
from llmd.plan.gpus import get_gpu
from llmd.plan.model import from_config
from llmd.plan.prior import BAND, Roofline, prior_grid, prior_model_coef
from llmd.stepmodel import StepModel, StepShape

TRUE = {"c_step": 0.06, "c_seq": 0.0012, "c_tok": 0.0021, "c_kv": 8e-7, "c_attn": 1.3e-6}
LLAMA70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
            "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def grid(coef: dict[str, float], noise: float = 0.0, seed: int = 1) -> list[Sample]:
    """Steps of a calibration-like grid priced by `coef`, each with ±noise multiplicative jitter."""
    m, r, out = StepModel(coef), random.Random(seed), []
    shapes: dict[str, list[StepShape]] = {}
    for b in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (64, 257, 1025, 2049):
            shapes[f"decode B={b} ctx={ctx}"] = [StepShape(b, context_tokens=b * (ctx + j)) for j in range(1, 9)]
    for c in (16, 64, 256, 1024, 2048):
        for before in (0, 1024):
            shapes[f"prefill {c} {before}"] = [StepShape(0, c, 1, prefill_attn=c * (before + c / 2))] * 3
    for b in (4, 32):
        for c in (64, 512):
            shapes[f"mixed {b} {c}"] = [StepShape(b, c, 1, b * 300, c * c / 2)] * 3
    for point, ss in shapes.items():
        out += [Sample(point, s, m.seconds(s) * (1 + r.uniform(-noise, noise))) for s in ss]
    return out


def test_exact_steps_recover_the_coefficients() -> None:
    got = fit_coef(grid(TRUE))
    for k, v in TRUE.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k


def test_noisy_steps_fit_within_the_noise_and_held_out_error_is_reported() -> None:
    samples = grid(TRUE, noise=0.03)
    model, errors = fit(samples, {"engine": "test"}, folds=5)
    assert {e.point for e in errors} == {s.point for s in samples}  # every point held out exactly once
    assert len(errors) == len({s.point for s in samples})
    assert model.error["median"] < 0.03 and model.error["p90"] < 0.05
    assert model.error["points"] == len(errors) and model.error["folds"] == 5
    assert model.stamp == {"engine": "test"}
    for k in ("c_step", "c_seq", "c_tok"):
        assert model.coef[k] == pytest.approx(TRUE[k], rel=0.15), k
    table = error_table(errors)
    assert "held-out over 42 points" in table and "decode B=64 ctx=2049" in table


def test_a_held_out_point_is_predicted_without_its_own_steps() -> None:
    samples = grid(TRUE)
    bad = "decode B=8 ctx=257"
    samples = [Sample(s.point, s.shape, s.seconds * 3) if s.point == bad else s for s in samples]
    errors = {e.point: e for e in cross_validate(samples, folds=4)}
    # Fitted on the other folds only, the model predicts the true time: 1/3 of what was "measured".
    assert errors[bad].rel_error == pytest.approx(2 / 3, abs=0.1)
    assert errors[bad].steps == 8


def test_error_summary_median_and_p90() -> None:
    from llmd.plan.fit import PointError

    errs = [PointError(f"p{i}", 1, 1.0, 1.0 + i / 100) for i in range(1, 11)]  # 1 % .. 10 %
    s = error_summary(errs)
    assert s["median"] == pytest.approx(0.055) and s["p90"] == pytest.approx(0.09) and s["max"] == pytest.approx(0.1)


def test_too_few_steps_or_points_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="too few measured steps"):
        fit_coef(grid(TRUE)[:3])
    with pytest.raises(PlanError, match="at least 2 grid points"):
        cross_validate([s for s in grid(TRUE) if s.point == "decode B=1 ctx=64"])


def test_a_stale_stamp_is_refused() -> None:
    stamp = local_stamp("fake", "fake", "float32")
    model = StepModel(TRUE, {**stamp, "engine_version": "0.0.1"})
    with pytest.raises(PlanError, match=r"stale.*engine_version: fitted '0\.0\.1'"):
        model.check_stamp(**{k: stamp[k] for k in STAMP_KEYS})
    StepModel(TRUE, stamp).check_stamp(**{k: stamp[k] for k in STAMP_KEYS})  # the same box: accepted


def test_the_roofline_reads_the_weights_at_one_sequence_and_computes_at_a_long_chunk() -> None:
    m = from_config(LLAMA70B, "llama70b")
    roof = Roofline(get_gpu("H100"), m, tp=4, weight_dtype="fp8")
    read = m.params - m.vocab * m.hidden  # untied: the input embedding is gathered, not read whole
    fixed = 80 * 32e-6 + 2 * 80 * 15e-6
    one = StepShape(1, context_tokens=512, longest_context=512)
    moved = read * 1 + m.kv_bytes_per_token() * 512
    assert roof.seconds(one) == pytest.approx(moved / (4 * 3.35e12 * 0.7) + fixed + 4e-6)
    chunk = StepShape(0, 8192, 1, prefill_attn=8192 * 4096)
    work = 2 * read * 8192 + 4 * 80 * 64 * 128 * 8192 * 4096
    assert roof.seconds(chunk) == pytest.approx(work / (4 * 1979e12 * 0.45) + fixed + 4e-6)
    # bf16 weights on one H200: twice the weight bytes over 1.43x the bandwidth, no all-reduce
    h200 = Roofline(get_gpu("H200"), m, tp=1)
    assert h200.seconds(one) == pytest.approx((read * 2 + m.kv_bytes_per_token() * 512) / (4.8e12 * 0.7)
                                              + 80 * 32e-6 + 4e-6)


def test_the_prior_is_the_roofline_fitted_onto_the_basis() -> None:
    """The basis is linear and the roofline a max: the prior must follow the roofline over the
    grid (not sum its two terms, which read up to 2x high where they meet)."""
    m = from_config(LLAMA70B, "llama70b")
    gpu = get_gpu("H100")
    roof, prior = Roofline(gpu, m, tp=4, weight_dtype="fp8"), StepModel(prior_model_coef(gpu, m, 4, "fp8"))
    errors = sorted(abs(prior.seconds(s) / roof.seconds(s) - 1) for _, s in prior_grid())
    assert errors[len(errors) // 2] < 0.10 and errors[-1] < 0.5
    decode_one = StepShape(1, context_tokens=256, longest_context=256)
    assert prior.seconds(decode_one) == pytest.approx(roof.seconds(decode_one), rel=0.25)
    assert prior_model_coef(gpu, m, 1, "bf16")["c_step"] > 3 * prior.coef["c_step"]  # 4 GPUs, half the bytes


def test_the_prior_holds_its_band_against_steps_measured_on_an_h100() -> None:
    """bench/plan_gpu.py's H100 steps (a PyTorch stand-in for the engine, three model shapes):
    the prior, which never saw them, within its ±30 % band at nine points in ten. The first
    prior (the roofline's two terms summed) read within it at 18 of 69."""
    import bench.plan_gpu as pg

    data = json.loads(pg.DATA.read_text())
    errors = [e for name, run in data["models"].items() if name != "tiny"  # the run's smoke test
              for e in pg.model_rows(name, run, get_gpu("H100"))[1]["prior"]]
    within = sum(abs(e) <= BAND for e in errors)
    assert len(errors) == 69 and within >= 0.9 * len(errors)


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA70B))
    return p


def test_cli_prior_writes_a_stamped_model(tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    r = CliRunner().invoke(main, ["plan", "calibrate", "--prior", "H100", "--model-config", str(_config(tmp_path)),
                                  "--tp", "4", "--weight-dtype", "fp8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    m = StepModel.load(out)
    assert m.stamp["kind"] == "prior" and m.stamp["device"] == "H100-SXM" and m.stamp["band"] == "±30%"
    assert m.error == {"band": 0.3}
    assert "±30 %" in r.output


@pytest.mark.parametrize(("args", "says"), [
    (["--prior", "B200"], "unknown GPU 'B200'"),
    (["--prior", "local"], "no datasheet"),
    (["--prior", "H100", "--model-config", "/nonexistent/config.json"], "no such file"),
    (["--backend", "fake", "--fake-step-model", "/nonexistent/m.json"], "cannot read step model"),
    (["--model", "no-such-model"], "not in the weight store"),
    (["--backend", "fake", "--quick", "--steps", "0"], "--steps and --repeats must be at least 1"),
    (["--backend", "fake", "--quick", "--repeats", "-1"], "--steps and --repeats must be at least 1"),
    (["--backend", "fake", "--quick", "--passes", "0"], "--passes must be at least 1"),
])
def test_cli_bad_input_is_one_line(args: list[str], says: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    r = CliRunner().invoke(main, ["plan", "calibrate", *args, "--out", str(tmp_path / "m.json")])
    assert r.exit_code == 1, r.output
    assert says in r.output and "Traceback" not in r.output
    assert r.output.startswith("Error: ") and r.output.count("\n") == 1


def test_cli_quick_calibration_on_the_fake_backend(tmp_path: Path) -> None:
    truth = tmp_path / "truth.json"
    truth.write_text(StepModel({"c_step": 0.002, "c_seq": 0.0001, "c_tok": 0.00001}).to_json())
    out = tmp_path / "fit.json"
    r = CliRunner().invoke(main, ["plan", "calibrate", "--backend", "fake", "--quick", "--fake-step-model", str(truth),
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    m = StepModel.load(out)
    assert m.stamp["engine"] == "fake" and m.stamp["grid"] == "quick"
    assert m.stamp["block_size"] == "16"  # the engine's KV block: the simulator caches prefixes in it
    assert {"median", "p90", "points"} <= set(m.error) and m.error["points"] == 10
    assert m.coef["c_step"] > 0  # every step costs at least the fake's 2 ms base
    points = json.loads(out.with_suffix(".points.json").read_text())["points"]
    assert len(points) == 10 and all(p["measured_s"] > 0 and p["predicted_s"] > 0 for p in points)
    assert "held-out over 10 points" in r.output
    # Refit from the measured steps, two runs merged; a run from another engine is refused.
    refit = tmp_path / "refit.json"
    pts = str(out.with_suffix(".points.json"))
    r = CliRunner().invoke(main, ["plan", "calibrate", "--from-samples", pts, "--from-samples", pts,
                                  "--out", str(refit)])
    assert r.exit_code == 0, r.output
    m2 = StepModel.load(refit)
    assert m2.stamp["runs"] == "2" and m2.error["steps"] == 2 * m.error["steps"] and m2.error["points"] == 10
    other = tmp_path / "other.points.json"
    d = json.loads(Path(pts).read_text())
    other.write_text(json.dumps({**d, "stamp": {**d["stamp"], "engine_version": "9"}}))
    r = CliRunner().invoke(main, ["plan", "calibrate", "--from-samples", pts, "--from-samples", str(other),
                                  "--out", str(refit)])
    assert r.exit_code == 1 and "measured on another engine_version" in r.output



def test_each_visit_is_scaled_by_the_box_speed_its_references_saw() -> None:
    from llmd.calibrate.runner import rescale

    shape = StepShape(decode_seqs=1)
    samples = [Sample("a", shape, 0.1), Sample("a", shape, 0.1), Sample("b", shape, 0.3)]
    # visit 0 (two steps) bracketed by 0.05 and 0.15 s references (a slow moment), visit 1 by 0.15, 0.10
    out = rescale(samples, [(0, 2), (2, 3)], [0.05, 0.15, 0.10])
    assert [round(s.scale, 6) for s in out] == [1.0, 1.0, 0.8]
    assert out[2].seconds == 0.3 * 0.8 and out[2].uncorrected().seconds == 0.3
    # a bracket without a timed step: the run stays uncorrected, never half-corrected
    assert rescale(samples, [(0, 2), (2, 3)], [0.05, 0.0, 0.10]) == samples


def test_cli_passes_visit_every_point_again_with_references(tmp_path: Path) -> None:
    truth = tmp_path / "truth.json"
    truth.write_text(StepModel({"c_step": 0.002, "c_seq": 0.0001, "c_tok": 0.00001}).to_json())
    out = tmp_path / "fit.json"
    r = CliRunner().invoke(main, ["plan", "calibrate", "--backend", "fake", "--quick", "--fake-step-model", str(truth),
                                  "--passes", "2", "--steps", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    m = StepModel.load(out)
    assert m.stamp["passes"] == "2" and m.stamp["reference"].startswith("decode B=1 ctx=64")
    assert m.stamp["grid"] == "quick (steps 4, repeats 2)" and m.error["points"] == 10
    rows = json.loads(out.with_suffix(".points.json").read_text())["samples"]
    assert all(len(row) == 9 and row[7] > 0 for row in rows)  # ..., seconds, scale, longest context
    assert "without the reference correction" in r.output
    r = CliRunner().invoke(main, ["plan", "calibrate", "--backend", "fake", "--quick", "--passes", "0",
                                  "--out", str(out)])
    assert r.exit_code != 0 and "--passes must be at least 1" in r.output


def test_the_longest_decode_context_is_a_term_and_old_rows_derive_it() -> None:
    m = StepModel({"c_step": 0.01, "c_ctx": 1e-5})
    assert m.seconds(StepShape(decode_seqs=4, context_tokens=4000, longest_context=2000)) == 0.01 + 0.02
    # a row written before the field: the grid's decoders share one context, so it is context / count
    old = ["decode B=4 ctx=1025", 4, 0, 0, 4104, 0.0, 0.1, 1.0]
    assert samples_from_json([old], "x")[0].shape.longest_context == 1026
    assert samples_from_json([[*old, 1500]], "x")[0].shape.longest_context == 1500
    # fitted back from steps that follow it (NNLS recovers it beside the other terms)
    truth = StepModel({"c_step": 0.05, "c_seq": 0.001, "c_kv": 1e-6, "c_ctx": 8e-6})
    shapes = [StepShape(decode_seqs=b, context_tokens=b * c, longest_context=c) for b in (1, 4, 16, 64)
              for c in (64, 512, 2048)]
    got = fit_coef([Sample(f"p{i}", s, truth.seconds(s)) for i, s in enumerate(shapes)])
    assert abs(got["c_ctx"] - 8e-6) < 1e-7 and abs(got["c_kv"] - 1e-6) < 1e-7
