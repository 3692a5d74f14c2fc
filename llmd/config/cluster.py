"""`[cluster]`: how a node finds its peers, proves it is one of them, and routes between them.

Off by default: one node serves alone, exactly as before. docs/cluster.md has the design and
what each number trades."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from llmd.config.parts import _Strict

SECRET_ENV = "LLMD_CLUSTER_SECRET"  # the current secret, when no secret_files are given
MIN_SECRET_BYTES = 16


class WarmPoolConfig(_Strict):
    """A standby version (loaded, asleep) is promoted into the split when the cluster's queue or
    TTFT crosses a bound, and put back slowly once both are calm."""

    promote_queue_tokens: Annotated[int, Field(gt=0)] | None = None  # waiting prefill tokens, cluster-wide
    promote_ttft_s: Annotated[float, Field(gt=0)] | None = None  # the cluster's recent TTFT p90
    sustain_s: Annotated[float, Field(ge=0)] = 5.0  # over a bound this long: promote
    demote_after_s: Annotated[float, Field(ge=0)] = 300.0  # calm this long: back to standby


class ClusterConfig(_Strict):
    enabled: bool = False
    # Gossip (UDP): where this node listens, and where it finds the others at start.
    gossip_host: str = "127.0.0.1"
    gossip_port: Annotated[int, Field(ge=0, le=65535)] = 7946
    seeds: list[str] = Field(default_factory=list)  # "host:port" of other nodes' gossip
    # The base URL peers use for this node's internal HTTP (default: http(s)://server.host:server.port).
    advertise_url: str | None = None
    # The shared secret(s): the first is current (it signs once every peer holds it), every one
    # verifies. Files hold the secret as text; without files, $LLMD_CLUSTER_SECRET is the one
    # secret. `llmd reload` re-reads them: a secret replaced there is still accepted for
    # rotation_window_s, then refused (docs/cluster.md, "Rotating the secret").
    secret_files: list[Path] = Field(default_factory=list, max_length=2)
    rotation_window_s: Annotated[float, Field(gt=0)] = 900.0
    # Peers' HTTPS certificates are verified against the system's CAs, or this bundle (a private CA).
    ca_file: Path | None = None
    replay_window_s: Annotated[float, Field(gt=0)] = 5.0
    # "cluster": any node may run a request on any node; "local": this node runs what it
    # receives (an external router such as llm-d's endpoint picker chooses the node).
    routing: Literal["cluster", "local"] = "cluster"
    # How a node is chosen: "score" (the lowest estimated time to first token from queue, cache
    # and prefill rate, weighted by occupancy) or "round_robin" (the peer bench/cluster.py runs beside it).
    placement: Literal["score", "round_robin"] = "score"
    # With "score": send each repeated prompt prefix to its balanced homes and keep it there
    # (llmd/policy/homes.py; docs/cluster.md, "Balanced homes"). Nodes gossip their busiest
    # prefixes' traffic (~200 bytes every 4 s). False: never bind homes (the score alone places).
    balanced_homes: bool = True
    # When homes bind: "always", or "congested" (only once the cluster has queued prefill for a
    # while, smoothed over ~5 s; below that the score alone places prompts, and each node's
    # cache then evicts the chats' histories under prompts it was dealt unevenly: bench (a14)).
    homes_bind: Literal["always", "congested"] = "always"
    # SWIM: probe one member per interval; no ack within the timeout: ask `indirect_probes`
    # others to probe it; still nothing: suspect; not refuted within suspicion_s: dead.
    probe_interval_s: Annotated[float, Field(gt=0)] = 0.5
    probe_timeout_s: Annotated[float, Field(gt=0)] = 0.25
    indirect_probes: Annotated[int, Field(ge=0)] = 2
    suspicion_s: Annotated[float, Field(gt=0)] = 1.5
    # A node's load is pushed to every peer at most every load_interval_s (when it changed),
    # at least every load_heartbeat_s.
    load_interval_s: Annotated[float, Field(gt=0)] = 0.25
    load_heartbeat_s: Annotated[float, Field(gt=0)] = 1.0
    # Routing: a forwarded request is resumed elsewhere at most this many times.
    max_failovers: Annotated[int, Field(ge=0)] = 2
    warm_pool: WarmPoolConfig = Field(default_factory=WarmPoolConfig)

    @field_validator("seeds")
    @classmethod
    def _addresses(cls, seeds: list[str]) -> list[str]:
        for s in seeds:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"seed {s!r} is not host:port")
        return seeds

    @field_validator("secret_files")
    @classmethod
    def _readable(cls, files: list[Path]) -> list[Path]:
        for p in files:
            if not p.is_file():
                raise ValueError(f"{p}: no such file")
            if len(p.read_bytes().strip()) < MIN_SECRET_BYTES:
                raise ValueError(f"{p}: a cluster secret needs at least {MIN_SECRET_BYTES} bytes")
        return files

    @field_validator("ca_file")
    @classmethod
    def _ca(cls, p: Path | None) -> Path | None:
        if p is not None and not p.is_file():
            raise ValueError(f"{p}: no such file")
        return p

    @model_validator(mode="after")
    def _timing(self) -> ClusterConfig:
        if self.probe_timeout_s >= self.probe_interval_s:
            raise ValueError("probe_timeout_s must be less than probe_interval_s")
        if self.rotation_window_s <= self.replay_window_s:  # a call signed just before the switch still lands
            raise ValueError(f"rotation_window_s ({self.rotation_window_s:g}) must be longer than "
                             f"replay_window_s ({self.replay_window_s:g})")
        if self.enabled and not self.secret_files and len(os.environ.get(SECRET_ENV, "").encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster needs a shared secret: set secret_files, or ${SECRET_ENV} "
                             f"(at least {MIN_SECRET_BYTES} bytes)")
        return self

    def secrets(self) -> list[bytes]:
        """The secrets, the signing one first."""
        if self.secret_files:
            return [p.read_bytes().strip() for p in self.secret_files]
        return [os.environ[SECRET_ENV].encode()] if os.environ.get(SECRET_ENV) else []
