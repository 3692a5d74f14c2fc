"""A workload replayed from llmd's usage ledger (the SQLite metering DB, llmd/metering.py).

Every row of `usage` is one request as it arrived: tenant, priority class, prompt and output
tokens, arrival time. The replay keeps who asked for what and when, so a plan is checked
against the traffic a deployment really had, at `speed` × (2: the same day in half the time, so
twice the rate) and optionally a window [since, until) of epoch seconds.

What a ledger cannot say: a request that did not finish (shed, an error, a cancel) generated
fewer tokens than it asked for. Its demand is its `max_tokens` where known, else the median
output of the `ok` rows (at least what it did generate); `ok` rows generated exactly their
`output_tokens`. Requests an input filter refused never reach an engine, and are left out. Which system prompt a request
shared is not recorded either (only how many of its prompt tokens hit the cache), so a replayed
trace has no prefix groups; a workload's `prefixes` adds them (llmd/plan/sim/workload.py).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np

from llmd.plan.errors import PlanError
from llmd.plan.sim.trace import CLASSES, Trace

_SQL = ("SELECT t_arrival, COALESCE(tenant, ''), COALESCE(priority_class, ''), prompt_tokens, output_tokens, "
        "max_tokens, status FROM usage WHERE t_arrival IS NOT NULL AND status != 'filtered'{where} "
        "ORDER BY t_arrival, rowid")
UNKNOWN_TENANT = "-"


def replay_ledger(path: Path, *, speed: float = 1.0, since: float | None = None, until: float | None = None,
                  duration: float | None = None) -> Trace:
    """The ledger's requests as a Trace, times from the first arrival (÷ speed), cut at `duration`
    seconds of replayed time if given."""
    if not speed > 0:
        raise PlanError(f"ledger replay: speed {speed} must be > 0")
    rows = _read(Path(path), since, until)
    if not rows:
        raise PlanError(f"ledger replay: no requests in {path}" + (" in that window" if since or until else ""))
    t0 = rows[0][0]
    t = (np.array([r[0] for r in rows], dtype=np.float64) - t0) / speed
    keep = int(np.searchsorted(t, duration, side="left")) if duration is not None else len(rows)
    rows, t = rows[:keep], t[:keep]
    tenants = tuple(sorted({r[1] or UNKNOWN_TENANT for r in rows}))
    index = {name: i for i, name in enumerate(tenants)}
    klass = {name: i for i, name in enumerate(CLASSES)}
    ok = [r[4] for r in rows if r[6] == "ok"]
    typical = int(np.median(ok)) if ok else 1
    out = np.array([r[4] if r[6] == "ok" else max(r[4], r[5] or typical) for r in rows], dtype=np.int64)
    n = len(rows)
    return Trace(t=t,
                 tenant=np.array([index[r[1] or UNKNOWN_TENANT] for r in rows], dtype=np.int32),
                 klass=np.array([klass.get(r[2], 0) for r in rows], dtype=np.int8),
                 prompt_tokens=np.maximum(np.array([r[3] for r in rows], dtype=np.int64), 1).astype(np.int32),
                 output_tokens=np.maximum(out, 1).astype(np.int32),
                 prefix=np.full(n, -1, dtype=np.int32), prefix_tokens=np.zeros(n, dtype=np.int32),
                 tenants=tenants)


def _read(path: Path, since: float | None, until: float | None) -> list[tuple[float, str, str, int, int, int, str]]:
    if not path.is_file():
        raise PlanError(f"ledger replay: no usage database at {path}")
    conds, params = [], []
    for cond, val in (("t_arrival >= ?", since), ("t_arrival < ?", until)):
        if val is not None:
            conds.append(cond)
            params.append(val)
    where = "".join(f" AND {c}" for c in conds)
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise PlanError(f"ledger replay: cannot open {path}: {e}") from None
    try:
        return [(float(a), str(b), str(c), int(d or 0), int(e or 0), int(f or 0), str(g))
                for a, b, c, d, e, f, g in conn.execute(_SQL.format(where=where), params)]
    except sqlite3.Error as e:
        raise PlanError(f"ledger replay: {path} is not an llmd usage database ({e})") from None
    finally:
        conn.close()
