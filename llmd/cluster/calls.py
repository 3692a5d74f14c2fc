"""Signed GETs of a peer's internal routes (registry, prefix snapshots), their answers checked.

A call names the node it is for, and the answer must be signed by that node for that very call:
a captured answer replayed to another call, or one from another node, is refused.
"""

from __future__ import annotations

from typing import Any

import httpx

from llmd.cluster.signing import HEADER_NONCE, Signer


async def signed_get(signer: Signer, client: httpx.AsyncClient, node: str, url: str, path: str,
                     timeout: float = 5.0) -> httpx.Response:
    """GET `path` at the peer `node` serving at `url`; raises httpx.HTTPError on a failed call
    and ValueError unless the answer is signed by `node` for this call."""
    headers = signer.headers("GET", path, to=node)
    r = await client.get(url.rstrip("/") + path, headers=headers, timeout=timeout)
    r.raise_for_status()
    if signer.verify("RESPONSE", path, r.headers, r.content, reply_to=headers[HEADER_NONCE], sender=node) is None:
        raise ValueError(f"{node}'s answer to {path} is not signed for this call")
    return r


async def registry_snapshot(signer: Signer, client: httpx.AsyncClient, node: str, url: str) -> dict[str, Any]:
    """The registry the peer `node` serves (`/internal/v1/registry`), signed for this call."""
    data = (await signed_get(signer, client, node, url, "/internal/v1/registry")).json()
    if not isinstance(data, dict):
        raise ValueError("not a registry snapshot")
    return data
