"""How a request's ignored top-level fields are named back: one bounded ASCII header value.

A router's extensions are ignored rather than refused (`requests.parse`); the client and the
operator still learn which, without a hostile name breaking the header or a value being echoed.
"""

from __future__ import annotations

from urllib.parse import quote

IGNORED_HEADER = "x-llmd-ignored-fields"
MAX_IGNORED_NAMED = 16  # names in the header and the log line; the rest are counted ("+N")
MAX_IGNORED_CHARS = 64  # of one name, percent-encoded; a cut name ends with "*"


def ignored_names(names: tuple[str, ...]) -> str:
    """`names` as one bounded ASCII header value: at most MAX_IGNORED_NAMED, each percent-encoded
    (so a comma, a control or non-ASCII character cannot break the header) and cut to
    MAX_IGNORED_CHARS, then "+N" for the rest. Names only: values are never echoed."""
    shown = [_short(quote(n, safe="")) for n in names[:MAX_IGNORED_NAMED]]
    if len(names) > MAX_IGNORED_NAMED:
        shown.append(f"+{len(names) - MAX_IGNORED_NAMED}")
    return ",".join(shown)


def _short(encoded: str) -> str:
    if len(encoded) <= MAX_IGNORED_CHARS:
        return encoded
    cut = encoded[:MAX_IGNORED_CHARS - 1]
    pct = cut.rfind("%", len(cut) - 2)
    return (cut[:pct] if pct >= 0 else cut) + "*"  # "*" is always encoded in a name: it marks the cut
