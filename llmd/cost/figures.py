"""What the ledger says about a window of time, per bucket: tokens served and busy seconds per
model and version, billed spend per tenant. Plain sqlite3 reads over the `usage_time` index.

Busy stretches are merged here rather than in SQL (gaps and islands with window functions cost
3-4x as much on 100,000 rows): the rows come sorted by arrival from the index, and one pass per
version joins every request that starts before the stretch so far has ended."""

from __future__ import annotations

import sqlite3
from collections import defaultdict

from llmd.cost.split import spread

Version = tuple[str, str]  # (model, version)
Buckets = dict[float, dict[Version, list[float]]]  # bucket start -> version -> [requests, prompt, output, busy s]
Spend = dict[float, dict[str, list[float]]]  # bucket start -> tenant -> [requests, prompt, output, spend]

# Tokens the engine served, per version and bucket of arrival: prompt tokens of requests that got
# a first token (a request refused, shed or cancelled before one cost no prefill worth pricing),
# and every output token.
TOKENS_SQL = """
SELECT model, version, CAST(t_arrival / :b AS INTEGER) * :b AS bucket, COUNT(*),
       COALESCE(SUM(CASE WHEN t_first_token IS NOT NULL OR output_tokens > 0 THEN prompt_tokens END), 0),
       COALESCE(SUM(output_tokens), 0)
FROM usage WHERE version IS NOT NULL AND t_arrival >= :since AND t_arrival < :until GROUP BY 1, 2, 3"""
# Every request's stretch from arrival to end (one still open runs until now; one a crash
# interrupted has no end and counts for nothing), from `reach` before the window on: no request
# lives longer than its deadline.
SPANS_SQL = """
SELECT model, version, t_arrival,
       CASE WHEN t_end IS NOT NULL THEN t_end WHEN status = 'open' THEN :now ELSE t_arrival END
FROM usage WHERE version IS NOT NULL AND t_arrival >= :since - :reach AND t_arrival < :until ORDER BY t_arrival"""
SPEND_SQL = """
SELECT tenant, CAST(t_arrival / :b AS INTEGER) * :b AS bucket, COUNT(*), COALESCE(SUM(prompt_tokens), 0),
       COALESCE(SUM(output_tokens), 0), COALESCE(SUM(cost), 0.0)
FROM usage WHERE t_arrival >= :since AND t_arrival < :until GROUP BY +tenant, 2"""  # +tenant: read by time


def usage_buckets(conn: sqlite3.Connection, since: float, until: float, bucket_s: float, now: float,
                  reach_s: float) -> Buckets:
    """Requests, prompt and output tokens served, and busy seconds, per bucket and version in [since, until)."""
    out: Buckets = defaultdict(dict)
    args = {"since": since, "until": until, "now": now, "b": bucket_s, "reach": reach_s}
    for m, v, b, n, p, o in conn.execute(TOKENS_SQL, args):
        out[float(b)][(m, v)] = [n, p, o, 0.0]
    for (m, v, b), seconds in spread(_islands(conn.execute(SPANS_SQL, args), since, until), since, until,
                                     bucket_s).items():
        out[b].setdefault((m, v), [0, 0, 0, 0.0])[3] = seconds
    return dict(out)


def _islands(rows: sqlite3.Cursor, since: float, until: float) -> list[tuple[str, str, float, float]]:
    """Disjoint busy stretches per version, clipped to [since, until), from rows sorted by start."""
    open_: dict[Version, list[float]] = {}
    out: list[tuple[str, str, float, float]] = []
    for m, v, start, end in rows:
        s, e = max(start, since), min(end, until)
        if e <= s:
            continue
        cur = open_.get((m, v))
        if cur is None or s > cur[1]:
            if cur is not None:
                out.append((m, v, cur[0], cur[1]))
            open_[(m, v)] = [s, e]
        elif e > cur[1]:
            cur[1] = e
    out += [(m, v, s, e) for (m, v), (s, e) in open_.items()]
    return out


def spend_buckets(conn: sqlite3.Connection, since: float, until: float, bucket_s: float) -> Spend:
    """Requests, tokens and billed cost per bucket and tenant in [since, until)."""
    out: Spend = defaultdict(dict)
    for tenant, b, n, p, o, cost in conn.execute(SPEND_SQL, {"since": since, "until": until, "b": bucket_s}):
        if tenant is not None:
            out[float(b)][tenant] = [n, p, o, cost]
    return dict(out)
