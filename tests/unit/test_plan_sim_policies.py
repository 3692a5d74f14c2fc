"""llmd's own policies in `llmd plan sim`'s loop: one global token quota at the ingress, VTC
against a heavy tenant, the ITL target's seat limit, the batch tier yielding, autoscaling from the
warm pool, and a failed replica's requests finishing elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from llmd.config import TenantConfig
from llmd.config.parts import SchedulingConfig
from llmd.plan.errors import PlanError
from llmd.plan.sim.builtin import poisson_trace
from llmd.plan.sim.fleet import Fleet
from llmd.plan.sim.report import report_of, simulate
from llmd.plan.sim.spec import Autoscale, EngineSpec, SimSpec
from llmd.plan.sim.trace import Trace
from llmd.policy.saturation import SaturationDetector
from llmd.stepmodel import StepModel

STEP = StepModel(coef={"c_step": 0.005, "c_seq": 0.002, "c_tok": 1e-5})


def merged(*parts: Trace) -> Trace:
    """Several single-tenant traces as one, tenants in the order given."""
    cols = ("t", "klass", "prompt_tokens", "output_tokens", "prefix", "prefix_tokens")
    joined = {c: np.concatenate([getattr(p, c) for p in parts]) for c in cols}
    tenant = np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(parts)])
    order = np.argsort(joined["t"], kind="stable")
    return Trace(tenant=tenant[order], tenants=tuple(p.tenants[0] for p in parts),
                 **{c: v[order] for c, v in joined.items()})


def test_a_tenant_over_its_quota_is_shed_fleet_wide() -> None:
    """One token bucket at the ingress: four replicas do not give a tenant four quotas."""
    tr = merged(poisson_trace(5, 120, 100, 50, tenants=("a",), seed=1),
                poisson_trace(5, 120, 100, 50, tenants=("b",), seed=2))
    quota = (TenantConfig(name="a", tokens_per_minute=6000),)
    admitted = []
    for replicas in (1, 4):
        rep = simulate(SimSpec(replicas=replicas, tenants=quota), tr, STEP)
        assert rep["sheds"].get("a/tokens_per_minute", 0) > 300 and not any(k.startswith("b/") for k in rep["sheds"])
        admitted.append(rep["fairness"]["tenants"]["a"]["service"])
    # 6,000 tokens a minute (plus the full bucket at the start) over two minutes, 150 a request
    budget = (6000 + 6000 * 2) / 150 * (100 + 2 * 50)
    assert admitted[0] == admitted[1] <= budget * 1.05


def test_vtc_gives_a_light_tenant_its_share_against_a_heavy_one() -> None:
    tr = merged(poisson_trace(20, 60, 100, 50, tenants=("heavy",), seed=1),
                poisson_trace(1, 60, 100, 50, tenants=("light",), seed=2))
    # VTC alone: no seats reserved for tenants below their share, no preemption for fairness
    sched = SchedulingConfig(reserved_seats=0, preempt_for_fairness=False)
    vtc = simulate(SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=4), scheduling=sched), tr, STEP)
    fcfs = simulate(SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=4),
                            scheduling=sched.model_copy(update={"fairness": "fcfs"})), tr, STEP)
    light_vtc = vtc["by_tenant"]["light"]["ttft_s"]["p95"]
    light_fcfs = fcfs["by_tenant"]["light"]["ttft_s"]["p95"]
    assert light_vtc < 2.0 < 10 * light_vtc < light_fcfs
    assert vtc["by_tenant"]["heavy"]["ttft_s"]["p95"] > 5 * light_vtc


def test_an_itl_target_lowers_the_seats_and_the_itl() -> None:
    tr = poisson_trace(10, 120, 100, 200, seed=4)
    base = SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=64))
    free = simulate(base, tr, STEP)
    aimed = simulate(SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=64),
                             scheduling=SchedulingConfig(target_itl_ms=50)), tr, STEP)
    assert free["seats"]["limit_at_end"] == [64]
    assert aimed["seats"]["limit_at_end"][0] < 32
    assert aimed["by_class"]["interactive"]["itl_s"]["p95"] < 0.06 < free["by_class"]["interactive"]["itl_s"]["p95"]


def test_a_coarser_controller_interval_is_the_controllers_and_still_meets_the_target() -> None:
    """SimSpec.control_interval_s, an approximation for speed: the ITL controller and a busy
    replica's periodic tick run at it, and the seats still come down to meet the target."""
    tr = poisson_trace(10, 120, 100, 200, seed=4)
    fleet = Fleet(SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=64), control_interval_s=2.0,
                          scheduling=SchedulingConfig(target_itl_ms=50)), tr, STEP)
    fleet.run()
    rep, det = fleet.replicas[0], fleet.replicas[0].core.detector
    assert isinstance(det, SaturationDetector) and det.itl is not None
    assert det.itl.interval_s == rep.tick_every_s == 2.0
    aimed = report_of(fleet, STEP)
    assert aimed["seats"]["limit_at_end"][0] < 32
    assert aimed["by_class"]["interactive"]["itl_s"]["p95"] < 0.06
    with pytest.raises(PlanError, match="control_interval_s"):
        SimSpec(replicas=1, control_interval_s=0.0)


def test_batch_yields_to_interactive() -> None:
    batch = poisson_trace(6, 90, 100, 200, tenants=("t",), batch_share=1.0, seed=5)
    inter = poisson_trace(2, 90, 100, 20, tenants=("t",), seed=6)
    tr = merged(batch, inter)
    tr = Trace(**{**tr.__dict__, "tenant": np.zeros(len(tr), np.int32), "tenants": ("t",)})
    rep = simulate(SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=16)), tr, STEP)
    assert rep["preemptions"]["scheduler"] > 0
    assert rep["by_class"]["interactive"]["ttft_s"]["p95"] * 5 < rep["by_class"]["batch"]["ttft_s"]["p95"]


def test_the_warm_pool_scales_up_under_load() -> None:
    calm, rush = poisson_trace(1, 150, 200, 100, seed=7), poisson_trace(12, 150, 200, 100, seed=8)
    tr = Trace(**{**rush.__dict__, **{c: np.concatenate([getattr(calm, c), getattr(rush, c)])
                                      for c in ("tenant", "klass", "prompt_tokens", "output_tokens", "prefix",
                                                "prefix_tokens")},
                  "t": np.concatenate([calm.t, rush.t + 150.0])})
    spec = SimSpec(replicas=4, engine=EngineSpec(max_num_seqs=8),
                   autoscale=Autoscale(min_active=1, warm_pool=1, warm_start_s=5, cold_start_s=20))
    rep = simulate(spec, tr, STEP)
    assert rep["autoscale"]["scale_ups"] >= 1
    rows = rep["timeline"]
    assert [(r["replicas_active"], r["replicas_warm"]) for r in rows[:2]] == [(1, 1), (1, 1)]  # calm
    assert max(r["replicas_active"] for r in rows[3:]) > 1


def test_a_failed_replicas_requests_complete_elsewhere() -> None:
    tr = poisson_trace(4, 120, 200, 400, seed=8)
    rep = simulate(SimSpec(replicas=3, mtbf_s=40, repair_s=10, seed=2), tr, STEP)
    assert rep["failures"]["replicas"] >= 1 and rep["failures"]["requeued"] >= 1
    assert rep["failures"]["lost"] == 0
    assert rep["requests"]["arrived"] == len(tr)
    done = rep["requests"]["completed"] + rep["requests"].get("deadline_dropped", 0)  # a few outlive 120 s
    assert done == len(tr) - rep["requests"].get("shed", 0) and rep["requests"]["completed"] > 0.9 * len(tr)


def test_a_stream_past_its_deadline_ends_there_and_frees_its_seat() -> None:
    """As llmd's request ends at its deadline whatever it had produced (the engine's request
    aborted): one seat, a long stream cut at 2 s, and the request queued behind it seated then."""
    tr = Trace(t=np.array([0.0, 1.5]), tenant=np.zeros(2, np.int32), klass=np.zeros(2, np.int8),
               prompt_tokens=np.array([50, 50], np.int32), output_tokens=np.array([2000, 20], np.int32),
               prefix=np.array([-1, -1], np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("t",))
    spec = SimSpec(replicas=1, engine=EngineSpec(max_num_seqs=1), ingress_s=0, delivery_s=0,
                   deadline_s={"interactive": 2.0, "batch": 2.0})
    rep = simulate(spec, tr, STEP)  # the first alone would take 2000 steps of 7 ms: 14 s
    assert rep["requests"]["deadline_dropped"] == 1 and rep["requests"]["completed"] == 1
    e2e = rep["by_class"]["interactive"]["e2e_s"]
    assert e2e["count"] == 1 and 0.5 + 20 * 0.007 < e2e["p50"] < 0.5 + 40 * 0.007  # seated at ~2.0 s


@pytest.mark.timeout(30)  # without the fix the simulation never ends
def test_a_batch_request_held_back_on_an_idle_engine_is_seated_after_the_quiet_period() -> None:
    """While interactive work ran in the last second, batch gets no seat (the shipped config's
    batch_seats_with_interactive = 0); the engine then goes idle with the batch request queued,
    and the scheduler must tick again on its own (a simulation once waited forever here)."""
    tr = Trace(t=np.array([0.0, 0.05]), tenant=np.zeros(2, np.int32), klass=np.array([0, 1], np.int8),
               prompt_tokens=np.array([10, 10], np.int32), output_tokens=np.array([3, 3], np.int32),
               prefix=np.full(2, -1, np.int32), prefix_tokens=np.zeros(2, np.int32), tenants=("a",))
    sched = SchedulingConfig(batch_seats_with_interactive=0, interactive_quiet_s=1.0)
    rep = simulate(SimSpec(replicas=1, scheduling=sched), tr, STEP)
    assert rep["requests"]["completed"] == 2
    batch_ttft = rep["by_class"]["batch"]["ttft_s"]["p50"]
    assert 0.95 <= batch_ttft <= 1.2  # seated once the interactive request's second of quiet has passed
