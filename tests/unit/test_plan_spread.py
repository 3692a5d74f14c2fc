"""(c2)'s pieces: the nudged step time, the engine's measured step spread, the bands' verdicts."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
import pytest

from bench.lib.plan_spread import Nudged, bands, step_noise, table
from llmd.plan.sim.report import simulate
from llmd.plan.sim.spec import SimSpec
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepModel, StepShape


def test_a_nudge_is_seeded_centred_and_keeps_the_stamp() -> None:
    step = StepModel(coef={"c_step": 0.1}, stamp={"block_size": "128"})
    shape = StepShape(4)
    a, b, c = Nudged(step, 0.05, 1), Nudged(step, 0.05, 1), Nudged(step, 0.05, 2)
    xs = [a.seconds(shape) for _ in range(4000)]
    assert xs[:50] == [b.seconds(shape) for _ in range(50)]  # the same seed, the same draws
    assert xs[:50] != [c.seconds(shape) for _ in range(50)]
    assert statistics.median(xs) == pytest.approx(0.1, rel=0.01)
    assert statistics.median(abs(x / 0.1 - 1) for x in xs) * 1.4826 == pytest.approx(0.05, rel=0.1)
    assert a.stamp == {"block_size": "128"}  # the simulator reads the engine's KV block there
    assert Nudged(step, 0.0, 3).seconds(shape) == step.seconds(shape)


def test_the_simulator_prices_every_step_through_the_nudge() -> None:
    """Two overlapping requests: nudged runs differ from each other and from the plain one, and
    a zero nudge gives the plain run's figures to the float."""
    trace = Trace(t=np.array([0.0, 0.05]), tenant=np.zeros(2, np.int32), klass=np.zeros(2, np.int8),
                  prompt_tokens=np.array([300, 200], np.int32), output_tokens=np.array([60, 40], np.int32),
                  prefix=np.array([-1, -1], np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("t",))
    step = StepModel(coef={"c_step": 0.02, "c_seq": 0.002, "c_tok": 0.0005})
    spec = SimSpec(replicas=1, ingress_s=0.0, delivery_s=0.0, exact=True)

    def itl_p95(s: Any) -> float:
        return float(simulate(spec, trace, s)["by_class"]["interactive"]["itl_s"]["p95"])

    plain = itl_p95(step)
    assert itl_p95(Nudged(step, 0.0, 0)) == plain
    nudged = {itl_p95(Nudged(step, 0.05, k)) for k in range(3)}
    assert len(nudged) == 3 and plain not in nudged


def test_the_step_spread_is_robust_and_per_running_count() -> None:
    """Decode steps at two running counts, each ±5 % about its own median, one wild outlier and
    prefill steps that must not count: the robust sigma is 1.4826 × 5 %."""
    steps: list[list[float]] = []
    for n, base in ((2, 0.06), (8, 0.10)):
        steps += [[0.0, n, 0, base * f] for f in (0.95, 1.0, 1.05) * 10]
    steps.append([0.0, 2, 0, 5.0])  # one stalled step
    steps += [[0.0, 2, 300, 0.4]] * 40  # prefill steps: another distribution, not noise
    steps += [[0.0, 5, 0, 0.2], [0.0, 5, 0, 0.08]]  # a count with too few steps
    assert step_noise(steps) == pytest.approx(1.4826 * 0.05, rel=1e-6)
    assert step_noise([[0.0, 3, 0, 0.1]] * 5) is None
    assert step_noise([]) is None


def _row(load: float, rep: int, ttft: float) -> dict[str, Any]:
    figs = {"ttft_p50": ttft, "ttft_p95": 2 * ttft, "itl_p50": 0.05, "itl_p95": 0.07, "tput": 10.0}
    return {"load": load, "rep": rep, "seed": 7, "rate": 1.0,
            "measured": {"tput_run": 10.0, "by_class": {"interactive": figs}}}


def test_a_figure_that_a_nudge_moves_past_the_target_is_named() -> None:
    """The simulated TTFT p50 swings ±25 % with the seed, every other figure stays: that one is
    named as moving past the 3 % target, and llmd's runs are placed against the range ± target."""
    rows = [_row(0.5, 0, 1.0), _row(0.5, 1, 2.0), {**_row(0.5, 2, 9.0), "seed": 8}]  # rep 2: another trace
    seen: list[Any] = []

    def simulate_row(row: dict[str, Any], wrap: Any) -> dict[str, Any]:
        s = wrap(StepModel(coef={"c_step": 0.1}))
        seen.append(s)
        swing = {0: 0.75, 1: 1.25}.get(getattr(s, "seed", -1), 1.0) if isinstance(s, Nudged) else 1.0
        return {"interactive": {"ttft_p50": 1.0 * swing, "ttft_p95": 2.0, "itl_p50": 0.05, "itl_p95": 0.07,
                                "tput": 10.0}}

    found = bands(rows, simulate_row, 0.01, 3)
    assert len(seen) == 4 and [s.seed for s in seen[1:]] == [0, 1, 2] and all(s.sigma == 0.01 for s in seen[1:])
    by = {b.key: b for b in found}
    assert by["ttft_p50"].measured == [1.0, 2.0] and by["ttft_p50"].nudged == [0.75, 1.25, 1.0]
    assert by["ttft_p50"].half_width_pct == pytest.approx(25.0)
    assert not by["ttft_p50"].near(3.0)  # 2.0 lies past 1.25 × 1.03
    assert by["ttft_p50"].near(60.0)
    assert by["ttft_p95"].half_width_pct == 0.0 and not by["ttft_p95"].near(3.0)  # 4.0 measured against 2.0
    text = "\n".join(table("fake", 0.01, 3, found))
    assert "1 of 5 figures move by more than the target (3 % latency, 3 % throughput)" in text
    assert "50% interactive TTFT p50 ms ±25 %" in text
    assert "llmd 1000, 2000*" in text
    assert "within the target of the nudged range in 3 of 5" in text
    # (c)'s check where a run can make it: TTFT p95 (4.0 measured, 2.0 simulated) is the worst
    assert ("on the 4 figures a run can check: the simulation as (c) runs it is within the targets on 3 of "
            "them, worst |error| 50.0 % (50% interactive TTFT p95 ms)") in text
    assert not math.isnan(by["tput"].half_width_pct)
