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


def save_trace(trace: Trace, path: str) -> None:
    """One .npz file: the columns, and the tenant names."""
    np.savez_compressed(path, t=trace.t, tenant=trace.tenant, klass=trace.klass, prompt_tokens=trace.prompt_tokens,
                        output_tokens=trace.output_tokens, prefix=trace.prefix, prefix_tokens=trace.prefix_tokens,
                        tenants=np.array(trace.tenants, dtype=str))


def load_trace(path: str) -> Trace:
    """A trace saved by save_trace; ValueError (what is wrong, in a line) for anything else."""
    try:
        with np.load(path, allow_pickle=False) as z:
            tr = Trace(t=z["t"].astype(np.float64), tenant=z["tenant"].astype(np.int32),
                       klass=z["klass"].astype(np.int8), prompt_tokens=z["prompt_tokens"].astype(np.int32),
                       output_tokens=z["output_tokens"].astype(np.int32), prefix=z["prefix"].astype(np.int32),
                       prefix_tokens=z["prefix_tokens"].astype(np.int32),
                       tenants=tuple(str(x) for x in z["tenants"]))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a trace file ({e})") from None
    n = len(tr)
    if any(len(c) != n for c in (tr.tenant, tr.klass, tr.prompt_tokens, tr.output_tokens, tr.prefix, tr.prefix_tokens)):
        raise ValueError(f"{path}: its columns differ in length")
    if n and (np.any(np.diff(tr.t) < 0) or tr.tenant.min() < 0 or tr.tenant.max() >= len(tr.tenants)
              or tr.klass.min() < 0 or tr.klass.max() >= len(CLASSES)):
        raise ValueError(f"{path}: arrivals out of order, or a tenant or class index out of range")
    return tr
