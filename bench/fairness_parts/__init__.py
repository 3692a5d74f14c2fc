"""The three parts of bench/fairness.py, one module each (the script is their command line):

- noisy_neighbour: part (a), a flooding tenant against another tenant's chat TTFT;
- fair_share: part (b), two tenants' accumulated service under overload, VTC against FCFS;
- itl_target: part (c), the target_itl_ms controller against a hand-tuned max_running sweep.

Each module has `TITLE`, `QUICK` (its --quick sizes), `add_arguments(parser)` and
`async run(bench) -> PartResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PartResult:
    """What a part reports: its docs subsection body, its verdicts, and raw data for results.json."""

    title: str
    lines: list[str]  # markdown body (after the heading)
    verdicts: list[tuple[str, bool]]
    data: dict[str, Any]
    seconds: float = 0.0
    version: str = ""  # llmd code the part's servers ran


def itl_scheduling(args: Any, target: float) -> dict[str, Any]:
    """The scheduling keys of a target_itl_ms run: the step-time model sizing the seats, AIMD
    correcting it (llmd's default), or with --itl-controller aimd, AIMD alone (as before issue H)."""
    out: dict[str, Any] = {"target_itl_ms": float(target)}
    if getattr(args, "itl_controller", "model") == "aimd":
        out["itl_step_model"] = False
    return out


def itl_label(args: Any) -> str:
    """How a row names the controller it ran."""
    return "AIMD only" if getattr(args, "itl_controller", "model") == "aimd" else "step model + AIMD"
