"""What llmd itself does around the engine, in the simulator: degradation's shedding (the 503s
llmd answers under sustained overload) and its cap on max_tokens, the measured overheads
(ingress per request, delivery per token) as SimSpec inputs, and the step of lag before a seat a
finished request freed is filled (llmd reads the engine's output while the next step runs)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from llmd.config.parts import DegradationConfig, SchedulingConfig
from llmd.plan.sim.builtin import poisson_trace
from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import EngineSpec, SimSpec
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepModel

FLAT = StepModel(coef={"c_step": 0.01})  # every step 10 ms, whatever it computes
SLOW = StepModel(coef={"c_step": 0.02, "c_seq": 0.004, "c_tok": 2e-4})


def trace_of(rows: list[tuple[float, int, int]], klass: int = 0) -> Trace:
    """(arrival s, prompt, output) per request; one tenant, no shared prefix."""
    n = len(rows)
    return Trace(t=np.array([r[0] for r in rows]), tenant=np.zeros(n, np.int32), klass=np.full(n, klass, np.int8),
                 prompt_tokens=np.array([r[1] for r in rows], np.int32),
                 output_tokens=np.array([r[2] for r in rows], np.int32), prefix=np.full(n, -1, np.int32),
                 prefix_tokens=np.zeros(n, np.int32), tenants=("t",))


def first_tokens(spec: SimSpec, trace: Trace, step: StepModel) -> dict[int, float]:
    """Each request's first-token time (engine side), by trace row."""
    fleet = Fleet(spec, trace, step)
    got: dict[int, float] = {}
    record = fleet.rec.first_token

    def keep(r: Req, t: float) -> None:
        got[r.i] = t
        record(r, t)

    fleet.rec.first_token = keep  # type: ignore[method-assign]
    fleet.run()
    return got


def overload(steps: list[str], **kw: float) -> tuple[Fleet, Trace]:
    """Four times what one small replica serves, for two minutes."""
    trace = poisson_trace(8.0, 120.0, 200, 60, seed=4)
    spec = SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=8), scheduling=SchedulingConfig(max_running=8),
                   deadline_s={"interactive": 600.0, "batch": 86400.0},
                   degradation=DegradationConfig(steps=steps, overload_wait_s=kw.get("wait", 5.0),  # type: ignore[arg-type]
                                                 sustain_s=kw.get("sustain", 5.0), recover_s=30.0,
                                                 max_tokens_cap=int(kw.get("cap", 256))))
    fleet = Fleet(spec, trace, SLOW)
    fleet.run()
    return fleet, trace


def test_sustained_overload_sheds_interactive_requests_to_the_batch_tier() -> None:
    fleet, trace = overload(["batch"])
    c = fleet.rec.counts
    assert sum(n for (_, why), n in fleet.rec.shed.items() if why == "overloaded_use_batch") == c["shed"] > 0
    assert c["completed"] + c["shed"] + c["deadline_dropped"] == len(trace)
    # Nothing is shed before the overload has lasted sustain_s.
    calm, _ = overload([])
    assert calm.rec.counts["shed"] == 0 and calm.rec.counts["completed"] == len(trace)
    assert c["completed"] < len(trace)


def test_no_shedding_without_sustained_overload() -> None:
    fleet, _ = overload(["batch"], sustain=1e6)
    assert fleet.rec.counts["shed"] == 0


def test_cap_max_tokens_shortens_answers_under_overload() -> None:
    capped, trace = overload(["cap_max_tokens"], cap=8)
    plain, _ = overload([])
    assert capped.rec.counts["shed"] == 0
    assert sum(capped.rec.tokens_out.values()) < sum(plain.rec.tokens_out.values())
    assert sum(plain.rec.tokens_out.values()) == int(trace.output_tokens.sum())


def test_overheads_are_inputs_ingress_delays_delivery_adds() -> None:
    """A lone request: first token at arrival + ingress + one prefill step; the client's TTFT adds delivery."""
    tr = trace_of([(1.0, 50, 4)])
    for ingress, delivery in ((0.0, 0.0), (0.009, 0.0016)):
        spec = SimSpec(replicas=1, ingress_s=ingress, delivery_s=delivery)
        assert first_tokens(spec, tr, FLAT)[0] == pytest.approx(1.0 + ingress + 0.01)
        fleet = Fleet(spec, tr, FLAT)
        fleet.run()
        ttft = fleet.rec.ttft[("class", "interactive")].quantile(0.5)
        assert ttft == pytest.approx(ingress + 0.01 + delivery, rel=0.012)  # half a histogram bin


def test_a_seat_a_finished_request_frees_is_filled_a_step_later() -> None:
    """Two seats; a long request and a short one run, a third waits. The short one ends at the
    boundary at 30 ms; llmd hears of it while the engine runs the next step, so the third is
    seated in the step after (prefill 40-50 ms), not at once (30-40 ms)."""
    tr = trace_of([(0.0, 10, 50), (0.001, 10, 2), (0.002, 10, 2)])
    spec = SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=8), scheduling=SchedulingConfig(max_running=2),
                   ingress_s=0.0, delivery_s=0.0)
    got = first_tokens(spec, tr, FLAT)
    assert got[0] == pytest.approx(0.01)
    assert got[1] == pytest.approx(0.02)  # arrived during the first step: prefilled in the second
    assert got[2] == pytest.approx(0.05)


def test_exact_sees_a_gap_per_token_and_a_record_per_step() -> None:
    """llmd's ITL controller reads a gap per streamed token and one history record per engine
    step; with exact the simulator feeds it the same, not a few per decode segment."""
    tr = trace_of([(0.0, 20, 30), (0.0, 20, 30), (0.005, 40, 30)])
    sched = SchedulingConfig(target_itl_ms=200)
    for exact in (False, True):
        spec = SimSpec(replicas=1, scheduling=sched, ingress_s=0.0, delivery_s=0.0, exact=exact)
        fleet = Fleet(spec, tr, SLOW)
        fleet.run()
        eng = fleet.replicas[0].engine
        if exact:
            assert len(eng.history) == int(eng.basis[0])  # every step ran, one record each
            assert len(eng.gaps) == 3 * (30 - 1)  # every token but each stream's first
            assert all(g > 0 for _, g in eng.gaps)
        else:
            assert len(eng.history) < int(eng.basis[0]) and len(eng.gaps) < 3 * (30 - 1)


def test_batch_streams_feed_the_itl_controller_no_gaps() -> None:
    """As llmd (dispatch.account): only interactive streams' gaps steer the controller; a batch
    stream's would include the minutes it yields its seat. The steps still count in its history."""
    for klass, want in ((0, 3 * (30 - 1)), (1, 0)):
        tr = trace_of([(0.0, 20, 30), (0.0, 20, 30), (0.005, 40, 30)], klass=klass)
        spec = SimSpec(replicas=1, scheduling=SchedulingConfig(target_itl_ms=200), ingress_s=0.0, delivery_s=0.0,
                       exact=True)
        fleet = Fleet(spec, tr, SLOW)
        fleet.run()
        eng = fleet.replicas[0].engine
        assert len(eng.gaps) == want
        assert len(eng.history) == int(eng.basis[0])


def test_a_horizon_cuts_what_still_runs_and_counts_only_completed_requests() -> None:
    """As a replay cuts its streams a while after the last arrival: the long request has its
    first token by the horizon but does not complete, so only the short one's TTFT counts."""
    tr = trace_of([(0.0, 10, 1000), (0.5, 10, 3)])
    base = SimSpec(replicas=1, ingress_s=0.0, delivery_s=0.0)
    for horizon, counted in ((None, 2), (2.0, 1)):
        fleet = Fleet(replace(base, horizon_s=horizon), tr, FLAT)
        fleet.run()
        assert fleet.rec.ttft[("class", "interactive")].n == counted
        assert fleet.rec.counts["completed"] == counted
        assert fleet.now <= (horizon or 1e9)


def test_arrivals_during_a_long_step_all_reach_the_engine_as_llmd_sends_them() -> None:
    """llmd reads the engine's queue from its last step record, so during a long step (a prefill
    chunk) it sends every arrival in, and the engine prefills them together when the step ends.
    Reading the queue live, the simulator held all but the first in llmd's queue and prefilled
    them a step later: the same work in another order, and another TTFT tail."""
    tr = trace_of([(0.0, 3000, 5), (0.05, 50, 5), (0.10, 50, 5)])
    spec = SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=8), ingress_s=0.0, delivery_s=0.0,
                   exact=True)
    got = first_tokens(spec, tr, SLOW)
    first_step = 0.02 + 0.004 + 2e-4 * 2048  # the long request's first chunk (2048-token budget)
    assert got[1] > first_step
    assert got[2] == pytest.approx(got[1])  # one step prefilled both
