"""The one writer of docs/benchmarks.md, and the pieces every report is made of.

The file is an intro (everything before the first `## ` heading) followed by one `## `
section per benchmark. A run replaces its own section (or appends it) and keeps the rest
byte for byte, so figures from different scripts and runs sit side by side; bench/fairness.py
goes one level down and replaces only the `### ` subsections of the parts it ran.
Each section starts with `stamp()`: when, on which llmd code, and the exact command.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"


# -- docs/benchmarks.md -----------------------------------------------------------
def _split(text: str, level: str) -> tuple[list[str], list[list[str]]]:
    """(lines before the first heading of `level` ("## "), [each heading's lines up to the next])."""
    head: list[str] = []
    parts: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith(level):
            parts.append([line])
        elif parts:
            parts[-1].append(line)
        else:
            head.append(line)
    return head, parts


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def _join(head: list[str], parts: list[list[str]]) -> str:
    blocks = [b for b in [_trim(head), *(_trim(p) for p in parts)] if b]
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def _read(doc: Path) -> str:
    return doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"


def _write(doc: Path, text: str) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")


def write_section(doc: Path, section: str | Sequence[str]) -> None:
    """Replace the `## ` section whose heading is `section`'s first line (or append it); the
    intro and the other sections are kept."""
    new = section.splitlines() if isinstance(section, str) else list(section)
    head, parts = _split(_read(doc), "## ")
    at = next((i for i, p in enumerate(parts) if p[0].strip() == new[0].strip()), None)
    if at is None:
        parts.append(new)
    else:
        parts[at] = new
    _write(doc, _join(head, parts))


def write_subsections(doc: Path, title: str, intro: Sequence[str], subs: dict[str, list[str]]) -> None:
    """Within the `## ` section `title`: set its intro, and replace the `### ` subsections whose
    heading starts with each key of `subs` ("### (a)" for key "(a)"), keeping the others
    (subsections are kept in key order, numbers by value: "(a2)" before "(a10)")."""
    head, parts = _split(_read(doc), "## ")
    old = next((p for p in parts if p[0].strip() == title), None)
    kept: dict[str, list[str]] = {}
    if old is not None:
        for sub in _split("\n".join(old[1:]), "### ")[1]:
            kept[sub[0][4:].split(" ", 1)[0]] = sub
    kept.update(subs)
    body = [title, "", *intro, ""]
    for key in sorted(kept, key=_natural):
        body += [*_trim(kept[key]), ""]
    if old is None:
        parts.append(body)
    else:
        parts[parts.index(old)] = body
    _write(doc, _join(head, parts))


def _natural(key: str) -> list[tuple[int, int | str]]:
    """A subsection key's sort key: its digit runs as numbers after any text, so "(a10)" follows
    "(a9)" and "(a)" comes first."""
    return [(1, int(t)) if t.isdigit() else (0, t) for t in re.findall(r"\d+|\D", key)]


# -- markdown pieces --------------------------------------------------------------
def row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table's lines."""
    return [row(head), row(["---"] * len(head)), *(row(r) for r in rows)]


def verdict(ok: bool) -> str:
    """How every script marks a target: PASS, or MISS (a measured figure, not a crash)."""
    return "PASS" if ok else "MISS"


def verdict_lines(verdicts: Sequence[tuple[str, bool]]) -> list[str]:
    """One `- claim: PASS|MISS` bullet per (claim, ok)."""
    return [f"- {text}: {verdict(ok)}" for text, ok in verdicts]


def num(x: float | None, digits: int = 1) -> str:
    """`x` to `digits` decimals; "n/a" for None or NaN (nothing was measured)."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# -- the run stamp -----------------------------------------------------------------
def _git(*argv: str) -> str:
    r = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def code_version() -> str:
    """The commit llmd runs at, and whether its sources had uncommitted changes."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + uncommitted changes in llmd/" if _git("status", "--porcelain", "--", "llmd") else "")


def source_stamp() -> float:
    """Newest modification time of llmd's sources: servers started before and after an edit run different code."""
    return max((f.stat().st_mtime for f in (ROOT / "llmd").rglob("*.py")), default=0.0)


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that produced a run, as someone would type it from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    return "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(argv[0], ROOT), *argv[1:]])


def filesystem(path: Path) -> str:
    """The filesystem type under `path` (from /proc/mounts), for the record: I/O figures depend on it."""
    best, kind = "", "unknown fs"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    except OSError:
        pass
    return f"{kind} ({path})"


def date() -> str:
    return f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"


def stamp(seconds: float | None = None, version: str | None = None, cmd: str | None = None,
          took: str | None = None) -> str:
    """A section's first line: date, llmd's code version, the command, and how long it took
    (`took` replaces the default "took N min" wording)."""
    out = f"Date: {date()}; llmd at {version or code_version()}; command: `{cmd or command()}`"
    if took is None and seconds is not None:
        took = f"took {seconds / 60:.1f} min"
    return out + (f"; {took}." if took else ".")
