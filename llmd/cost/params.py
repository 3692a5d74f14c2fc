"""The window and bucket a cost report is asked for, as the CLI and the admin route spell them."""

from __future__ import annotations

import math
import re

from llmd.metering import day_start

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MIN_BUCKET_S = 60.0


def parse_bucket(raw: str) -> float:
    """'3600', '15m', '1h', '1d' -> seconds (at least a minute)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", raw)
    if m is None:
        raise ValueError(f"bucket must be seconds or a number with s, m, h or d (like 15m, 1h, 1d), got {raw!r}")
    seconds = float(m.group(1)) * UNITS[m.group(2) or "s"]
    if seconds < MIN_BUCKET_S:
        raise ValueError(f"bucket must be at least {MIN_BUCKET_S:.0f} seconds, got {raw!r}")
    return seconds


def parse_time(raw: str, end_of_day: bool = False) -> float:
    """A unix time, an ISO datetime (UTC unless it says) or a YYYY-MM-DD day (its start, or with
    `end_of_day` its end: `--until 2026-12-01` includes that day)."""
    try:
        t = float(raw)
    except ValueError:
        pass
    else:
        if not math.isfinite(t):
            raise ValueError(f"expected a unix time, an ISO date or YYYY-MM-DD, got {raw!r}")
        return t
    try:
        return day_start(raw, end_of_day)  # what `llmd usage --since/--until` reads, too
    except ValueError:
        raise ValueError(f"expected a unix time, an ISO date or YYYY-MM-DD, got {raw!r}") from None
