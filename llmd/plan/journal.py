"""`llmd plan search`'s journal: every evaluation on disk as it finishes, so a search that is
interrupted (Ctrl-C, a kill, a crash in the simulator) keeps what it found and resumes from it.

The file is JSON lines: a header naming what the evaluations depend on, then one line per
evaluated candidate with its full report. The header's `inputs` digest covers the workload trace,
the step model, the config file, the model and the price (the report's dollars); targets are not
in it, because a stored report is judged again on every run, so a resumed search may change its
SLOs and reuse every simulation. A journal written for other inputs is refused, never overwritten.
A last line cut short by a kill is dropped (and cut off the file) on the next open.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Final

from llmd.plan.errors import PlanError
from llmd.plan.search import Candidate, Evaluator

FORMAT: Final = "llmd-plan-search-journal/1"


def journal_path(out: Path) -> Path:
    """Where `--out X` keeps its evaluations: X.evaluations.jsonl beside it."""
    return out.with_name(out.name + ".evaluations.jsonl")


def inputs_digest(parts: Mapping[str, bytes]) -> dict[str, str]:
    """A short sha256 of each named input, and of them all (`all`)."""
    out = {k: hashlib.sha256(v).hexdigest()[:16] for k, v in sorted(parts.items())}
    out["all"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]
    return out


def _key(c: Candidate) -> str:
    return json.dumps(asdict(c), sort_keys=True)


class Journal:
    """Open (or start) the journal at `path` for a search whose inputs digest to `inputs`.
    `reports` holds what earlier runs evaluated; `record` appends one evaluation, flushed and
    synced before the search moves on."""

    def __init__(self, path: Path, inputs: dict[str, str]) -> None:
        self.path = path
        self.inputs = inputs
        self.reports: dict[str, Mapping[str, Any]] = {}
        self.reused = 0
        keep = self._read() if path.exists() else 0
        self._f: IO[str] = open(path, "r+" if keep else "w", encoding="utf-8")  # noqa: SIM115 (held open)
        if keep:
            self._f.truncate(keep)  # a line cut short by a kill goes
            self._f.seek(keep)
        else:
            self._write({"format": FORMAT, "inputs": inputs})

    def _read(self) -> int:
        """Load the stored evaluations; returns the byte length of the whole lines kept (0: the
        file is empty or holds no header: start it again)."""
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        if not lines[0].strip():
            return 0
        try:
            head = json.loads(lines[0])
        except ValueError:
            raise PlanError(f"{self.path}: not a search journal (its first line is not JSON); remove it "
                            "or choose another --out/--journal") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise PlanError(f"{self.path}: not a {FORMAT} file; remove it or choose another --out/--journal")
        theirs = head.get("inputs", {})
        if theirs.get("all") != self.inputs["all"]:
            differ = sorted(k for k in self.inputs if k != "all" and theirs.get(k) != self.inputs[k])
            raise PlanError(f"{self.path}: written for another search ({', '.join(differ) or 'inputs'} "
                            "differ); remove it, pass --fresh, or choose another --out/--journal")
        kept = len(lines[0]) + 1
        for line in lines[1:]:
            try:
                row = json.loads(line)
                self.reports[_key(Candidate(**row["candidate"]))] = row["report"]
            except (ValueError, KeyError, TypeError):
                break  # the last line, cut short (or nothing after the last newline)
            kept += len(line) + 1
        return kept

    def _write(self, row: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def wrap(self, evaluate: Evaluator, reused: Callable[[Candidate], None] | None = None) -> Evaluator:
        """`evaluate`, answered from the journal where it can be, recording the rest."""
        def journaled(c: Candidate) -> Mapping[str, Any]:
            k = _key(c)
            if k in self.reports:
                self.reused += 1
                if reused is not None:
                    reused(c)
                return self.reports[k]
            report = evaluate(c)
            self._write({"candidate": asdict(c), "report": dict(report)})
            self.reports[k] = report
            return report

        return journaled

    def kept(self) -> int:
        """The whole evaluation lines on disk. Counted from the file, not from `reports`: Ctrl-C
        can land between a line's write and its entry (another thread takes the signal, so
        blocking it here cannot hold it back), and the file is what a resume reads."""
        return max(0, self.path.read_bytes().count(b"\n") - 1)

    def close(self) -> None:
        self._f.close()
