"""A workload as the simulator and the benches replay it: one row per request, arrival ordered.

Columns, not objects: an hour of seed-scale traffic is a million rows. The same Trace is sent
to a real llmd by bench/plan.py (open loop, through the openai SDK) and fed to the simulator,
so both see exactly the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from llmd.plan.errors import PlanError

CLASSES: Final = ("interactive", "batch")  # class index -> llmd.policy.classes name
COLUMNS: Final = ("t", "tenant", "klass", "prompt_tokens", "output_tokens", "prefix", "prefix_tokens")


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

    def save(self, path: Path) -> None:
        """One .npz (uncompressed: a million rows load in milliseconds): the columns and the tenant
        names, so a workload is generated once and replayed by the simulator and the bench alike."""
        with open(path, "wb") as f:  # np.savez would append .npz to a name without it
            np.savez(f, tenants=np.array(self.tenants, dtype=np.str_),
                     **{c: getattr(self, c) for c in COLUMNS})

    @classmethod
    def load(cls, path: Path) -> Trace:
        """A Trace `save` wrote; anything else is a PlanError naming the file."""
        try:
            with np.load(path, allow_pickle=False) as z:
                cols = {c: z[c] for c in COLUMNS}
                tenants = tuple(str(x) for x in z["tenants"])
        except (OSError, ValueError, KeyError) as e:
            raise PlanError(f"{path}: not a workload trace ({e})") from None
        shapes = {a.shape for a in cols.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise PlanError(f"{path}: not a workload trace (columns of unequal lengths)")
        dtypes = {"t": np.float64, "klass": np.int8}
        tr = cls(tenants=tenants, **{c: a.astype(dtypes.get(c, np.int32), copy=False) for c, a in cols.items()})
        if len(tr) and (np.any(np.diff(tr.t) < 0) or tr.tenant.min() < 0 or tr.tenant.max() >= len(tenants)
                        or tr.klass.min() < 0 or tr.klass.max() >= len(CLASSES)):
            raise PlanError(f"{path}: not a workload trace (arrivals out of order, or a tenant or class out of range)")
        return tr
