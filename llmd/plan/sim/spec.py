"""What `llmd plan sim` simulates: the fleet (replicas, their engines, autoscaling, failures),
llmd's policies for it (built from a config.toml the way llmd/runtime.py builds them) and what
the fleet costs. Frozen: a spec is one experiment; `replace` makes the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmd.config import ModelConfig, TenantConfig
from llmd.config.cluster import WarmPoolConfig
from llmd.config.parts import DegradationConfig, SchedulingConfig
from llmd.config.slo import SLO
from llmd.plan.errors import PlanError


@dataclass(frozen=True)
class EngineSpec:
    """One replica's engine, as vLLM v1's scheduler sees it."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the token budget per step (chunked prefill)
    kv_tokens: int = 64 * 2048  # KV cache capacity, tokens
    block_size: int = 16
    prefix_caching: bool = True
    prefix_cache_tokens: int | None = None  # LRU of shared prefixes and preempted requests' blocks; None: KV / 4


@dataclass(frozen=True)
class Autoscale:
    """Replicas active, warm (loaded, asleep: billed, seconds to wake) and cold (not billed, a
    cold start to load). llmd.policy.warmpool's hysteresis decides when: promote `step`
    replicas after `bounds.sustain_s` hot, drain `step` back to warm after `demote_after_s` calm."""

    min_active: int = 1
    warm_pool: int = 0  # replicas kept warm beyond the active ones
    step: int = 1
    warm_start_s: float = 10.0
    cold_start_s: float = 120.0
    interval_s: float = 5.0  # how often the autoscaler looks
    bounds: WarmPoolConfig = field(default_factory=lambda: WarmPoolConfig(promote_queue_tokens=20000,
                                                                           promote_ttft_s=1.0))


@dataclass(frozen=True)
class SimSpec:
    """A fleet of `replicas` identical replicas of one model behind one ingress."""

    replicas: int
    engine: EngineSpec = field(default_factory=EngineSpec)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    tenants: tuple[TenantConfig, ...] = ()  # none: one tenant per trace tenant, weight 1, no quota
    slo: SLO = field(default_factory=SLO)
    deadline_s: dict[str, float] = field(default_factory=lambda: {"interactive": 120.0, "batch": 86400.0})
    # llmd's shedding under sustained overload ([models.X.degradation]; llmd/plan/sim/degrade.py)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    # llmd's own overheads (bench/lib/plan_overhead.py measures them on the fake backend):
    ingress_s: float = 0.002  # per request, from the client's send to its admission
    delivery_s: float = 0.0005  # per token, from the engine step that made it to the client
    price_per_hour: float = 16.0  # per replica-hour, active and warm (and starting) billed
    autoscale: Autoscale | None = None  # None: all `replicas` active all along
    mtbf_s: float | None = None  # mean time between failures of one replica; None: none fail
    repair_s: float = 120.0  # a failed replica is back (cold start) after this
    route_candidates: int = 4  # replicas sampled per request for the placement score, plus cache holders
    gossip_s: float = 0.5  # how stale the router's view of a replica is (placement's reservations cover it)
    seed: int = 0
    warmup_s: float = 0.0  # requests arriving before this are served but not measured
    # Exact mode: llmd sample for sample, for the end-to-end check against it (slower with many
    # replicas). One switch for four things that only matter together: the ITL controller sees
    # every sample llmd's would (a gap per token, a step record per step, its 512-step fit window)
    # instead of a few per decode segment; llmd's scheduler reads the engine's queue from its last
    # step record, not live; a busy replica's periodic tick can land mid-step, as llmd's does; and
    # every latency sample is kept, for percentiles without the histograms' 2.3 % bins.
    exact: bool = False
    # The clients give up at this time (a replay cuts its streams a while after the last arrival):
    # the run stops there and only requests completed by then count their TTFT. None: all finish.
    horizon_s: float | None = None
    # The ITL controller's interval (its step-model refit and AIMD judgement, and the periodic
    # tick of a busy replica); None: llmd's own (0.5 s). Coarser is an approximation that buys
    # speed (refits dominate a big fleet's run): the seat limit follows a change of load later.
    control_interval_s: float | None = None
    # llmd's output filters hold back a response's first tokens while they could still become a
    # match (digits that may be a phone number): a sample of how many tokens a response's first
    # chunk waits for, each request drawing one (0: none held). The client's first token comes
    # with the held ones, and their gaps are not seen. Empty: nothing held. It needs the exact
    # mode and a horizon (TTFT counted at completion, from each request's own gaps).
    first_token_holds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        e = self.engine
        if self.replicas < 1:
            raise PlanError("replicas must be at least 1")
        if e.max_num_seqs < 1 or e.max_num_batched_tokens < 1 or e.block_size < 1:
            raise PlanError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        if e.kv_tokens < e.block_size:
            raise PlanError("kv_tokens must hold at least one block")
        if self.route_candidates < 1 or self.gossip_s <= 0:
            raise PlanError("route_candidates must be ≥ 1 and gossip_s > 0")
        if self.ingress_s < 0 or self.delivery_s < 0 or self.price_per_hour < 0:
            raise PlanError("ingress_s, delivery_s and price_per_hour must not be negative")
        if self.control_interval_s is not None and self.control_interval_s <= 0:
            raise PlanError("control_interval_s must be positive")
        if self.mtbf_s is not None and self.mtbf_s <= 0:
            raise PlanError("mtbf_s must be positive")
        if self.first_token_holds and (not self.exact or self.horizon_s is None):
            raise PlanError("first_token_holds needs exact mode and a horizon")
        if any(k < 0 for k in self.first_token_holds):
            raise PlanError("first_token_holds must not be negative")
        a = self.autoscale
        if a is not None and not 1 <= a.min_active <= self.replicas:
            raise PlanError("autoscale.min_active must be between 1 and replicas")


VLLM_BLOCK = 16  # vLLM's KV block on a GPU; its CPU backend forces 128 (a step model's stamp says which)


def step_block_size(step: object) -> int | None:
    """The KV block size of the engine a step model was measured on (`llmd plan calibrate`
    stamps it), or None where its stamp does not say (or it has none: a test's step function)."""
    stamp = getattr(step, "stamp", None)
    try:
        size = int(stamp.get("block_size", "")) if isinstance(stamp, dict) else 0
    except ValueError:
        return None
    return size if size > 0 else None


def default_engine(block_size: int | None = None) -> EngineSpec:
    """llmd's default engine (no config given), in the measured engine's blocks where known."""
    return EngineSpec(block_size=block_size or VLLM_BLOCK)


def engine_from_model(m: ModelConfig, block_size: int | None = None) -> EngineSpec:
    """The engine a model's config.toml section describes. KV capacity: the fake engine's blocks,
    or (vLLM) room for max_num_seqs sequences of max_model_len: the config gives GiB, not tokens;
    pass kv_tokens for a measured figure. vLLM's block: `engine.extra.block_size` where set,
    else `block_size` (the measured engine's: a prefix is cached in whole blocks, so a 96-token
    shared prefix hits with 16-token blocks and never with 128), else VLLM_BLOCK."""
    if m.backend == "fake":
        f = m.fake
        blocks = f.kv_blocks if f.kv_blocks is not None else f.max_num_seqs * m.engine.max_model_len // f.block_tokens
        return EngineSpec(max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.prefill_tokens_per_step,
                          kv_tokens=blocks * f.block_tokens, block_size=f.block_tokens,
                          prefix_caching=f.prefix_caching)
    e = m.engine
    configured = e.extra.get("block_size")
    block = int(configured) if isinstance(configured, int | str) and str(configured).isdigit() else None
    return EngineSpec(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                      kv_tokens=e.max_num_seqs * e.max_model_len, block_size=block or block_size or VLLM_BLOCK,
                      prefix_caching=e.enable_prefix_caching)
