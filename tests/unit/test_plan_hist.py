"""The simulator's latency histograms: binned for a fleet's hour, exact for the check against llmd."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from llmd.plan.sim.hist import ExactHist, Hist
from llmd.plan.sim.report import simulate
from llmd.plan.sim.spec import SimSpec
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepModel, StepShape


def one(prompt: int, output: int) -> Trace:
    return Trace(t=np.array([0.0]), tenant=np.zeros(1, np.int32), klass=np.zeros(1, np.int8),
                 prompt_tokens=np.array([prompt], np.int32), output_tokens=np.array([output], np.int32),
                 prefix=np.array([-1], np.int32), prefix_tokens=np.zeros(1, np.int32), tenants=("t",))


def test_the_exact_quantile_is_a_sample_where_the_binned_one_is_a_bin_middle() -> None:
    xs = [1.000, 1.004, 1.008, 1.012]  # four samples inside one 2.3 % bin
    exact, binned = ExactHist(), Hist()
    for x in xs:
        exact.add(x)
        binned.add(x)
    assert exact.quantile(0.5) == 1.004  # the lower median: the first reaching half the weight
    assert exact.quantile(0.95) == 1.012
    assert binned.quantile(0.5) == binned.quantile(0.95)  # one bin: one answer
    assert exact.summary()["count"] == binned.summary()["count"] == 4
    assert exact.summary()["mean"] == pytest.approx(binned.summary()["mean"])


def test_the_exact_quantile_weighs_its_samples() -> None:
    h = ExactHist()
    h.add(0.2, 1.0)
    h.add(0.1, 9.0)  # added out of order
    assert h.quantile(0.9) == 0.1
    assert h.quantile(0.95) == 0.2
    assert ExactHist().quantile(0.5) is None


def test_an_exact_histogram_merges_only_another_exact_one() -> None:
    a, b = ExactHist(), ExactHist()
    a.add(1.0)
    b.add(3.0)
    b.add(2.0)
    a.merge(b)
    assert (a.n, a.quantile(0.5), a.quantile(1.0)) == (3.0, 2.0, 3.0)
    with pytest.raises(TypeError):
        a.merge(Hist())


def test_the_end_to_end_mode_reports_every_decode_step_exactly() -> None:
    """A long decode is one segment whose gaps rise by c_kv a step: exact mode's percentiles are
    its steps' own gaps (p95 − p50 = 450 steps of the rise over 1000 gaps), and a lone TTFT is
    ingress + prefill + delivery to the float. The binned mode (a fleet's hour) records a long
    segment at its rise's quartiles, so its p95 reads lower."""
    c_kv = 1e-5
    step = StepModel(coef={"c_step": 0.01, "c_kv": c_kv})
    trace = one(1000, 1001)
    exact = simulate(SimSpec(replicas=1, ingress_s=0.003, delivery_s=0.001, exact=True), trace, step)
    binned = simulate(SimSpec(replicas=1, ingress_s=0.003, delivery_s=0.001), trace, step)
    itl, ttft = exact["by_class"]["interactive"]["itl_s"], exact["by_class"]["interactive"]["ttft_s"]
    assert itl["count"] == 1000
    assert itl["p95"] - itl["p50"] == pytest.approx(450 * c_kv, rel=1e-6)
    assert ttft["p50"] == pytest.approx(0.003 + step.seconds(StepShape(0, 1000, 1, 0, 1000 * 500)) + 0.001,
                                        rel=1e-9)
    b = binned["by_class"]["interactive"]["itl_s"]
    assert itl["p50"] * 0.975 < b["p95"] < itl["p95"]


def two(outputs: tuple[int, int], at: tuple[float, float]) -> Trace:
    return Trace(t=np.array(at), tenant=np.zeros(2, np.int32), klass=np.zeros(2, np.int8),
                 prompt_tokens=np.array([100, 100], np.int32), output_tokens=np.array(outputs, np.int32),
                 prefix=np.array([-1, -1], np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("t",))


def test_the_end_to_end_mode_counts_the_gaps_of_the_requests_its_client_counts() -> None:
    """As the check's client: the gaps of a request that arrived in the warm-up count for nothing,
    even those after it, nor do a stream's that the replay cut at the horizon."""
    step = StepModel(coef={"c_step": 0.01, "c_seq": 0.001})
    base = SimSpec(replicas=1, ingress_s=0, delivery_s=0, exact=True)
    early_long = simulate(replace(base, warmup_s=1.0), two((500, 20), (0.0, 2.0)), step)
    assert early_long["by_class"]["interactive"]["itl_s"]["count"] == 19  # the second's; not the first's ~400
    cut = simulate(replace(base, horizon_s=3.0), two((20, 1000), (0.0, 0.5)), step)
    assert cut["by_class"]["interactive"]["itl_s"]["count"] == 19  # the second never completes by 3 s
    binned = simulate(replace(base, warmup_s=1.0, exact=False), two((500, 20), (0.0, 2.0)), step)
    assert binned["by_class"]["interactive"]["itl_s"]["count"] > 19  # a fleet's hour counts gaps by time


def test_a_held_first_token_comes_with_the_held_ones_and_their_gaps_are_not_seen() -> None:
    """llmd's output filters hold a response's first tokens while they could still be a match:
    the client's first token comes with the next `hold`, so its TTFT grows by their gaps and it
    sees that many fewer gaps."""
    from llmd.plan.errors import PlanError

    step = StepModel(coef={"c_step": 0.01, "c_seq": 0.002})  # every decode step alike: 12 ms
    base = SimSpec(replicas=1, ingress_s=0, delivery_s=0, exact=True, horizon_s=100.0)
    free = simulate(base, one(100, 20), step)["by_class"]["interactive"]
    held = simulate(replace(base, first_token_holds=(3,)), one(100, 20), step)["by_class"]["interactive"]
    decode = step.seconds(StepShape(1))
    assert held["ttft_s"]["p50"] - free["ttft_s"]["p50"] == pytest.approx(3 * decode, rel=1e-6)
    assert (free["itl_s"]["count"], held["itl_s"]["count"]) == (19, 16)
    assert held["e2e_s"]["p50"] == free["e2e_s"]["p50"]
    with pytest.raises(PlanError, match="exact mode and a horizon"):
        SimSpec(replicas=1, first_token_holds=(3,))
