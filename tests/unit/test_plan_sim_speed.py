"""The simulator's speed-ups change nothing it computes: a step priced from its six fields is
StepModel.seconds of that shape, trace rows read a block at a time are the trace's rows, the
garbage collector is back as it was after a run, and a routing candidate is reused only while
the router's view of its replica is the same."""

from __future__ import annotations

import gc
import random

import pytest

from llmd.plan.sim import fleet as fleet_mod
from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import SimSpec
from llmd.policy.placement import Candidate
from llmd.policy.queue import QueuedRequest
from llmd.stepmodel import StepModel, StepShape, pricer
from tests.unit.test_plan_sim import STEP, busy_trace


class Doubled:
    """A step function that is not a StepModel (the pricer must ask it)."""

    def seconds(self, shape: StepShape) -> float:
        return 2 * STEP.seconds(shape)


def test_pricer_is_seconds_of_the_shape_float_for_float() -> None:
    rng = random.Random(0)
    full = StepModel(coef={"c_step": 0.015, "c_seq": 5e-5, "c_tok": 2e-5, "c_kv": 2e-8, "c_attn": 1e-10,
                           "c_ctx": 3e-9})
    for step in (full, STEP, StepModel(coef={}), Doubled()):
        price = pricer(step)
        for _ in range(500):
            f = (rng.randint(0, 256), rng.randint(0, 8192), rng.randint(0, 8), rng.randint(0, 10**6),
                 rng.choice([0.0, rng.random() * 1e8]), rng.randint(0, 4096))
            assert price(*f) == step.seconds(StepShape(*f))


def test_trace_rows_read_by_block_are_the_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_mod, "ROW_BLOCK", 7)  # many blocks, and a short last one
    tr = busy_trace(duration=3.0)
    f = Fleet(SimSpec(replicas=2), tr, STEP)
    for i in [*range(len(tr)), 3, 0, len(tr) - 1]:  # in order, then back: a block is re-read
        want = (int(tr.tenant[i]), int(tr.klass[i]), int(tr.prompt_tokens[i]), int(tr.output_tokens[i]),
                float(tr.t[i]), int(tr.prefix[i]), int(tr.prefix_tokens[i]))
        got = f._row(i)
        assert got == want
        assert [type(v) for v in got] == [type(v) for v in want]


def test_the_collector_is_restored_after_a_run() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    f = Fleet(SimSpec(replicas=2), busy_trace(duration=5.0), STEP)
    seen: list[tuple[int, int, int]] = []
    f._minute = lambda final=False: seen.append(gc.get_threshold())  # type: ignore[method-assign]
    f.run()
    assert seen and seen[0] != before  # rare collections during the run
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_a_candidate_is_reused_only_for_the_same_view() -> None:
    f = Fleet(SimSpec(replicas=3, route_candidates=3), busy_trace(duration=5.0), STEP)
    f.scaler.start()
    seen: list[list[Candidate]] = []
    choose = f.router.choose
    f.router.choose = lambda cands, *a: seen.append(list(cands)) or choose(cands, *a)  # type: ignore[method-assign]
    r = Req(0, 0, 0, 500, 50, -1, 0, 0.0, QueuedRequest("0", "a", "interactive", 500, 50, 60.0), True)
    f.route(r)
    f.route(r)
    assert sorted(map(id, seen[0])) == sorted(map(id, seen[1]))  # the same view: the same objects
    f.now = 1.0
    f._gossip()  # a fresh view of every replica
    f.route(r)
    assert not set(map(id, seen[2])) & set(map(id, seen[1]))
    assert all(c.load is f.loads[int(c.node[1:])] for c in seen[2])
