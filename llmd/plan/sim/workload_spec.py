"""A workload spec from command-line options or a TOML file (its `[workload]` table, or the whole
file), the same keys in both:

    workload   = "diurnal"            # constant (or poisson), bursty, diurnal, replay
    rate       = 280                  # req/s: the mean, or diurnal's peak
    duration   = "1h"                 # seconds, or with s/m/h/d
    cv         = 2.0                  # inter-arrival CV (1: Poisson; bursty's default 3)
    amplitude  = 0.6                  # diurnal: 1 − trough/peak;  period, peak_at: durations
    prompt     = "lognormal:1000:0.5:8192"      # llmd/plan/sim/lengths.py
    output     = "lognormal:300:0.6"
    tenants    = "a:0.7,b:0.3:0.5"    # name:share[:batch share], or a table {a = 0.7, b = 0.3}
    batch_share = 0.2                 # of every tenant without its own
    prefixes   = "8:400:1.1:0.8"      # groups:tokens[:zipf[:share]]; tokens "200/400/..." per group
    ledger     = "llmd.db"            # replay: the usage DB; speed, since, until (epoch s or YYYY-MM-DD)
    seed       = 0

Anything wrong is a PlanError naming the key, the value and what it should be.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from llmd.plan.errors import PlanError
from llmd.plan.sim.arrivals import PROFILES, Arrivals
from llmd.plan.sim.lengths import parse_lengths
from llmd.plan.sim.workload import Prefixes, TenantShare, WorkloadSpec

ARRIVAL_KEYS = ("rate", "duration", "cv", "amplitude", "period", "peak_at")
GENERATOR_KEYS = (*ARRIVAL_KEYS, "prompt", "output", "tenants", "batch_share")
REPLAY_KEYS = ("ledger", "speed", "since", "until")
KEYS = ("workload", *GENERATOR_KEYS, "prefixes", *REPLAY_KEYS, "seed")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
F = TypeVar("F", bound=Callable[..., Any])


def parse_workload(d: Mapping[str, Any], source: str = "workload") -> WorkloadSpec:
    """A spec from key → value (strings as typed on a command line, or TOML's numbers, tables and
    lists); keys with value None are absent."""
    d = {k: v for k, v in d.items() if v is not None}
    unknown = sorted(set(d) - set(KEYS))
    if unknown:
        raise PlanError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"the keys are {', '.join(KEYS)}")
    kind = str(d.get("workload", "replay" if "ledger" in d else "constant")).lower()
    kind = "constant" if kind == "poisson" else kind
    if kind not in (*PROFILES, "replay"):
        raise PlanError(f"{source}: workload {kind!r} is not one of constant, poisson, bursty, diurnal, replay")
    try:
        common = {"seed": _int(d, "seed", 0), "prefixes": _prefixes(d["prefixes"]) if "prefixes" in d else None}
        return _replay(d, common) if kind == "replay" else _generated(kind, d, common)
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from None


def _generated(kind: str, d: Mapping[str, Any], common: dict[str, Any]) -> WorkloadSpec:
    stray = [k for k in REPLAY_KEYS if k in d]
    if stray:
        raise PlanError(f"{', '.join(stray)} only apply to workload = \"replay\" (a ledger), not {kind!r}")
    if "rate" not in d:
        raise PlanError("give a rate (requests per second; diurnal: the peak)")
    arr = Arrivals(profile=kind, rate=_float(d, "rate"),
                   duration=_seconds(d.get("duration", 3600), "duration"),
                   cv=_float(d, "cv") if "cv" in d else None,
                   amplitude=_float(d, "amplitude") if "amplitude" in d else 0.5,
                   period=_seconds(d["period"], "period") if "period" in d else None,
                   peak_at=_seconds(d["peak_at"], "peak_at") if "peak_at" in d else None)
    if kind != "diurnal" and any(k in d for k in ("amplitude", "period", "peak_at")):
        raise PlanError(f"amplitude, period and peak_at only apply to workload = \"diurnal\", not {kind!r}")
    extra: dict[str, Any] = {}
    for k in ("prompt", "output"):
        if k in d:
            extra[k] = parse_lengths(str(d[k]), k)
    if "tenants" in d:
        extra["tenants"] = _tenants(d["tenants"])
    return WorkloadSpec(arrivals=arr, batch_share=_float(d, "batch_share") if "batch_share" in d else 0.0,
                        **extra, **common)


def _replay(d: Mapping[str, Any], common: dict[str, Any]) -> WorkloadSpec:
    if "ledger" not in d:
        raise PlanError("workload = \"replay\" needs a ledger (the usage DB, llmd.db)")
    stray = [k for k in GENERATOR_KEYS if k in d and k != "duration"]
    if stray:
        raise PlanError(f"{', '.join(stray)} cannot apply to a replayed ledger: its own requests are replayed")
    return WorkloadSpec(ledger=Path(str(d["ledger"])), speed=_float(d, "speed") if "speed" in d else 1.0,
                        since=_epoch(d["since"], "since") if "since" in d else None,
                        until=_epoch(d["until"], "until", end=True) if "until" in d else None,
                        replay_duration=_seconds(d["duration"], "duration") if "duration" in d else None, **common)


def _float(d: Mapping[str, Any], key: str) -> float:
    v = d[key]
    try:
        if isinstance(v, bool):
            raise ValueError
        return float(v)
    except (TypeError, ValueError):
        raise PlanError(f"{key} = {v!r} is not a number") from None


def _int(d: Mapping[str, Any], key: str, default: int) -> int:
    if key not in d:
        return default
    f = _float(d, key)
    if f != int(f):
        raise PlanError(f"{key} = {d[key]!r} is not a whole number")
    return int(f)


def _seconds(v: Any, key: str) -> float:
    """3600, "3600", "90s", "30m", "1h", "1d"."""
    s = str(v).strip().lower()
    mult = _UNITS.get(s[-1:])
    try:
        return float(s[:-1] if mult else s) * (mult or 1.0)
    except ValueError:
        raise PlanError(f"{key} = {v!r} is not a duration (seconds, or a number with s, m, h or d)") from None


def _epoch(v: Any, key: str, end: bool = False) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    from llmd.metering import day_start  # the ledger's own date parser (YYYY-MM-DD is UTC)

    try:
        return float(v) if str(v).replace(".", "", 1).isdigit() else day_start(str(v), end=end)
    except ValueError:
        raise PlanError(f"{key} = {v!r} is neither epoch seconds nor a date (YYYY-MM-DD)") from None


def _tenants(v: Any) -> tuple[TenantShare, ...]:
    """"a:0.7,b:0.3:0.5" or {a = 0.7, b = {share = 0.3, batch_share = 0.5}}."""
    items: list[tuple[str, Any, Any]] = []
    if isinstance(v, Mapping):
        for name, x in v.items():
            t = x if isinstance(x, Mapping) else {"share": x}
            items.append((str(name), t.get("share"), t.get("batch_share")))
    else:
        for part in str(v).split(","):
            bits = part.strip().split(":")
            if len(bits) not in (2, 3):
                raise PlanError(f"tenants: {part.strip()!r} is not name:share[:batch_share]")
            items.append((bits[0].strip(), bits[1], bits[2] if len(bits) == 3 else None))
    try:
        return tuple(TenantShare(n, float(s), float(b) if b is not None else None) for n, s, b in items)
    except (TypeError, ValueError):
        raise PlanError(f"tenants: shares must be numbers, got {v!r}") from None


def _prefixes(v: Any) -> Prefixes:
    """"groups:tokens[:zipf[:share]]" (tokens "400" or "200/400/800") or a table of those keys."""
    if isinstance(v, Mapping):
        d = dict(v)
    else:
        bits = str(v).split(":")
        if not 2 <= len(bits) <= 4:
            raise PlanError(f"prefixes = {v!r} is not groups:tokens[:zipf[:share]]")
        d = dict(zip(("groups", "tokens", "zipf", "share"), bits, strict=False))
        d["tokens"] = d["tokens"].split("/")
    try:
        toks = d.get("tokens")
        toks = toks if isinstance(toks, list) else [toks]
        groups = float(d["groups"])
        tokens = tuple(float(t) for t in toks)
        if groups != int(groups) or any(t != int(t) for t in tokens):
            raise ValueError
        return Prefixes(int(groups), tuple(int(t) for t in tokens), zipf=float(d.get("zipf", 1.0)),
                        share=float(d.get("share", 1.0)))
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"prefixes = {v!r}: groups and tokens must be whole numbers, "
                        "zipf and share numbers") from None


def load_workload(path: Path, overrides: Mapping[str, Any] | None = None) -> WorkloadSpec:
    """A TOML file's `[workload]` table (or its top level), each of `overrides` replacing its key."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"cannot read workload file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"{path}: not TOML ({e})") from None
    table = doc.get("workload", doc)
    if not isinstance(table, dict):
        raise PlanError(f"{path}: [workload] must be a table")
    return parse_workload({**table, **{k: v for k, v in (overrides or {}).items() if v is not None}}, str(path))


def workload_options(f: F) -> F:
    """The workload's command-line options (`--workload`, `--rate`, ... `--workload-file`), for any
    `llmd plan` command that draws a workload; `spec_from_options` turns them into a spec."""
    for key in reversed(KEYS):
        f = click.option(f"--{key.replace('_', '-')}", key, default=None, help=_HELP.get(key))(f)
    return click.option("--workload-file", type=click.Path(path_type=Path), default=None,
                        help="A TOML workload (its [workload] table); options given override its keys.")(f)


def spec_from_options(opts: Mapping[str, Any]) -> WorkloadSpec:
    """The spec `workload_options` collected (its keys are popped by the caller or ignored here)."""
    given = {k: opts.get(k) for k in KEYS}
    path = opts.get("workload_file")
    return load_workload(Path(path), given) if path is not None else parse_workload(given, "options")


_HELP = {"workload": "Arrivals: constant (Poisson), bursty, diurnal, or replay (a usage ledger).",
         "rate": "Requests per second: the mean, or diurnal's peak.",
         "duration": "Seconds of traffic (or 30m, 1h, 1d); default 1h. Replay: how much of the ledger.",
         "cv": "Inter-arrival coefficient of variation (1: Poisson; bursty's default 3).",
         "amplitude": "Diurnal: 1 − trough/peak (default 0.5).",
         "period": "Diurnal: one cycle (default: the duration).",
         "peak_at": "Diurnal: when the peak is (default: half a period).",
         "prompt": "Prompt lengths: N, fixed:N, uniform:LO:HI, lognormal:MEAN:CV, each [:MAX].",
         "output": "Output lengths, as --prompt.",
         "tenants": "name:share[:batch_share],... (default one tenant).",
         "batch_share": "Fraction of requests in the batch class (default 0).",
         "prefixes": "Shared system prompts: groups:tokens[:zipf[:share]].",
         "ledger": "Replay this usage DB (llmd.db).", "speed": "Replay this many times faster.",
         "since": "Replay from (epoch s or YYYY-MM-DD).", "until": "Replay until (epoch s or YYYY-MM-DD, inclusive).",
         "seed": "Random seed (same seed, same workload)."}
