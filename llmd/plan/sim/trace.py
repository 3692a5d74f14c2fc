"""A workload as the simulator and the benches replay it: one row per request, arrival ordered.

Columns, not objects: an hour of seed-scale traffic is a million rows. The same Trace is sent
to a real llmd by bench/plan.py (open loop, through the openai SDK) and fed to the simulator,
so both see exactly the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

CLASSES = ("interactive", "batch")  # class index -> llmd.policy.classes name


@dataclass(frozen=True)
class Trace:
    """Requests by arrival time (seconds from 0, non-decreasing)."""

    t: npt.NDArray[np.float64]  # arrival time, s
    tenant: npt.NDArray[np.int32]  # index into `tenants`
    klass: npt.NDArray[np.int8]  # index into CLASSES
    prompt_tokens: npt.NDArray[np.int32]  # whole prompt, shared prefix included
    output_tokens: npt.NDArray[np.int32]  # tokens the request generates (max_tokens, no early stop)
    prefix: npt.NDArray[np.int32]  # shared-prefix group (a system prompt), -1: none
    prefix_tokens: npt.NDArray[np.int32]  # how many leading prompt tokens that group shares
    tenants: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @property
    def duration(self) -> float:
        return float(self.t[-1]) if len(self) else 0.0
