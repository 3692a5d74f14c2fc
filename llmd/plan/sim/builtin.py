"""A constant-rate Poisson workload, until the workload generators (diurnal, bursty, replayed)
are there: fixed prompt and output lengths, tenants and classes drawn uniformly at random."""

from __future__ import annotations

import numpy as np

from llmd.plan.errors import PlanError
from llmd.plan.sim.trace import Trace


def poisson_trace(rate: float, duration_s: float, prompt_tokens: int, output_tokens: int, *, seed: int = 0,
                  tenants: tuple[str, ...] = ("default",), batch_share: float = 0.0) -> Trace:
    """Arrivals at `rate` per second for `duration_s` seconds, drawn in bulk with numpy."""
    if rate <= 0 or duration_s <= 0 or prompt_tokens < 1 or output_tokens < 1:
        raise PlanError("rate, duration, prompt and output tokens must be positive")
    if not tenants or not 0.0 <= batch_share <= 1.0:
        raise PlanError("at least one tenant, and a batch share between 0 and 1")
    rng = np.random.default_rng(seed)
    n = int(rng.poisson(rate * duration_s))
    t = np.sort(rng.uniform(0.0, duration_s, n))
    return Trace(t=t.astype(np.float64), tenant=rng.integers(0, len(tenants), n).astype(np.int32),
                 klass=(rng.random(n) < batch_share).astype(np.int8),
                 prompt_tokens=np.full(n, prompt_tokens, np.int32), output_tokens=np.full(n, output_tokens, np.int32),
                 prefix=np.full(n, -1, np.int32), prefix_tokens=np.zeros(n, np.int32), tenants=tuple(tenants))
