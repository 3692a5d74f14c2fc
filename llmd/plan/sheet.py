"""The derivation sheet: every number the planner prints, with the formula that gave it.

A Line is one figure (label, the formula with its numbers substituted, value, unit); a Finding is
an inconsistency the checks found, with the lines of its derivation. The text and JSON outputs are
two views of the same sheet, so tests and the later simulator read exactly what a user reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def num(x: float) -> str:
    """A number as an engineer writes it: thousands separators, about three significant digits."""
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:,.1f}"
    return f"{x:.3g}"


def usd(x: float) -> str:
    return f"${x:,.2f}"


@dataclass(frozen=True)
class Line:
    key: str
    section: str
    label: str
    formula: str
    value: float | None
    unit: str
    note: str = ""
    seed: str = ""  # the seed's own figure for this line, when --seed


@dataclass(frozen=True)
class Finding:
    key: str
    title: str
    derivation: tuple[str, ...]


@dataclass
class Sheet:
    """Lines in the order they were derived, grouped by section, and the findings."""

    claims: dict[str, str] = field(default_factory=dict)  # key -> the seed's figure, for --seed
    lines: list[Line] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    section: str = ""

    def add(self, key: str, label: str, formula: str, value: float | None, unit: str, note: str = "") -> float:
        """Record a line; returns its value (NaN for unknown) so derivations chain."""
        self.lines.append(Line(key, self.section, label, formula, value, unit, note, self.claims.get(key, "")))
        return float("nan") if value is None else value

    def __getitem__(self, key: str) -> float:
        for ln in self.lines:
            if ln.key == key:
                return float("nan") if ln.value is None else ln.value
        raise KeyError(key)

    def __contains__(self, key: str) -> bool:
        return any(ln.key == key for ln in self.lines)

    def flag(self, key: str, title: str, *derivation: str) -> None:
        self.findings.append(Finding(key, title, tuple(derivation)))

    def to_json(self) -> dict[str, Any]:
        return {"lines": [asdict(ln) for ln in self.lines],
                "inconsistencies": [{"key": f.key, "title": f.title, "derivation": list(f.derivation)}
                                    for f in self.findings]}

    def render(self) -> str:
        """Plain text: per section, `label: formula = value unit`, notes indented below."""
        out: list[str] = []
        section = None
        for ln in self.lines:
            if ln.section != section:
                section = ln.section
                out.append(f"\n{section}")
            value = "unknown" if ln.value is None else f"{num(ln.value)} {ln.unit}".rstrip()
            if ln.unit == "$" and ln.value is not None:
                value = usd(ln.value)
            elif ln.unit.startswith("$/") and ln.value is not None:
                value = f"{usd(ln.value)}{ln.unit[1:]}"
            out.append(f"  {ln.label}: {ln.formula} = {value}" if ln.formula else f"  {ln.label}: {value}")
            if ln.seed:
                out.append(f"      seed: {ln.seed}")
            if ln.note:
                out.append(f"      {ln.note}")
        out.append("\nInconsistencies" if self.findings else "\nInconsistencies: none found")
        for i, f in enumerate(self.findings, 1):
            out.append(f"  {i}. {f.title}")
            out.extend(f"       {d}" for d in f.derivation)
        return "\n".join(out).lstrip("\n") + "\n"
