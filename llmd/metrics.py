"""Prometheus metrics for /metrics, in a private registry.

Names and meanings follow vLLM's own (`vllm:time_to_first_token_seconds` becomes
`llmd:time_to_first_token_seconds`) so dashboards carry over, but they are measured
at the gateway, per tenant, and include our queueing. The registry is private because
vLLM registers its metrics in prometheus_client's global one, in this same process.

Two sources: `observe` takes each finished request record (a telemetry sink), and a
custom collector reads queues, schedulers and engine stats at scrape time, so live
gauges are never stale and no background task is needed.

The SLO series are the client's view. llmd:time_to_first_token_seconds and
llmd:inter_token_latency_seconds time tokens as the gateway sends them, after the output
filters' holdback (RequestRecord.on_sent), by model, tenant and priority class: they kept their
names rather than gaining "client" twins, since at the gateway the engine-side times have no
consumer the client-side ones do not serve better (the engine's part is
llmd:request_prefill_time_seconds; vLLM's own metrics are the engine's view). A non-streaming
response's text is timed when the filters release it (the body itself leaves at the end: that
wait is llmd:e2e_request_latency_seconds). llmd:requests carries the HTTP `code`, so
availability is 5xx over all; the llmd:slo_* gauges carry the configured targets ([slo]), the
latency ones with the bucket edge as `le`, so a rule selects the bucket to count against it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from llmd.config.slo import ITL_BUCKETS, TTFT_BUCKETS, SLOConfig
from llmd.policy.classes import CLASSES
from llmd.runtime import ModelRuntime
from llmd.telemetry import log

# TTFT_BUCKETS and ITL_BUCKETS are in llmd/config/slo.py: an SLO's target must be one of their edges.
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *LATENCY_BUCKETS)  # most waits are sub-0.3 s

MT = ("model", "tenant")
MTC = ("model", "tenant", "class")  # the SLO histograms: by priority class too (batch work is not judged by latency)


class Served(Protocol):
    """What the live gauges read: the registry's served versions."""

    def primaries(self) -> Mapping[str, ModelRuntime | None]: ...

    def versions(self, model: str) -> Mapping[str, ModelRuntime]: ...


def _slo_families() -> dict[str, GaugeMetricFamily]:
    g = GaugeMetricFamily
    return {
        "ttft": g("llmd:slo_ttft_p95_seconds", "The TTFT objective ([slo]): 95% of requests' first token "
                  "within this; `le` is its bucket edge in llmd:time_to_first_token_seconds.", labels=["model", "le"]),
        "itl": g("llmd:slo_itl_p95_seconds", "The ITL objective ([slo]): 95% of inter-token gaps within this; "
                 "`le` is its bucket edge in llmd:inter_token_latency_seconds.", labels=["model", "le"]),
        "avail": g("llmd:slo_availability", "The availability objective ([slo]): the fraction of requests "
                   "not answered 5xx.", labels=["model"]),
    }


def _label(v: Any) -> str:
    return "" if v is None else str(v)


class _Live:
    """Collector reading the service's objects at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> Iterable[Metric]:
        return self._families(live=False)  # names only: lets the registry reject clashes

    def collect(self) -> Iterable[Metric]:
        return self._families(live=True)

    def _families(self, live: bool) -> list[Metric]:
        g, c = GaugeMetricFamily, CounterMetricFamily
        f = {
            "depth": g("llmd:queue_depth", "Requests waiting in the gateway's fair queue, by priority class.",
                       labels=["model", "class"]),
            "running": g("llmd:num_requests_running", "Number of requests in model execution batches (engine).",
                         labels=["model"]),
            "waiting": g("llmd:num_requests_waiting", "Number of requests waiting in the engine's own queue "
                         "(the gateway's queue is llmd:queue_depth).", labels=["model"]),
            "sched": g("llmd:scheduler_running", "Requests the gateway scheduler has released to the engine "
                       "and not yet seen finish.", labels=["model"]),
            "seats": g("llmd:scheduler_seat_limit", "Current seat limit: max_running, or the adaptive "
                       "limit when a target ITL is set.", labels=["model"]),
            "kv": g("llmd:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=["model"]),
            "pq": c("llmd:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    labels=["model"]),
            "ph": c("llmd:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                    labels=["model"]),
            "pre": c("llmd:num_preemptions", "Cumulative number of preemption from the engine.", labels=["model"]),
            "spre": c("llmd:scheduler_preemptions", "Batch-class requests the gateway preempted (and "
                      "requeued) to seat interactive ones.", labels=["model"]),
            "sdrop": c("llmd:scheduler_dropped", "Queued requests dropped before dispatch because their "
                       "deadline could no longer be met.", labels=["model"]),
            "up": g("llmd:engine_up", "1 while the model's engine serves, 0 while it is dead or being rebuilt.",
                    labels=["model"]),
            "restarts": c("llmd:engine_restarts", "Dead engines the supervisor rebuilt.", labels=["model"]),
            "resumed": c("llmd:requests_resumed", "Streams resumed on a rebuilt engine from the tokens they "
                         "had delivered.", labels=["model"]),
            "requeued": c("llmd:requests_requeued", "Requests re-queued on a rebuilt engine before their "
                          "first token.", labels=["model"]),
            "info": g("llmd:model_info", "1 per loaded version of a model (in rotation or on standby).",
                      labels=["model", "version"]),
            "itl": HistogramMetricFamily("llmd:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                         "seconds as sent to the client (one observation per token after the "
                                         "first).", labels=list(MTC)),
            # The names llm-d's endpoint picker (Gateway API Inference Extension) reads from a vLLM
            # model server, so a node behind it is scored as a vLLM pod: the waiting count includes
            # llmd's own queue, where requests wait before the engine (docs/cluster.md).
            "v_wait": g("vllm:num_requests_waiting", "Requests waiting: llmd's queue plus the engine's.",
                        labels=["model_name"]),
            "v_run": g("vllm:num_requests_running", "Requests in the engine's batch.", labels=["model_name"]),
            "v_kv": g("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full.", labels=["model_name"]),
            "v_gpu": g("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (the older name).",
                       labels=["model_name"]),
            "cpm": g("llmd:cost_per_million_tokens", "Realised average cost per million billed tokens "
                     "(prompt + generated) since start: llmd:cost_total / those requests' tokens x 1e6; "
                     "only requests that carried a cost count.", labels=list(MT)),
        }
        slo = _slo_families()
        if live:
            self._fill(f)
            self._fill_slo(slo)
        return [*f.values(), *slo.values()]

    def _fill_slo(self, f: dict[str, GaugeMetricFamily]) -> None:
        config = self.m.slo()
        for name in self.m.served.primaries():
            o = config.slo_for(name)
            f["ttft"].add_metric([name, floatToGoString(o.ttft_p95_s)], o.ttft_p95_s)
            f["itl"].add_metric([name, floatToGoString(o.itl_p95_s)], o.itl_p95_s)
            f["avail"].add_metric([name], o.availability)

    def _fill(self, f: dict[str, Any]) -> None:
        for name, rt in self.m.served.primaries().items():
            if rt is None:  # still loading, or failed to: nothing queued, no engine series
                for klass in CLASSES:
                    f["depth"].add_metric([name, klass], 0)
                continue
            for klass in rt.queue.classes:
                f["depth"].add_metric([name, klass], rt.queue.depth(klass))
            sched, s = rt.scheduler, rt.backend.stats
            f["sched"].add_metric([name], len(sched.running))
            f["seats"].add_metric([name], sched.seat_limit)
            f["spre"].add_metric([name], sched.preempted)
            f["sdrop"].add_metric([name], sched.dropped)
            f["running"].add_metric([name], s.running)
            f["waiting"].add_metric([name], s.waiting)
            f["kv"].add_metric([name], s.kv_usage)
            f["v_wait"].add_metric([name], s.waiting + len(rt.queue))
            f["v_run"].add_metric([name], s.running)
            f["v_kv"].add_metric([name], s.kv_usage)
            f["v_gpu"].add_metric([name], s.kv_usage)
            f["pq"].add_metric([name], s.prefix_queries)
            f["ph"].add_metric([name], s.prefix_hits)
            f["pre"].add_metric([name], s.preemptions)
            w = rt.watch
            f["up"].add_metric([name], int(rt.ready))
            f["restarts"].add_metric([name], w.restarts)
            f["resumed"].add_metric([name], w.resumed)
            f["requeued"].add_metric([name], w.requeued)
            for version in self.m.served.versions(name):  # the configured one and any other loaded
                f["info"].add_metric([name, version], 1)
        les = [floatToGoString(b) for b in ITL_BUCKETS] + ["+Inf"]
        for key, counts in self.m._itl_counts.items():
            f["itl"].add_metric(list(key), list(zip(les, accumulate(counts), strict=True)), self.m._itl_sum[key])
        for mt, cost in self.m._cost.items():
            tokens = self.m._cost_tokens[mt]
            if tokens:
                f["cpm"].add_metric(list(mt), cost / tokens * 1e6)


class Metrics:
    """All of llmd's metrics for one node; `observe` takes each finished request record."""

    def __init__(self, served: Served, slo: Callable[[], SLOConfig] = SLOConfig) -> None:
        """`slo`: the objectives in force (read at each scrape: a reload changes them)."""
        self.served = served
        self.slo = slo
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("llmd:time_to_first_token_seconds", "Histogram of time to first token in seconds "
                              "(arrival at the gateway to the first token sent to the client, queueing and "
                              "the output filters' holdback included).", MTC, registry=r, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("llmd:request_time_per_output_token_seconds", "Histogram of time_per_output_token_"
                              "seconds per request (its mean inter-token gap).", MT, registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("llmd:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds, "
                             "for admitted requests.", MT, registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Histogram("llmd:request_queue_time_seconds", "Histogram of time spent in the gateway's "
                               "queue before dispatch to the engine.", MT, registry=r, buckets=QUEUE_BUCKETS)
        self.prefill = Histogram("llmd:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
                                 "for request (dispatch to first token).", MT, registry=r, buckets=LATENCY_BUCKETS)
        self.prompt = Counter("llmd:prompt_tokens", "Number of prefill tokens processed (requests that "
                              "reached the engine).", MT, registry=r)
        self.cached = Counter("llmd:prompt_tokens_cached", "Number of cached prompt tokens.", MT, registry=r)
        self.generation = Counter("llmd:generation_tokens", "Number of generation tokens processed.", MT, registry=r)
        self.requests = Counter("llmd:requests", "Finished requests by outcome (ok, shed, rejected, deadline, "
                                "cancelled, error, filtered), priority class and HTTP status code (availability: "
                                "code 5xx over all).", (*MTC, "status", "code"), registry=r)
        self.shed = Counter("llmd:requests_shed", "Requests refused by admission control, by reason.",
                            ("model", "reason"), registry=r)
        self.held = Counter("llmd:refusals_held", "Refusals answered only after a hold because their tenant "
                            "kept resubmitting (it ignores Retry-After; llmd/policy/pacing.py).", ("tenant",),
                            registry=r)
        self.cost = Counter("llmd:cost", "Accumulated cost of requests, in the metering's currency unit.",
                            MT, registry=r)
        # Per version, for rollouts (`llmd compare` has the full side-by-side from the request log).
        self.by_version = Counter("llmd:version_requests", "Finished requests by the version that served "
                                  "them and outcome.", ("model", "version", "status", "finish_reason"), registry=r)
        self.version_ttft = Histogram("llmd:version_time_to_first_token_seconds", "Time to first token by "
                                      "version.", ("model", "version"), registry=r, buckets=TTFT_BUCKETS)
        self.version_tokens = Counter("llmd:version_generation_tokens", "Generated tokens by version.",
                                      ("model", "version"), registry=r)
        # ITL is bucketed here and exposed by the collector: a record carries one sample per
        # token, and Histogram.observe per sample costs ~4x as much on the event loop.
        self._itl_counts: dict[tuple[str, str, str], list[int]] = {}
        self._itl_sum: dict[tuple[str, str, str], float] = defaultdict(float)
        self._cost: dict[tuple[str, str], float] = defaultdict(float)
        self._cost_tokens: dict[tuple[str, str], int] = defaultdict(int)
        r.register(_Live(self))

    def observe(self, rec: dict[str, Any]) -> None:
        """Account one finished request record; never raises (it runs inside RequestRecord.emit)."""
        try:
            self._observe(rec)
        except Exception:
            log.exception("metrics_observe_failed", request_id=rec.get("request_id"))

    def _observe(self, rec: dict[str, Any]) -> None:
        key = (_label(rec.get("model")), _label(rec.get("tenant")))
        status = _label(rec.get("status"))
        decision = rec.get("decision") or ""
        kc = (*key, _label(rec.get("priority_class")))
        self.requests.labels(*kc, status, _label(rec.get("http_status"))).inc()
        if version := rec.get("version"):
            vkey = (key[0], _label(version)[:12])
            self.by_version.labels(*vkey, status, _label(rec.get("finish_reason"))).inc()
            if rec.get("ttft_s") is not None:
                self.version_ttft.labels(*vkey).observe(rec["ttft_s"])
            if rec.get("output_tokens"):
                self.version_tokens.labels(*vkey).inc(rec["output_tokens"])
        if status == "shed":
            self.shed.labels(key[0], decision.partition("shed:")[2] or _label(rec.get("error_code"))).inc()
        # Refusals (shed, rejected, unknown model) never queued: their latency would only blur the histograms.
        admitted = bool(decision) and not decision.startswith("shed:")
        if admitted and rec.get("total_time_s") is not None:
            self.e2e.labels(*key).observe(rec["total_time_s"])
        if rec.get("ttft_s") is not None:
            self.ttft.labels(*kc).observe(rec["ttft_s"])
        for hist, field in ((self.queue, "queue_time_s"), (self.prefill, "prefill_s"), (self.tpot, "itl_mean_s")):
            if rec.get(field) is not None:
                hist.labels(*key).observe(rec[field])
        if samples := rec.get("itl_samples"):
            total = sum(samples)
            counts = self._itl_counts.setdefault(kc, [0] * (len(ITL_BUCKETS) + 1))
            for gap in samples:
                counts[bisect_left(ITL_BUCKETS, gap)] += 1  # le is inclusive, as bisect_left's index
            self._itl_sum[kc] += total
        prompt, out = rec.get("prompt_tokens") or 0, rec.get("output_tokens") or 0
        if rec.get("queue_time_s") is not None:  # dispatched: the engine prefilled it
            self.prompt.labels(*key).inc(prompt)
        if rec.get("cached_prompt_tokens"):
            self.cached.labels(*key).inc(rec["cached_prompt_tokens"])
        if out:
            self.generation.labels(*key).inc(out)
        if rec.get("cost") is not None:
            self.cost.labels(*key).inc(rec["cost"])
            self._cost[key] += rec["cost"]
            self._cost_tokens[key] += prompt + out

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for the /metrics response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

