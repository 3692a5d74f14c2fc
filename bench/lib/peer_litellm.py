"""LiteLLM's proxy in front of a `vllm serve`, with per-tenant API keys and per-key TPM/RPM
limits: what a team would put in front of vLLM to keep tenants apart (issue 49, item 1).

LiteLLM documents per-key limits on its virtual keys (`/key/generate` with `tpm_limit`/`rpm_limit`),
which live in its Postgres database through prisma-client-py. That client needs Prisma's Rust query
engine, which the Prisma CLI downloads from Prisma's own binary host at `prisma generate` time (no
PyPI or npm package ships it), and this machine reaches only PyPI, npm and Debian: so no virtual
keys here. The proxy instead authenticates with LiteLLM's documented custom auth
(`general_settings.custom_auth`), which returns each tenant's key with its `tpm_limit`/`rpm_limit`
set: LiteLLM's docs say custom auth enforces the rate limits set on the returned object with no
further flags, through the same limiter (parallel_request_limiter_v3, 60 s sliding window, 429
with `retry-after: 60`) that enforces a virtual key's limits. See LIMITS_NOTE.

Retries are off everywhere LiteLLM retries (`num_retries`, the upstream client's `max_retries`):
the bench's clients retry themselves. Cooldowns are off too, so one upstream error never takes the
only deployment out of rotation. Streams pass through chunk by chunk (LiteLLM's default for
`stream: true`; nothing buffers them).

Self-check (a real engine behind it, so under the heavy-work lock):
    flock /tmp/llmd-heavy.lock .venv/bin/python -m bench.lib.peer_litellm
"""

from __future__ import annotations

import contextlib
import json
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.lib.peers import ensure_venv
from bench.lib.servers import free_port, running

# The newest release whose `proxy` extra resolves from this machine's registries (1.108.8 and later
# pin litellm-enterprise / litellm-proxy-extras / litellm-proxy releases not published here).
LITELLM = "litellm[proxy]==1.108.7"

LIMITS_NOTE = (
    "LiteLLM 1.108.7 proxy; per-tenant API keys with per-key tpm_limit/rpm_limit set by LiteLLM's documented "
    "custom auth (general_settings.custom_auth returning UserAPIKeyAuth(tpm_limit, rpm_limit)), enforced by "
    "its parallel_request_limiter_v3 (60 s sliding window, 429 + retry-after: 60), the limiter virtual keys "
    "use; tokens are counted from each response's usage as it ends, so concurrent streams can overshoot the "
    "TPM limit before refusals start. Not virtual keys (/key/generate): they need LiteLLM's Postgres database "
    "through prisma, whose query engine binary Prisma downloads from its own host at run time, unreachable "
    "here. Retries and cooldowns off (num_retries 0, max_retries 0, disable_cooldowns)."
)

# Written next to the proxy's config; LiteLLM imports it by the dotted path in `custom_auth`.
AUTH_MODULE = '''\
"""Custom auth for LiteLLM's proxy: each tenant's key, with that tenant's TPM/RPM limits."""
import hashlib
import json
from pathlib import Path

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

_CFG = json.loads((Path(__file__).parent / "tenant_keys.json").read_text())


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    key = api_key.removeprefix("Bearer ").strip()
    if key == _CFG["master_key"]:
        return UserAPIKeyAuth(api_key=key, user_role="proxy_admin")
    tenant = _CFG["keys"].get(key)
    if tenant is None:
        raise Exception("unknown API key")
    limits = _CFG["limits"][tenant]
    return UserAPIKeyAuth(api_key=hashlib.sha256(key.encode()).hexdigest(), key_alias=tenant,
                          tpm_limit=limits.get("tpm"), rpm_limit=limits.get("rpm"))
'''


def ensure_litellm() -> Path:
    """The peer venv's bin folder, installed on first use (90 s here)."""
    return ensure_venv("litellm", [LITELLM])


def proxy_config(upstream: str, name: str, master_key: str) -> dict[str, object]:
    """LiteLLM's config (YAML is a superset of JSON, so it is written as JSON): one deployment, the
    `vllm serve` at `upstream` through LiteLLM's hosted_vllm provider, retries and cooldowns off."""
    return {
        "model_list": [{
            "model_name": name,
            "litellm_params": {"model": f"hosted_vllm/{name}", "api_base": upstream.rstrip("/") + "/v1",
                               "api_key": "none", "max_retries": 0, "timeout": 900, "stream_timeout": 900},
        }],
        "litellm_settings": {"num_retries": 0, "request_timeout": 900, "telemetry": False, "drop_params": False},
        "router_settings": {"num_retries": 0, "retry_after": 0, "disable_cooldowns": True},
        "general_settings": {"master_key": master_key, "custom_auth": "tenant_auth.user_api_key_auth"},
    }


@contextlib.contextmanager
def litellm_proxy(upstream: str, name: str, tenants: dict[str, dict[str, int]], log: Path,
                  ready_timeout: float = 180.0) -> Iterator[tuple[str, dict[str, str]]]:
    """LiteLLM's proxy on a free loopback port in front of `upstream` (model `name`), each tenant a
    fresh API key limited to its {"tpm": ..., "rpm": ...}; ready inside the block, then stopped with
    its process group. Yields (http://127.0.0.1:PORT, tenant -> API key)."""
    bin_dir = ensure_litellm()
    work = Path(tempfile.mkdtemp(prefix="llmd-litellm-"))
    master = "sk-master-" + secrets.token_hex(16)
    keys = {t: f"sk-{t}-{secrets.token_hex(12)}" for t in tenants}
    (work / "tenant_auth.py").write_text(AUTH_MODULE, encoding="utf-8")
    (work / "tenant_keys.json").write_text(json.dumps({
        "master_key": master, "keys": {k: t for t, k in keys.items()}, "limits": tenants}), encoding="utf-8")
    cfg = work / "proxy.yaml"
    cfg.write_text(json.dumps(proxy_config(upstream, name, master), indent=1), encoding="utf-8")
    port = free_port()
    argv = [str(bin_dir / "litellm"), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]
    # The cost map ships inside the package (no fetch at start); no telemetry, no database.
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "DISABLE_ADMIN_UI": "True",
           "LITELLM_LOG": "WARNING", "PYTHONPATH": str(work)}
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with running(argv, url + "/health/liveliness", log, ready_timeout, env) as proc:
        print(f"  litellm proxy ready on :{port} after {time.monotonic() - t0:.0f}s (pid {proc.pid})", flush=True)
        yield url, keys


def _over_limit(url: str, name: str, tenant: str, key: str, left: int) -> None:
    """Send `left` + 1 tiny requests as `tenant`, who has `left` requests left this minute: the last
    must be refused with 429; print its Retry-After header and message."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    for i in range(left + 1):
        try:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            print(f"  {tenant} request {i + 1}: 200")
        except openai.RateLimitError as e:
            print(f"  {tenant} request {i + 1}: {e.status_code}, Retry-After: {e.response.headers.get('retry-after')!r}"
                  f", message {str(e.message)[:160]!r}")
            return
    raise SystemExit(f"{tenant}: {left + 1} more requests within the minute and no 429")


def main() -> None:
    from bench.lib.peer_vllm import self_check_args, shipped_engine, stream_once, vllm_serve
    from bench.lib.servers import model_dir

    a = self_check_args("LiteLLM's proxy before vllm serve: one streaming chat per tenant")
    t0 = time.monotonic()
    ensure_litellm()
    print(f"peer venv ready after {time.monotonic() - t0:.0f}s ({LITELLM})\n{LIMITS_NOTE}", flush=True)
    tenants = {"chat": {"tpm": 200_000, "rpm": 600}, "rag": {"tpm": 200_000, "rpm": 600},
               "bulk": {"tpm": 50_000, "rpm": 3}}
    logs = Path(tempfile.mkdtemp(prefix="llmd-peer-litellm-"))
    with vllm_serve(model_dir(a), a.name, shipped_engine(), logs / "vllm.log") as upstream, \
            litellm_proxy(upstream, a.name, tenants, logs / "litellm.log") as (url, keys):
        for tenant, key in keys.items():
            ttft, total, text = stream_once(url, a.name, key)
            print(f"  {tenant}: TTFT {ttft:.3f}s, total {total:.3f}s, text {text!r}")
        _over_limit(url, a.name, "bulk", keys["bulk"], tenants["bulk"]["rpm"] - 1)
        print(f"logs in {logs}")


if __name__ == "__main__":
    main()
