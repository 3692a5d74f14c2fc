"""llmd.metrics: request records in, Prometheus text out; live gauges read at scrape time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from llmd.backends.base import EngineStats, StepRecord
from llmd.metrics import Metrics
from llmd.policy.classes import ModelQueue
from llmd.policy.fairness import FAIRNESS
from llmd.policy.queue import QueuedRequest
from llmd.policy.saturation import SaturationDetector, ThroughputEstimate
from llmd.policy.scheduler import SchedulerCore
from llmd.scheduler import Scheduler
from llmd.supervisor import EngineWatch


def _runtime(stats: EngineStats) -> SimpleNamespace:
    queue = ModelQueue(FAIRNESS["fcfs"], lambda t: "fifo")
    sched = SimpleNamespace(running={1: object(), 2: object()}, dropped=3, preempted=4, seat_limit=8)
    backend = SimpleNamespace(stats=stats, version="v7")
    watch = EngineWatch(attempts=5, timeout_s=60)
    watch.restarts, watch.resumed, watch.requeued = 2, 5, 7
    return SimpleNamespace(queue=queue, scheduler=sched, backend=backend, watch=watch, ready=False)


class Served:
    """The registry's served versions, as the live gauges read them."""

    def __init__(self, models: dict[str, Any]) -> None:
        self.models = models

    def primaries(self) -> dict[str, Any]:
        return self.models

    def versions(self, model: str) -> dict[str, Any]:
        rt = self.models[model]
        return {rt.backend.version: rt} if rt is not None else {}


@pytest.fixture
def svc() -> Served:
    stats = EngineStats()
    stats.record(StepRecord(t=1.0, running=5, waiting=2, kv_usage=0.4, generated_tokens=9),
                 prefix_queries=100, prefix_hits=60, preempted=1)
    stats.record(StepRecord(t=2.0, running=6, waiting=1, kv_usage=0.5, generated_tokens=9),
                 prefix_queries=20, prefix_hits=10, preempted=2)
    return Served({"m": _runtime(stats), "loading": None})


def rec(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "request_id": "r", "endpoint": "chat", "model": "m", "version": "v7", "tenant": "a", "status": "ok",
        "decision": "admitted", "prompt_tokens": 10, "cached_prompt_tokens": 4, "output_tokens": 5,
        "queue_time_s": 0.02, "ttft_s": 0.1, "total_time_s": 0.5, "itl_mean_s": 0.01, "itl_p95_s": 0.02,
        "itl_samples": [0.01, 0.01, 0.02, 0.005], "prefill_s": 0.08, "replica": 0,
    }
    base.update(kw)
    return base


def scrape(m: Metrics) -> dict[str, Any]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    hits = [s.value for s in fams[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (sample, labels, fams[family].samples)
    return hits[0]


def feed(m: Metrics) -> None:
    m.observe(rec(tenant="a", cost=0.002))
    m.observe(rec(tenant="a", cost=0.001, prompt_tokens=20, output_tokens=15, total_time_s=1.5))
    m.observe(rec(tenant="b", itl_samples=None, itl_mean_s=None))
    # waited, then dropped at its deadline: latency counts, nothing reached the engine
    m.observe(rec(tenant="b", status="deadline", decision="dropped:deadline", queue_time_s=None, ttft_s=None,
                  output_tokens=0, cached_prompt_tokens=0, total_time_s=30.0, itl_samples=[], itl_mean_s=None,
                  prefill_s=None))
    for reason in ("queue_full", "queue_full", "tokens_per_minute"):
        m.observe(rec(tenant="b", status="shed", decision=f"shed:{reason}", queue_time_s=None, ttft_s=None,
                      output_tokens=0, cached_prompt_tokens=0, total_time_s=0.001, itl_samples=None,
                      itl_mean_s=None, prefill_s=None))
    m.observe(rec(model=None, tenant=None, status="rejected", decision=None, prompt_tokens=0, queue_time_s=None,
                  ttft_s=None, output_tokens=0, cached_prompt_tokens=0, itl_samples=None, itl_mean_s=None,
                  prefill_s=None))


def test_requests_tokens_and_shed(svc: Served) -> None:
    m = Metrics(svc)
    feed(m)
    f = scrape(m)
    req = "llmd:requests_total"
    assert value(f, "llmd:requests", req, model="m", tenant="a", status="ok") == 2
    assert value(f, "llmd:requests", req, model="m", tenant="b", status="ok") == 1
    assert value(f, "llmd:requests", req, model="m", tenant="b", status="shed") == 3
    assert value(f, "llmd:requests", req, model="m", tenant="b", status="deadline") == 1
    assert value(f, "llmd:requests", req, model="", tenant="", status="rejected") == 1
    assert value(f, "llmd:requests_shed", "llmd:requests_shed_total", model="m", reason="queue_full") == 2
    assert value(f, "llmd:requests_shed", "llmd:requests_shed_total", model="m", reason="tokens_per_minute") == 1
    # prompt tokens only for dispatched requests; shed and dropped ones never reached the engine
    assert value(f, "llmd:prompt_tokens", "llmd:prompt_tokens_total", model="m", tenant="a") == 30
    assert value(f, "llmd:prompt_tokens", "llmd:prompt_tokens_total", model="m", tenant="b") == 10
    assert value(f, "llmd:generation_tokens", "llmd:generation_tokens_total", model="m", tenant="a") == 20
    assert value(f, "llmd:generation_tokens", "llmd:generation_tokens_total", model="m", tenant="b") == 5
    assert value(f, "llmd:prompt_tokens_cached", "llmd:prompt_tokens_cached_total", model="m", tenant="a") == 8
    assert value(f, "llmd:cost", "llmd:cost_total", model="m", tenant="a") == pytest.approx(0.003)
    # 0.003 over 10+5+20+15 = 50 tokens -> 60 per million; tenant b carried no cost: no series
    assert value(f, "llmd:cost_per_million_tokens", "llmd:cost_per_million_tokens", model="m", tenant="a") \
        == pytest.approx(60.0)
    assert not [s for s in f["llmd:cost_per_million_tokens"].samples if s.labels["tenant"] == "b"]


def test_histograms(svc: Served) -> None:
    m = Metrics(svc)
    feed(m)
    f = scrape(m)
    ttft, e2e = "llmd:time_to_first_token_seconds", "llmd:e2e_request_latency_seconds"
    itl = "llmd:inter_token_latency_seconds"
    assert value(f, ttft, ttft + "_count", model="m", tenant="a") == 2
    assert value(f, ttft, ttft + "_sum", model="m", tenant="a") == pytest.approx(0.2)
    assert value(f, ttft, ttft + "_count", model="m", tenant="b") == 1  # shed/dropped have no TTFT
    # e2e: admitted requests only (the dropped one counts, the shed ones do not)
    assert value(f, e2e, e2e + "_count", model="m", tenant="a") == 2
    assert value(f, e2e, e2e + "_sum", model="m", tenant="a") == pytest.approx(2.0)
    assert value(f, e2e, e2e + "_count", model="m", tenant="b") == 2
    assert value(f, e2e, e2e + "_sum", model="m", tenant="b") == pytest.approx(30.5)
    assert value(f, e2e, e2e + "_bucket", model="m", tenant="b", le="0.5") == 1
    assert value(f, e2e, e2e + "_bucket", model="m", tenant="b", le="+Inf") == 2
    # ITL: one observation per gap
    assert value(f, itl, itl + "_count", model="m", tenant="a") == 8
    assert value(f, itl, itl + "_sum", model="m", tenant="a") == pytest.approx(0.09)
    assert value(f, itl, itl + "_bucket", model="m", tenant="a", le="0.005") == 2
    assert not [s for s in f[itl].samples if s.labels.get("tenant") == "b"]
    q = "llmd:request_queue_time_seconds"
    assert value(f, q, q + "_count", model="m", tenant="a") == 2
    assert value(f, q, q + "_count", model="m", tenant="b") == 1
    tpot = "llmd:request_time_per_output_token_seconds"
    assert value(f, tpot, tpot + "_count", model="m", tenant="a") == 2
    pre = "llmd:request_prefill_time_seconds"
    assert value(f, pre, pre + "_sum", model="m", tenant="a") == pytest.approx(0.16)


def test_live_gauges_read_at_scrape(svc: Served) -> None:
    m = Metrics(svc)
    rt = svc.models["m"]
    for i, klass in enumerate(("interactive", "batch", "batch")):
        rt.queue.push(QueuedRequest(f"q{i}", "a", klass, 10, 10, 1e9))
    f = scrape(m)
    assert value(f, "llmd:queue_depth", "llmd:queue_depth", model="m", **{"class": "interactive"}) == 1
    assert value(f, "llmd:queue_depth", "llmd:queue_depth", model="m", **{"class": "batch"}) == 2
    assert value(f, "llmd:queue_depth", "llmd:queue_depth", model="loading", **{"class": "batch"}) == 0
    assert value(f, "llmd:num_requests_running", "llmd:num_requests_running", model="m") == 6
    assert value(f, "llmd:num_requests_waiting", "llmd:num_requests_waiting", model="m") == 1
    assert value(f, "llmd:kv_cache_usage_perc", "llmd:kv_cache_usage_perc", model="m") == 0.5
    assert value(f, "llmd:prefix_cache_queries", "llmd:prefix_cache_queries_total", model="m") == 120
    assert value(f, "llmd:prefix_cache_hits", "llmd:prefix_cache_hits_total", model="m") == 70
    assert value(f, "llmd:num_preemptions", "llmd:num_preemptions_total", model="m") == 3
    assert value(f, "llmd:scheduler_running", "llmd:scheduler_running", model="m") == 2
    assert value(f, "llmd:scheduler_preemptions", "llmd:scheduler_preemptions_total", model="m") == 4
    assert value(f, "llmd:scheduler_dropped", "llmd:scheduler_dropped_total", model="m") == 3
    assert value(f, "llmd:scheduler_seat_limit", "llmd:scheduler_seat_limit", model="m") == 8
    assert value(f, "llmd:model_info", "llmd:model_info", model="m", version="v7") == 1
    assert value(f, "llmd:engine_up", "llmd:engine_up", model="m") == 0  # dead or being rebuilt
    assert value(f, "llmd:engine_restarts", "llmd:engine_restarts_total", model="m") == 2
    assert value(f, "llmd:requests_resumed", "llmd:requests_resumed_total", model="m") == 5
    assert value(f, "llmd:requests_requeued", "llmd:requests_requeued_total", model="m") == 7
    # a model still loading has an empty queue but no engine series
    assert not [s for s in f["llmd:num_requests_running"].samples if s.labels["model"] == "loading"]

    # live: the next scrape sees changed objects without any observe()
    rt.backend.stats.record(StepRecord(t=3.0, running=1, waiting=0, kv_usage=0.1, generated_tokens=1),
                            prefix_queries=5, prefix_hits=5)
    rt.scheduler.running.clear()
    rt.queue.pop_next()
    f = scrape(m)
    assert value(f, "llmd:num_requests_running", "llmd:num_requests_running", model="m") == 1
    assert value(f, "llmd:kv_cache_usage_perc", "llmd:kv_cache_usage_perc", model="m") == 0.1
    assert value(f, "llmd:prefix_cache_hits", "llmd:prefix_cache_hits_total", model="m") == 75
    assert value(f, "llmd:scheduler_running", "llmd:scheduler_running", model="m") == 0
    assert value(f, "llmd:queue_depth", "llmd:queue_depth", model="m", **{"class": "interactive"}) == 0


def test_adaptive_seat_limit_is_read_not_stepped(svc: Served) -> None:
    def clock() -> float:
        return 1000.0

    det = SaturationDetector(8, target_itl_ms=50.0, clock=clock)
    assert det.itl is not None
    det.itl.limit = 5.6
    rt = svc.models["m"]
    rt.scheduler = Scheduler(SchedulerCore(rt.queue, det, rt.backend.stats, ThroughputEstimate(100.0, clock=clock),
                                           clock=clock))
    f = scrape(Metrics(svc))
    assert value(f, "llmd:scheduler_seat_limit", "llmd:scheduler_seat_limit", model="m") == 5
    assert det.itl._next == 0.0  # scraping did not run an AIMD step


def test_private_registry_names_and_isolation(svc: Served) -> None:
    before = set(REGISTRY._names_to_collectors)
    a, b = Metrics(svc), Metrics(svc)  # two instances: no duplicate-registration errors
    feed(a)
    feed(b)
    assert set(REGISTRY._names_to_collectors) == before
    assert not [n for n in before if n.startswith("llmd:")]
    fams = scrape(a)
    assert len(fams) >= 20
    # llmd's own names, and the few vLLM names llm-d's endpoint picker reads from a model server
    compat = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc"}
    for fam in fams.values():
        assert fam.name.startswith("llmd:") or fam.name in compat, fam.name
        for s in fam.samples:
            assert s.name.startswith("llmd:") or s.name in compat, s.name
    assert not [n for n in set(REGISTRY._names_to_collectors) - before if n.startswith("vllm:")]


def test_observe_never_raises(svc: Served) -> None:
    m = Metrics(svc)
    m.observe(rec(ttft_s="not a number"))  # a malformed record is logged, not raised into emit()
    m.observe({})
    f = scrape(m)
    assert value(f, "llmd:requests", "llmd:requests_total", model="", tenant="", status="") == 1


def test_itl_matches_prometheus_histogram(svc: Served) -> None:
    """ITL is bucketed by hand for speed; it must render exactly as a prometheus_client Histogram would."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from llmd.metrics import ITL_BUCKETS

    rnd = random.Random(7)
    samples = [rnd.choice([rnd.expovariate(30.0), rnd.choice(ITL_BUCKETS), 200.0]) for _ in range(500)]
    m = Metrics(svc)
    m.observe(rec(itl_samples=samples[:300]))
    m.observe(rec(itl_samples=samples[300:]))
    reg = CollectorRegistry()
    h = Histogram("ref", "", ["model", "tenant"], registry=reg, buckets=ITL_BUCKETS)
    for x in samples:
        h.labels("m", "a").observe(x)
    ref = {(s.name.removeprefix("ref"), s.labels.get("le")): s.value for fam in reg.collect() for s in fam.samples
           if not s.name.endswith("_created")}
    name = "llmd:inter_token_latency_seconds"
    got = {(s.name.removeprefix(name), s.labels.get("le")): s.value for s in scrape(m)[name].samples}
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k] == pytest.approx(v), k


def test_slo_series_by_class_and_code(svc: Served) -> None:
    """The SLO histograms are by priority class; llmd:requests carries the HTTP code (availability)."""
    m = Metrics(svc)
    m.observe(rec(priority_class="interactive", http_status=200))
    m.observe(rec(priority_class="batch", http_status=200, ttft_s=30.0, itl_samples=[2.0]))
    m.observe(rec(priority_class="interactive", status="deadline", http_status=504, ttft_s=None, itl_samples=None))
    f = scrape(m)
    ttft, itl = "llmd:time_to_first_token_seconds", "llmd:inter_token_latency_seconds"
    inter, batch = {"class": "interactive"}, {"class": "batch"}
    assert value(f, ttft, ttft + "_count", model="m", tenant="a", **inter) == 1
    assert value(f, ttft, ttft + "_bucket", model="m", tenant="a", le="20.0", **batch) == 0
    assert value(f, itl, itl + "_count", model="m", tenant="a", **inter) == 4
    assert value(f, itl, itl + "_count", model="m", tenant="a", **batch) == 1
    req = "llmd:requests_total"
    assert value(f, "llmd:requests", req, model="m", status="deadline", code="504", **inter) == 1
    assert value(f, "llmd:requests", req, model="m", status="ok", code="200", **batch) == 1


def test_slo_targets_are_series_read_at_scrape(svc: Served) -> None:
    """The configured objectives as gauges, the latency ones with their bucket edge as `le`, so a
    rule can select the bucket to count against; a reload's new objectives show at the next scrape."""
    from llmd.config import SLOConfig

    config = [SLOConfig()]
    m = Metrics(svc, lambda: config[0])
    f = scrape(m)
    assert value(f, "llmd:slo_ttft_p95_seconds", "llmd:slo_ttft_p95_seconds", model="m", le="1.0") == 1.0
    assert value(f, "llmd:slo_itl_p95_seconds", "llmd:slo_itl_p95_seconds", model="loading", le="0.2") == 0.2
    assert value(f, "llmd:slo_availability", "llmd:slo_availability", model="m") == 0.995
    config[0] = SLOConfig.model_validate({"ttft_p95_s": 2.5, "models": {"m": {"itl_p95_s": 0.05}}})
    f = scrape(m)
    assert value(f, "llmd:slo_ttft_p95_seconds", "llmd:slo_ttft_p95_seconds", model="m", le="2.5") == 2.5
    assert value(f, "llmd:slo_itl_p95_seconds", "llmd:slo_itl_p95_seconds", model="m", le="0.05") == 0.05
    assert value(f, "llmd:slo_itl_p95_seconds", "llmd:slo_itl_p95_seconds", model="loading", le="0.2") == 0.2
    # the edge is the histogram's own `le` text for that bucket
    m.observe(rec(ttft_s=2.5))
    f = scrape(m)
    ttft = "llmd:time_to_first_token_seconds"
    assert value(f, ttft, ttft + "_bucket", model="m", tenant="a", le="2.5") == 1
