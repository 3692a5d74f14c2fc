"""`[slo]`: the service level objectives llmd is judged by, as its clients see it.

Three per model: time to first token p95, inter-token latency p95 (both measured as the gateway
sends tokens to the client, after the output filters' holdback: llmd/metrics.py) and availability
(the fraction of requests not answered 5xx). `[slo]` sets them for every model, `[slo.models.NAME]`
overrides any of them for one. The alert rules (deploy/prometheus/llmd-alerts.yml) and the
dashboards read the targets from the `llmd:slo_*` gauges, so they follow this file.

A latency target must be one of its histogram's bucket edges: the burn-rate rules count the
requests slower than the target as 1 - bucket(le=target)/count, which is exact only at an edge.
The edges live here, beside the targets they constrain; llmd/metrics.py uses them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from llmd.config.parts import _Strict

# vLLM's defaults (vllm/v1/metrics/buckets.py) plus 1.5 s and 2 s, so the common TTFT targets
# (0.5, 1, 1.5, 2, 2.5 s) are all edges; the default target (1 s) is one.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's with three finer buckets below 10 ms (a small model on a GPU decodes faster than vLLM's
# lowest bucket); the default target (0.2 s, config.toml's target_itl_ms) is an edge.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

DEFAULT_TTFT_P95_S = 1.0
DEFAULT_ITL_P95_S = 0.2
DEFAULT_AVAILABILITY = 0.995

Availability = Annotated[float, Field(gt=0, lt=1)]  # 1.0 would leave no error budget to burn


def _edge(value: float | None, edges: tuple[float, ...], what: str) -> float | None:
    if value is not None and value not in edges:
        raise ValueError(f"{value} is not a bucket edge of {what} (the burn-rate rules need one): "
                         f"choose one of {', '.join(str(e) for e in edges)}")
    return value


class SLO(_Strict):
    """One model's objectives, resolved (`slo_for`)."""

    ttft_p95_s: float = DEFAULT_TTFT_P95_S
    itl_p95_s: float = DEFAULT_ITL_P95_S
    availability: Availability = DEFAULT_AVAILABILITY


class SLOOverride(_Strict):
    """`[slo.models.NAME]`: any of the objectives for one model; the rest come from `[slo]`."""

    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    availability: Availability | None = None

    @field_validator("ttft_p95_s")
    @classmethod
    def _ttft(cls, v: float | None) -> float | None:
        return _edge(v, TTFT_BUCKETS, "llmd:time_to_first_token_seconds")

    @field_validator("itl_p95_s")
    @classmethod
    def _itl(cls, v: float | None) -> float | None:
        return _edge(v, ITL_BUCKETS, "llmd:inter_token_latency_seconds")


class SLOConfig(SLOOverride):
    """`[slo]`: the defaults for every model, and `models`, the per-model overrides (each must
    name a configured model: checked with the whole file, llmd/config/root.py)."""

    ttft_p95_s: float | None = DEFAULT_TTFT_P95_S
    itl_p95_s: float | None = DEFAULT_ITL_P95_S
    availability: Availability | None = DEFAULT_AVAILABILITY
    models: dict[str, SLOOverride] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _defaults_set(self) -> SLOConfig:
        for key in ("ttft_p95_s", "itl_p95_s", "availability"):
            if getattr(self, key) is None:
                raise ValueError(f"{key} needs a value (leave it out for the default)")
        return self

    def slo_for(self, model: str) -> SLO:
        """The objectives for `model`: its override's, else `[slo]`'s."""
        base = {"ttft_p95_s": self.ttft_p95_s, "itl_p95_s": self.itl_p95_s, "availability": self.availability}
        over = self.models.get(model)
        if over is not None:
            base.update(over.model_dump(exclude_none=True))
        return SLO.model_validate(base)


def slo_for(config: SLOConfig, model: str) -> SLO:
    """The objectives for `model` under `config` (a pure accessor for dashboards and metrics)."""
    return config.slo_for(model)
