"""The accelerators the planner knows, and this box.

Datasheet figures are dense (no 2:4 sparsity: vendor tables often print the sparse figure, a 2×
error). Prices are per GPU-hour, on demand, and are assumptions: cloud prices move weekly, so
`--price` overrides them. "local" is the machine the planner runs on: its cores and memory are
read here; its bandwidth and FLOPs stay unknown until `llmd plan calibrate` measures them.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from llmd.plan.errors import PlanError

GIB = 1024 ** 3


@dataclass(frozen=True)
class Gpu:
    """One accelerator: memory (GiB), bandwidth (TB/s, 1e12 B/s), dense TFLOPs by compute dtype,
    and a price per hour with where it came from. None means unknown."""

    name: str
    hbm_gib: float
    bandwidth_tbs: float | None
    tflops: dict[str, float] = field(default_factory=dict)
    price_per_hour: float | None = None
    price_source: str = "unknown"
    source: str = ""

    def peak_flops(self, compute_dtype: str) -> float | None:
        t = self.tflops.get(compute_dtype)
        return None if t is None else t * 1e12

    @property
    def bandwidth(self) -> float | None:
        return None if self.bandwidth_tbs is None else self.bandwidth_tbs * 1e12


GPUS: dict[str, Gpu] = {
    "A100-80GB": Gpu("A100-80GB", 80.0, 2.039, {"bf16": 312.0}, 2.00,
                     "assumed: mid-range of $1.49-2.49/h on-demand, early 2026 (pricegpu.pages.dev)",
                     "NVIDIA A100 datasheet (SXM 80GB): 312 TFLOPs dense BF16, no FP8 tensor cores"),
    "H100-SXM": Gpu("H100-SXM", 80.0, 3.35, {"bf16": 989.0, "fp8": 1979.0}, 4.00,
                    "assumed: the seed's $16/h per 4-GPU replica; top of $2.49-3.99/h on-demand (pricegpu.pages.dev)",
                    "NVIDIA H100 datasheet (SXM): 989 / 1,979 TFLOPs dense BF16 / FP8"),
    "H200": Gpu("H200", 140.0, 4.8, {"bf16": 989.0, "fp8": 1979.0}, 4.50,
                "assumed: between H100 and the $3.59/h RunPod quote (deploybase.ai, 2025)",
                "NVIDIA H200 datasheet: H100 compute, 141 GB HBM3e (~140 GiB usable), 4.8 TB/s"),
}
ALIASES = {"a100": "A100-80GB", "a100-80gb": "A100-80GB", "h100": "H100-SXM", "h100-sxm": "H100-SXM",
           "h200": "H200", "local": "local", "this-box": "local", "cpu": "local"}


def _mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return float(pages * size) / GIB


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def local_box() -> Gpu:
    """This machine: cores and memory as read now; bandwidth, FLOPs and price unknown."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Gpu(f"local ({cores} cores, {_cpu_model()})", round(_mem_total_gib(), 1), None, {}, None,
               "unknown: give --price", "read from /proc; bandwidth and FLOPs unknown until `llmd plan calibrate`")


def get_gpu(name: str) -> Gpu:
    """The table row for `name` (case-insensitive, short aliases), or this box for "local"."""
    key = ALIASES.get(name.lower(), name)
    if key == "local":
        return local_box()
    for k, g in GPUS.items():
        if k.lower() == key.lower():
            return g
    raise PlanError(f"unknown GPU {name!r}; known: {', '.join([*GPUS, 'local'])}")
