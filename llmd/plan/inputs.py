"""What `llmd plan math` is asked about: a workload and a deployment (model, GPU, replica shape).

Every default that is an assumption says so here, because each one moves the answer: vLLM's
default memory fraction, a runtime reserve per GPU, roofline efficiencies from BLIS's fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.plan.gpus import Gpu
from llmd.plan.model import ModelSpec


@dataclass(frozen=True)
class Workload:
    """Peak arrival rate (req/s), mean prompt and output tokens per request, optional SLOs."""

    rate: float
    prompt_tokens: float
    output_tokens: float
    itl_ms: float | None = None
    ttft_ms: float | None = None


@dataclass(frozen=True)
class Deployment:
    """One replica's shape and the planner's assumptions.

    decode_tps / prefill_tps: tokens/s one replica sustains; None = a roofline estimate.
    mem_util: the fraction of HBM the engine takes (vLLM's gpu_memory_utilization default 0.9).
    reserve_gib: per GPU, activations, CUDA graphs and communication buffers (assumed 4 GiB).
    peak_util: the fraction of a replica's rate planned at peak; 1/peak_util - 1 is the headroom.
    avg_util: mean load over the day as a fraction of peak (the seed's 40 %).
    bw_eff / mfu: achievable fractions of datasheet bandwidth and FLOPs (BLIS implies ~0.7 of
    bandwidth; prefill MFU is typically 0.3-0.6).
    storage_gbps: GB/s the weights load at on a cold start (assumed 2, the seed's figure).
    init_s: the engine's own start after the weights, seconds (assumed 60: graph capture, warm-up).
    util_goal: a mean-utilisation goal to check the cost's load against; None: none stated.
    """

    gpu: Gpu
    tp: int | None = None
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    decode_tps: float | None = None
    prefill_tps: float | None = None
    price_per_hour: float | None = None
    mem_util: float = 0.9
    reserve_gib: float = 4.0
    peak_util: float = 0.875
    avg_util: float = 0.4
    bw_eff: float = 0.7
    mfu: float = 0.5
    storage_gbps: float = 2.0
    init_s: float = 60.0
    util_goal: float | None = None


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    workload: Workload
    deploy: Deployment
    seed: bool = False
