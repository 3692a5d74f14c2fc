"""The end-to-end check's logic that needs no server: matching a lone request's chunks to the
engine steps that made them (llmd's overheads), reading the simulator's report, and the
markdown verdicts against the targets."""

from __future__ import annotations

import math
import types
from typing import Any

import pytest

from bench.lib.plan_overhead import match
from bench.lib.plan_report import report
from bench.lib.plan_sim import FakeKnobStep, figures_of
from bench.lib.replayer import Sent
from llmd.stepmodel import StepShape


def test_a_lone_requests_steps_give_its_ingress_engine_ttft_and_delivery() -> None:
    # Sent at 10.0 (client clock); the engine ran a prefill step 10.004-10.024, then decode steps
    # of 20 ms; the client got token 1 alone, then tokens 2 and 3 in one chunk.
    s = Sent(0, "a", "interactive", 10.0, t_send=10.0, chunks=[10.046, 10.090], tokens=[1, 2], t_end=10.091)
    steps = [{"t": 9.9, "duration": 0.02, "generated_tokens": 1},  # before it: another request's
             {"t": 10.024, "duration": 0.02, "generated_tokens": 0},
             {"t": 10.044, "duration": 0.02, "generated_tokens": 1},
             {"t": 10.064, "duration": 0.02, "generated_tokens": 1},
             {"t": 10.084, "duration": 0.02, "generated_tokens": 1}]
    got = match(s, wall=0.0, steps=steps)
    assert got is not None
    ingress, engine_ttft, delivery = got
    assert math.isclose(ingress, 0.004) and math.isclose(engine_ttft, 0.040)
    assert [round(d, 6) for d in delivery] == [0.002, 0.006]  # a chunk leaves with its last token
    assert match(Sent(1, "a", "interactive", 0, t_send=0, chunks=[], t_end=1), 0.0, steps) is None


def test_the_fake_backends_knob_step_function_as_a_step_time() -> None:
    f = FakeKnobStep(step_ms=17, step_ms_per_seq=1.3, prefill_tokens_per_s=1000)  # 4 sequences below: 22.2 ms
    assert math.isclose(f.seconds(StepShape(decode_seqs=10)), 0.030)
    assert math.isclose(f.seconds(StepShape(decode_seqs=3, prefill_tokens=200, prefill_seqs=1)), 0.0222 + 0.2)


SIM = {"throughput": {"output_tokens_per_s": 100.0},
       "by_class": {"interactive": {"ttft_s": {"p50": 0.22, "p95": 0.4}, "itl_s": {"p50": 0.05, "p95": 0.08}},
                    "batch": {"ttft_s": {"p50": 1.0, "p95": None}, "itl_s": {"p50": 0.05, "p95": 0.08}}}}


def test_the_simulators_report_read_by_class() -> None:
    f = figures_of(SIM)
    assert sorted(f) == ["batch", "interactive"]
    assert (f["interactive"].ttft_p95, f["interactive"].tput) == (0.4, 100.0)
    assert math.isnan(f["batch"].ttft_p95)


def row(engine: str, load: float, ttft50: float, sim_ttft50: float | None) -> dict:
    fig = {"ttft_p50": ttft50, "ttft_p95": 0.4, "itl_p50": 0.05, "itl_p95": 0.08, "tput": 99.0}
    sim = None if sim_ttft50 is None else {"interactive": {**fig, "ttft_p50": sim_ttft50, "tput": 100.0}}
    return {"engine": engine, "load": load, "rep": 0, "rate": 1.0, "client_cpu": 0.05, "sim": None,
            "sim_by_class": sim, "measured": {"figures": fig, "n": 10, "statuses": {"ok": 10}, "tput_run": 100.0,
                                              "by_class": {"interactive": fig}}}


def test_the_report_judges_held_out_real_points_and_every_fake_point() -> None:
    res = {"capacity": {}, "points": [row("real", 0.5, 0.20, 0.21),  # +5 %: within 10 %
                                      row("real", 1.0, 0.20, 0.40),  # near saturation: reported apart, not judged
                                      row("fake", 0.5, 0.20, 0.21)]}  # +5 %: over 3 %
    text = report(res, (0.3, 0.5))
    assert "- real (held-out loads ≤ 80 %): worst |error| TTFT p50 ms 5.0%" in text and "PASS" in text
    assert "- fake (all loads): worst |error| TTFT p50 ms 5.0%" in text and "MISS" in text
    assert "≥ 90 %" in text and "200.0 / 210.0 (+5.0%)" in text
    res["points"] = [row("real", 0.5, 0.2, None)]
    assert "real: no simulated points yet" in report(res, (0.5,))
    res["points"] = [row("fake", 0.5, 0.20, 0.21)]
    assert "- real: no load points measured (capacity only)" in report(res, (0.5,))


def test_every_stored_row_says_when_and_at_which_llmd_it_was_measured() -> None:
    from bench.lib.plan_e2e import provenance

    stamped = {**row("fake", 0.5, 0.2, 0.21), "provenance": provenance("rep 0")}
    text = report({"capacity": {}, "points": [stamped, {**row("real", 0.3, 0.2, None), "rep": 1}]}, (0.3, 0.5))
    table = text.split("#### Where each stored row comes from", 1)[1]
    got = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    at = stamped["provenance"]["at"]
    assert at.endswith(" UTC") and at in got["fake 50% rep 0"] and "| rep 0 |" in got["fake 50% rep 0"]
    assert "| ? | ? | ? |" in got["real 30% rep 1"]  # a row stored before rows carried their provenance


def test_the_simulator_is_given_llmd_as_served_and_its_measured_overheads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake points' simulation: the served config (bench tenants, their limits, the bench's
    deadline for both classes, the model's degradation steps), llmd's overheads as measured, the exact controller."""
    import llmd.plan.sim.fleet as sim_fleet
    import llmd.plan.sim.report as sim_report
    from bench.lib.plan_e2e import config_for, served
    from bench.lib.plan_load import mix_trace
    from bench.lib.plan_sim import simulated

    seen = []

    class Fleet:  # what simulated() builds: it is given the spec, run, then reported on
        def __init__(self, spec: Any, trace: Any, step: Any) -> None:
            seen.append(spec)
            self.rec = types.SimpleNamespace(per_request=None)

        def run(self) -> None:
            pass

    monkeypatch.setattr(sim_fleet, "Fleet", Fleet)
    monkeypatch.setattr(sim_report, "report_of", lambda fleet, step: SIM)
    simulated(mix_trace(0.5, 30.0, 1), FakeKnobStep(77.5, 3.3, 486.0), 0.0078, 0.0014, 5.0,
              served(config_for("fake", None)))
    spec = seen[0]
    assert (spec.ingress_s, spec.delivery_s, spec.warmup_s, spec.replicas) == (0.0078, 0.0014, 5.0, 1)
    assert spec.exact and spec.degradation.steps == ["cap_max_tokens", "batch"]
    assert [t.name for t in spec.tenants] == ["a", "b"] and spec.tenants[0].max_concurrent == 64
    assert spec.deadline_s == {"interactive": 600.0, "batch": 600.0}  # the replay's batch class is online
    assert spec.scheduling.target_itl_ms is None and spec.engine.max_num_batched_tokens == 2048  # as shipped


def test_the_ttft_split_takes_llmds_parts_of_each_interactive_request_from_its_ledger() -> None:
    from bench.lib.e2e_stats import ttft_split

    def m(i: int, klass: str, ttft: float, sched: float = 30.0, status: str = "ok") -> dict[str, Any]:
        return {"i": i, "class": klass, "ttft": ttft, "sched": sched, "status": status}

    measured = [m(0, "interactive", 0.50), m(1, "interactive", 1.00), m(2, "interactive", 0.70),
                m(3, "batch", 9.0), m(4, "interactive", 5.0, sched=5.0), m(5, "interactive", 5.0, status="503")]
    server = {"0": {"ttft_s": 0.49, "queue_s": 0.01, "prefill_s": 0.48},  # nothing held
              "1": {"ttft_s": 0.99, "queue_s": 0.01, "prefill_s": 0.48},  # first tokens held 0.5 s
              "2": {"ttft_s": 0.69, "queue_s": None, "prefill_s": 0.69},
              "3": {"ttft_s": 8.9, "queue_s": 8.0, "prefill_s": 0.9},
              "4": {"ttft_s": 4.9, "queue_s": 0.0, "prefill_s": 4.9}}
    sim = {0: [0.40, 2.0], 1: [0.40, 2.0], 2: [0.60, 2.0], 3: [9.0, 12.0], 4: [1.0, 3.0]}
    s = ttft_split(measured, server, sim, lo=20.0, hi=120.0)
    assert s is not None and s["n"] == 3  # batch, the warm-up and the refused one left out
    assert s["client"] == pytest.approx(0.70) and s["sim"] == pytest.approx(0.40)
    assert s["diff"] == pytest.approx(0.10) and s["held"] == pytest.approx(0.0)
    assert s["held_share"] == pytest.approx(1 / 3) and s["http"] == pytest.approx(0.01)
    assert s["diff_unheld"] == pytest.approx(0.10)  # 0.10, 0.10 (0.60 less 0.50 held) and 0.10
    rows = [{"engine": "real-noitl", "load": 0.3, "rep": 0, "ttft_split": s}]
    from bench.lib.plan_report import _split
    assert any("| real-noitl | 30% | 3 | 700 | 400 | 100 |" in line for line in _split(rows))
    assert ttft_split(measured, {}, sim, 20.0, 120.0) is None


def test_in_service_steps_add_the_extra_time_of_their_running_count_and_of_prefill() -> None:
    from bench.lib.plan_sim import InService

    base = FakeKnobStep(step_ms=50.0, step_ms_per_seq=1.0, prefill_tokens_per_s=1000.0)
    ins = InService(base, ((3.0, -0.002), (17.0, 0.012)), prefill_s=0.005)
    assert ins.extra(1) == pytest.approx(-0.002)  # below the first knot: the first knot's
    assert ins.extra(10) == pytest.approx(0.005)  # halfway: linear
    assert ins.extra(40) == pytest.approx(0.012)  # past the last: the last knot's
    decode = StepShape(10)
    assert ins.seconds(decode) == pytest.approx(base.seconds(decode) + 0.005)
    prefill = StepShape(9, prefill_tokens=100, prefill_seqs=1)
    assert ins.seconds(prefill) == pytest.approx(base.seconds(prefill) + 0.005 + 0.005)


def test_the_speed_in_service_is_read_from_decode_steps_by_running_count_then_prefill_steps() -> None:
    from bench.lib.plan_sim import MIX_CONTEXT, MIX_LONGEST, InService, in_service_knots, in_service_prefill

    base = FakeKnobStep(step_ms=50.0, step_ms_per_seq=1.0, prefill_tokens_per_s=1000.0)

    def decode(n: int) -> float:
        return base.seconds(StepShape(n, context_tokens=n * MIX_CONTEXT, longest_context=MIX_LONGEST))

    # An engine 1 ms a step slower per running sequence past 2, and 9 ms slower with prefill.
    steps = [[0.0, n, 0, decode(n) + 0.001 * (n - 2)] for n in (2, 3, 4, 17, 18, 19) for _ in range(20)]
    steps += [[0.0, 5, 0, 1.0]] * 19  # a bin with too few steps gives no knot
    knots = in_service_knots(steps, base, min_steps=20)
    assert [x for x, _ in knots] == [3.0, 18.0]
    assert [y for _, y in knots] == pytest.approx([0.001, 0.016])
    pre = [[0.0, 4, 200, base.seconds(StepShape(3, prefill_tokens=200, prefill_seqs=1, context_tokens=3 * MIX_CONTEXT,
                                                longest_context=MIX_LONGEST)) + 0.002 + 0.009]] * 20
    assert in_service_prefill(pre, InService(base, knots)) == pytest.approx(0.009)
    assert in_service_prefill(pre[:19], InService(base, knots)) == 0.0


def test_a_capacity_runs_steps_are_priced_at_the_context_its_client_saw_decoding() -> None:
    """The streams that decoded in a step are those prefilled before it began, not yet ended,
    whose next chunk came soonest after it (a preempted one waits seconds); each one's context is
    its prompt and the tokens it had. Priced so, a step's extra time does not depend on how far
    the run's streams were from the mix's mean length."""
    from bench.lib.plan_sim import MIX_CONTEXT, in_service_knots, step_contexts
    from llmd.stepmodel import StepModel

    streams = [
        {"prompt": 100, "at": [0.5, 0.9, 1.001, 1.05], "n": [1, 1, 1, 1]},  # 2 tokens by 0.95: 102
        {"prompt": 50, "at": [0.2, 0.3, 1.002], "n": [1, 3, 1]},  # 54
        {"prompt": 400, "at": [0.1, 0.2, 5.0], "n": [1, 1, 1]},  # preempted: nothing for 4 s
        {"prompt": 300, "at": [0.99, 1.2], "n": [1, 1]},  # prefilled in the step, not decoding
        {"prompt": 700, "at": [0.1, 0.5], "n": [1, 1]},  # ended before
    ]
    steps = [[1.0, 2, 0, 0.05], [1.0, 2, 120, 0.05], [9.0, 1, 0, 0.05]]
    assert step_contexts(steps, streams) == [(156, 102), None, None]

    base = StepModel(coef={"c_step": 0.05, "c_kv": 1e-5})
    own = [(n * 100, 150) for n in (2, 3, 4) for _ in range(20)]
    rows = [[0.0, c // 100, 0, base.seconds(StepShape(c // 100, context_tokens=c, longest_context=lc)) + 0.001]
            for c, lc in own]
    assert [y for _, y in in_service_knots(rows, base, contexts=own)] == pytest.approx([0.001])
    at_mix = in_service_knots(rows, base)[0][1]  # the same steps priced at the mix's mean context
    assert at_mix == pytest.approx(0.001 - 3 * (MIX_CONTEXT - 100) * 1e-5, abs=1e-4)


def test_the_filters_first_token_holds_are_read_from_the_first_chunks_of_completed_responses() -> None:
    from bench.lib.plan_sim import first_token_holds

    rows = [{"status": "ok", "n": [3, 1, 1]}, {"status": "ok", "n": [1, 1]}, {"status": "cut", "n": [5]},
            {"status": "429", "n": []}]
    assert first_token_holds(rows) == [2, 0]


def test_a_points_own_speed_is_read_from_its_own_steps_and_reported_apart(tmp_path: Any) -> None:
    """The diagnostic prices a real point at the speed its own run showed: a box 8 ms a step
    slower than the fit during that run gives a knot of +8 ms; a fake point, or one whose steps
    were not kept, has none; the report says it is not a check."""
    import json

    from bench.lib.plan_e2e import point_in_service, raw_path
    from bench.lib.plan_report import _own_speed_verdicts
    from llmd.stepmodel import StepModel

    results = tmp_path / "plan-e2e.json"
    base = StepModel(coef={"c_step": 0.05, "c_seq": 0.001})
    steps = [[float(i), 2, 0, base.seconds(StepShape(2)) + 0.008] for i in range(30)]
    row = {"engine": "real", "load": 0.5, "rep": 0}
    assert point_in_service(results, row, base) is None  # nothing kept for it
    raw_path(results, "real-0.5-0-server").write_text(json.dumps({"steps": steps}))
    own = point_in_service(results, row, base)
    assert own is not None
    assert own.extra(2) == pytest.approx(0.008, abs=1e-3)
    assert own.seconds(StepShape(2)) == pytest.approx(base.seconds(StepShape(2)) + 0.008, abs=1e-3)

    figs = {"ttft_p50": 1.0, "ttft_p95": 2.0, "itl_p50": 0.06, "itl_p95": 0.08, "tput": 10.0}
    off = {**figs, "itl_p50": 0.03}  # the simulator at its own speed 50 % fast on ITL p50
    point = {**row, "measured": {"figures": figs, "by_class": {"interactive": figs}, "tput_run": 10.0},
             "sim": None, "sim_by_class": {"interactive": figs}, "sim_own_speed_by_class": {"interactive": off}}
    out = _own_speed_verdicts([point], (0.5,))
    assert out[0].startswith("- Not a check")
    assert "ITL p50 ms 50.0%" in out[1] and "MISS" in out[1]
    assert _own_speed_verdicts([{**point, "sim_own_speed_by_class": None}], (0.5,)) == []
