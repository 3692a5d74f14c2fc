"""What a node tells the others (`NodeState`), in one datagram, and how a served version's
load is read off its runtime (`version_load`).

The encoding is binary: varints for counts, f32 for rates, length-prefixed UTF-8 for names,
and a hex string (a version id) packed to half its size. A state never exceeds
`MAX_STATE_BYTES`: what does not fit is left out in this order, never the versions: the
tenants (those sent rotate with `seq`, so each is sent within a few pushes; their counts are
cumulative, so a receiver keeps the latest it heard), then the prefix delta (whole or not at
all; the receiver sees `prefix_seq` move without it, a gap, and fetches a snapshot), then the
stored versions (rotating the same way). A malformed state raises `StateError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from llmd.backends.base import StepRecord
from llmd.policy.homes import Shared, from_level, level
from llmd.policy.placement import VersionLoad
from llmd.runtime import ModelRuntime

__all__ = ["MAX_STATE_BYTES", "NodeState", "StateError", "VersionLoad", "decode", "encode", "version_load"]

MAX_STATE_BYTES = 1200  # one datagram, with room for the signature under a 1400-byte MTU
_MAGIC = b"L\x02"  # 2: a version's tokenizer id after its rates
_U32 = 0xFFFFFFFF
_F32 = struct.Struct("<ff")
_U64 = struct.Struct("<Q")
_DRAINING, _STANDBY = 1, 2


class StateError(ValueError):
    """Bytes that are not a node state this version understands."""


@dataclass(frozen=True)
class NodeState:
    node: str
    http_url: str
    seq: int
    versions: tuple[VersionLoad, ...]
    prefix_seq: int
    prefix_delta: bytes  # recent prefix changes (may be empty)
    tenant_tokens: dict[str, int] = field(default_factory=dict)  # cumulative, here (quota across nodes)
    registry_rev: int = 0  # the newest registry change this node has applied
    stored: tuple[str, ...] = ()  # versions whose weights this node can serve to peers
    traffic: tuple[Shared, ...] = ()  # the prefixes this node routed most, for balanced homes (policy/homes.py)


# -- writing ------------------------------------------------------------------------------------
def _uint(n: int) -> bytes:
    n = max(0, int(n))
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _is_hex(s: str) -> bool:
    return len(s) % 2 == 0 and s == s.lower() and all(ch in "0123456789abcdef" for ch in s)


def _str(s: str) -> bytes:
    """Length-prefixed; the length's low bit says the text was lowercase hex, packed to bytes."""
    if s and _is_hex(s):
        raw = bytes.fromhex(s)
        return _uint(len(raw) << 1 | 1) + raw
    raw = s.encode()
    return _uint(len(raw) << 1) + raw


def _f32(x: float) -> float:
    return x if math.isfinite(x) and x >= 0 else 0.0


def _version(v: VersionLoad) -> bytes:
    flags = (_DRAINING if v.draining else 0) | (_STANDBY if v.standby else 0)
    ints = (v.kv_capacity_tokens, v.kv_free_tokens, v.running, v.running_tokens, v.waiting_prefill_tokens, flags)
    return (_str(v.model) + _str(v.version) + b"".join(_uint(i) for i in ints)
            + _F32.pack(min(_f32(v.prefill_tps), 3e38), min(_f32(v.decode_tps), 3e38)) + _str(v.tokenizer))


def _rotated(items: list[bytes], start: int, room: int) -> tuple[list[bytes], int]:
    """All of `items` when they fit in `room` bytes; else as many as fit, from `start` on, wrapping."""
    if sum(map(len, items)) <= room:
        return items, room - sum(map(len, items))
    out: list[bytes] = []
    for i in range(len(items)):
        item = items[(start + i) % len(items)]
        if len(item) > room:
            break
        out.append(item)
        room -= len(item)
    return out, room


def encode(s: NodeState) -> bytes:
    """At most `MAX_STATE_BYTES`; raises `StateError` only when the versions alone do not fit."""
    head = (_MAGIC + _str(s.node) + _str(s.http_url) + _uint(s.seq) + _uint(s.prefix_seq) + _uint(s.registry_rev)
            + _uint(len(s.versions)) + b"".join(_version(v) for v in s.versions))
    room = MAX_STATE_BYTES - len(head) - 3 * 4  # the four counts below: each under 2**21, 3 bytes at most
    if room < 0:
        raise StateError(f"node state of {len(s.versions)} versions is over {MAX_STATE_BYTES} bytes")
    stored, room = _rotated([_str(v) for v in s.stored], s.seq, room)
    delta = s.prefix_delta if len(s.prefix_delta) <= room else b""
    tenants, room = _rotated([_str(t) + _uint(n) for t, n in sorted(s.tenant_tokens.items())], s.seq,
                             room - len(delta))
    traffic = [_shared(e) for e in s.traffic]
    while traffic and sum(map(len, traffic)) > room:  # the least busy go first
        traffic.pop()
    return (head + _uint(len(stored)) + b"".join(stored) + _uint(len(delta)) + delta
            + _uint(len(tenants)) + b"".join(tenants) + _uint(len(traffic)) + b"".join(traffic))


def _shared(e: Shared) -> bytes:
    """A prefix's key, its requests and tokens a byte each (homes.level: the export's own grid),
    then its size: 12 bytes for most."""
    return _U64.pack(e.key & 0xFFFFFFFFFFFFFFFF) + bytes([level(e.requests), level(e.tokens)]) + _uint(e.size)


# -- reading ------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise StateError("node state is truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def uint(self) -> int:
        n = shift = 0
        while True:
            b = self.take(1)[0]
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                return n
            shift += 7
            if shift > 63:
                raise StateError("node state has an oversized number")

    def str(self) -> str:
        head = self.uint()
        raw = self.take(head >> 1)
        if head & 1:
            return raw.hex()
        try:
            return raw.decode()
        except UnicodeDecodeError as e:
            raise StateError("node state has a name that is not UTF-8") from e

    def count(self) -> range:
        return range(self.uint())  # bounded by the data: every item takes at least a byte


def _read_version(r: _Reader) -> VersionLoad:
    model, version = r.str(), r.str()
    cap, free, running, running_tokens, waiting, flags = (r.uint() for _ in range(6))
    prefill, decode_ = _F32.unpack(r.take(_F32.size))
    if not (math.isfinite(prefill) and math.isfinite(decode_) and prefill >= 0 and decode_ >= 0) or flags > 3:
        raise StateError("node state has an invalid rate or flag")
    return VersionLoad(model, version, cap, free, running, running_tokens, waiting, prefill, decode_,
                       draining=bool(flags & _DRAINING), standby=bool(flags & _STANDBY), tokenizer=r.str())


def decode(b: bytes) -> NodeState:
    if len(b) > MAX_STATE_BYTES or not b.startswith(_MAGIC):
        raise StateError("not a node state")
    r = _Reader(b)
    r.take(len(_MAGIC))
    node, url = r.str(), r.str()
    seq, prefix_seq, registry_rev = r.uint(), r.uint(), r.uint()
    versions = tuple(_read_version(r) for _ in r.count())
    stored = tuple(r.str() for _ in r.count())
    delta = r.take(r.uint())
    tenants = {r.str(): r.uint() for _ in r.count()}
    traffic = tuple(_read_shared(r) for _ in r.count())
    if r.pos != len(b):
        raise StateError("node state has trailing bytes")
    return NodeState(node, url, seq, versions, prefix_seq, delta, tenants, registry_rev, stored, traffic)


def _read_shared(r: _Reader) -> Shared:
    key, (requests, tokens) = _U64.unpack(r.take(_U64.size))[0], r.take(2)
    return Shared(key, from_level(requests), from_level(tokens), r.uint())


# -- a runtime's load ----------------------------------------------------------------------------
RATE_STEPS = 128  # the recent window the rates are measured over, in engine steps
_MAX_GAP_S = 1.0  # a step without its own duration: the time since the one before, unless idle between


def recent_rates(history: Sequence[StepRecord]) -> tuple[float, float]:
    """Prefill and decode tokens per second while busy, over the last `RATE_STEPS` steps that
    did either (0: none yet). A step's time is its own duration, or (vLLM reports none for a
    step with nothing decoding) the time since the step before when that is short."""
    recs = list(islice(reversed(history), RATE_STEPS + 1))[::-1]
    prefill = decode_ = 0
    p_time = d_time = 0.0
    prev_t: float | None = None
    for r in recs:
        gap, prev_t = (r.t - prev_t if prev_t is not None else 0.0), r.t
        dt = r.duration if r.duration > 0 else (gap if 0 < gap < _MAX_GAP_S else 0.0)
        if dt <= 0:
            continue
        if r.prefill_tokens > 0:
            prefill, p_time = prefill + r.prefill_tokens, p_time + dt
        if r.generated_tokens > 0:
            decode_, d_time = decode_ + r.generated_tokens, d_time + dt
    return (prefill / p_time if p_time else 0.0), (decode_ / d_time if d_time else 0.0)


def kv_capacity_tokens(backend: Any) -> int:
    """The engine's KV cache in tokens: what the backend says (`kv_capacity_tokens`), else the
    fake engine's block pool (`kv_blocks` x `block_tokens`), else max_num_seqs x max_model_len
    (the fake engine's own measure of usage before it had blocks; vLLM's worst case)."""
    cap = getattr(backend, "kv_capacity_tokens", None)
    if isinstance(cap, int) and cap > 0:
        return cap
    cfg = getattr(backend, "cfg", None)
    blocks, block_tokens = getattr(cfg, "kv_blocks", None), getattr(cfg, "block_tokens", None)
    if isinstance(blocks, int) and isinstance(block_tokens, int) and blocks > 0 and block_tokens > 0:
        return blocks * block_tokens
    seqs = getattr(cfg, "max_num_seqs", None)
    return max(1, (seqs if isinstance(seqs, int) else 1) * int(backend.max_model_len))


def version_load(rt: ModelRuntime, draining: bool = False, standby: bool = False) -> VersionLoad:
    """This node's load for one served version, in tokens, as of the engine's last step.

    Waiting prefill: the prompts in llmd's queue, plus those seated in the engine that it has
    not started (the engine reports how many; they are the most recently seated), or, where more,
    those seated that have no output yet: the engine's figures are as of its last step, and a
    long prefill step (a burst just seated on an idle node, a freshly promoted warm-pool one)
    would otherwise hide its prompts until it ends, while every peer sends its work there.
    When nothing is seated the engine's last-step figures are stale (it stopped stepping), so
    they read as idle.
    Counted as the prefill they will cost: the prompt tokens times the share the engine's prefix
    cache has not been serving (a node that serves its prompts mostly from cache is not as
    backed up as its raw queue says, and reading it raw drives work away from the cache)."""
    stats = rt.backend.stats
    cap = kv_capacity_tokens(rt.backend)
    seated = list(rt.scheduler.running.values())
    queued = sum(r.input_tokens for c in rt.queue.classes.values() for r in c)
    engine_waiting = min(stats.waiting, len(seated)) if seated else 0
    unstarted = sum(r.input_tokens for r in seated[len(seated) - engine_waiting:]) if engine_waiting else 0
    unstarted = max(unstarted, sum(r.input_tokens for r in seated if not r.started))
    used = min(cap, round(stats.kv_usage * cap)) if seated else 0
    prefill_tps, decode_tps = recent_rates(stats.history)
    return VersionLoad(model=rt.cfg.name, version=rt.version, kv_capacity_tokens=cap, kv_free_tokens=cap - used,
                       running=min(stats.running, len(seated)) if seated else 0, running_tokens=used,
                       waiting_prefill_tokens=round((queued + unstarted) * (1 - _hit_rate(stats))),
                       prefill_tps=prefill_tps, decode_tps=decode_tps,
                       draining=draining, standby=standby, tokenizer=rt.backend.tokenizer_id)


def _hit_rate(stats: Any) -> float:
    """The share of prompt tokens the engine's prefix cache has served so far."""
    q = getattr(stats, "prefix_queries", 0)
    return min(1.0, max(0.0, getattr(stats, "prefix_hits", 0) / q)) if q else 0.0
