"""The usage ledger's schema: its migrations, in order, each applied once (PRAGMA user_version).

Append only: a shipped migration is never edited, since databases out there already ran it.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: the usage ledger
    """CREATE TABLE usage (
        request_id TEXT PRIMARY KEY, tenant TEXT, key_id TEXT, model TEXT, version TEXT, node TEXT,
        status TEXT NOT NULL, prompt_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
        max_tokens INTEGER, priority_class TEXT, idempotency_key TEXT, cost REAL NOT NULL DEFAULT 0,
        t_arrival REAL, t_first_token REAL, t_end REAL, opened_at REAL, closed_at REAL);
    CREATE INDEX usage_tenant_time ON usage(tenant, t_arrival);""",
    # 2: discounted tiers; one idempotency key never bills twice; fast recovery scan
    """ALTER TABLE usage ADD COLUMN cost_multiplier REAL NOT NULL DEFAULT 1.0;
    CREATE UNIQUE INDEX usage_idempotency ON usage(tenant, idempotency_key)
        WHERE idempotency_key IS NOT NULL;
    CREATE INDEX usage_open ON usage(status) WHERE status = 'open';""",
    # 3: per-request telemetry, one row per request
    """CREATE TABLE requests (
        request_id TEXT PRIMARY KEY, ts REAL, tenant TEXT, model TEXT, version TEXT, status TEXT,
        http_status INTEGER, error_code TEXT, finish_reason TEXT, decision TEXT, priority_class TEXT,
        prompt_tokens INTEGER, cached_tokens INTEGER, output_tokens INTEGER, queue_s REAL,
        prefill_s REAL, ttft_s REAL, itl_mean_s REAL, itl_p95_s REAL, total_s REAL,
        preemptions INTEGER, replica TEXT);
    CREATE INDEX requests_ts ON requests(ts);""",
    # 4: a cancelled run frees its idempotency key (nothing was delivered whole), so a retry
    #    under the same key is a new billable request; every other row keeps the key unique.
    """DROP INDEX usage_idempotency;
    CREATE UNIQUE INDEX usage_idempotency ON usage(tenant, idempotency_key)
        WHERE idempotency_key IS NOT NULL AND status != 'cancelled';""",
    # 5: a key bills once while its outcome is kept for replay (the idempotency store, `server.
    #    idempotency_ttl_s`); reused after that, it is a new request that must bill its own run.
    #    Unique here, the second close failed and left that row open and unbilled.
    """DROP INDEX usage_idempotency;
    CREATE INDEX usage_idempotency ON usage(tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;""",
    # 6: how often a request was carried over an engine's death (re-queued or resumed)
    """ALTER TABLE requests ADD COLUMN resumed INTEGER NOT NULL DEFAULT 0;""",
    # 7: windows of time across tenants (serving cost, spend today: llmd/cost/report.py)
    """CREATE INDEX usage_time ON usage(t_arrival);""",
    # 8: the dashboard's request inspector: found by the client's X-Request-ID too; the rest of its timeline
    "".join(f"ALTER TABLE requests ADD COLUMN {c};" for c in ("client_request_id TEXT", "endpoint TEXT",
            "stream INTEGER", "filter TEXT", "redacted TEXT", "last_token_s REAL", "cost REAL", "degraded TEXT",
            "marks TEXT"))
    + "CREATE INDEX requests_client_id ON requests(client_request_id) WHERE client_request_id IS NOT NULL;",
]
SCHEMA_VERSION = len(MIGRATIONS)
