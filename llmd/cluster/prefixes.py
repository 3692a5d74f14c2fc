"""What each node's KV cache holds, as chained block hashes that peers can route by.

A prompt is cut into blocks of `block_tokens` tokens (the cluster's summary block: a multiple
of the engine's block, 64 by default); block i's hash covers every token up to the end of block
i, so two prompts share a hash only while they share the whole prefix, and the longest cached
prefix is the longest run of held hashes from the start. Hashes are 64-bit blake2b keyed from
the cluster secret: gossip is signed, not encrypted, and an unkeyed hash would let anyone who
sees it test whether a guessed prompt (a tenant's system prompt) is cached somewhere.

`PrefixIndex` is this node's view of its own cache, LRU-bounded to `capacity_blocks`. Every
change batch (at most `BATCH_MAX` hashes added or removed) advances `seq`; a peer keeps a
`PeerPrefixes` in step from pushed deltas. A delta carries the net effect of the batches in
(from, to], so a peer at any seq in [from, to] can apply it (repeats and overlaps are harmless);
one that is behind `from`, or knows another epoch (the node restarted), has a gap and loads a
`snapshot()` instead. Deltas are bounded by the caller's byte limit: what does not fit waits.

Wire formats (little-endian, 8 B per hash):
  delta    = epoch u32, from u64, span u32 (to - from), n_added u16, n_removed u16, added, removed
  snapshot = epoch u32, seq u64, count u32, hashes (least recently used first)
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

DEFAULT_BLOCK_TOKENS = 64
HASH_BYTES = 8
BATCH_MAX = 32  # hashes per change batch (one seq step)
_DELTA = struct.Struct("<IQIHH")
_SNAPSHOT = struct.Struct("<IQI")
MIN_DELTA_BYTES = _DELTA.size + BATCH_MAX * HASH_BYTES  # the smallest limit that always makes progress


def prefix_key(secret: bytes) -> bytes:
    """The hashing key every node derives from the cluster secret (the first one, which signs):
    during a rotation nodes may disagree for a while, which costs affinity, never correctness."""
    return hmac.new(secret, b"llmd-cluster/prefixes", hashlib.sha256).digest()


def chain_hashes(token_ids: Sequence[int], block_tokens: int, key: bytes) -> list[int]:
    """One 64-bit hash per full block of `block_tokens` tokens, each covering the whole prefix
    up to the end of its block (a partial last block has none)."""
    out: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_tokens):
        parent = next_hash(parent, token_ids[i * block_tokens:(i + 1) * block_tokens], key)
        out.append(parent)
    return out


def next_hash(parent: int | None, block: Sequence[int], key: bytes) -> int:
    """The hash after `parent` for one more block: what `chain_hashes` computes step by step."""
    head = b"" if parent is None else parent.to_bytes(HASH_BYTES, "little")
    digest = hashlib.blake2b(head + struct.pack(f"<{len(block)}I", *block), digest_size=HASH_BYTES, key=key)
    return int.from_bytes(digest.digest(), "little")


def held_tokens(held: dict[int, None], hashes: Sequence[int], block_tokens: int) -> int:
    """The longest prefix of `hashes` that `held` holds, in tokens."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n * block_tokens


class PrefixIndex:
    """This node's cache, approximately: the block hashes it holds, least recently used first."""

    def __init__(self, capacity_blocks: int, block_tokens: int, key: bytes, *, history_changes: int | None = None,
                 epoch: int | None = None) -> None:
        if capacity_blocks <= 0 or block_tokens <= 0:
            raise ValueError("capacity_blocks and block_tokens must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._key = key
        self.epoch = secrets.randbits(32) if epoch is None else epoch  # new on every start: peers resync
        self.seq = 0
        self._held: OrderedDict[int, None] = OrderedDict()
        self._log: deque[list[tuple[int, bool]]] = deque()  # batch seq base+1+i at index i
        self._base = 0  # the oldest seq a delta can start from
        self._log_changes = 0
        self._history = max(history_changes or capacity_blocks, BATCH_MAX)

    def __len__(self) -> int:
        return len(self._held)

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return chain_hashes(token_ids, self.block_tokens, self._key)

    def add(self, hashes: Iterable[int]) -> None:
        """Insert or touch. A chain is touched from its end back, so its head ends up the most
        recently used: eviction then takes tails first and a prefix stays usable longest."""
        changes: list[tuple[int, bool]] = []
        for h in reversed(list(hashes)):
            if h in self._held:
                self._held.move_to_end(h)
                continue
            self._held[h] = None
            changes.append((h, True))
            if len(self._held) > self.capacity_blocks:
                changes.append((self._held.popitem(last=False)[0], False))
        self._record(changes)

    def remove(self, hashes: Iterable[int]) -> None:
        changes: list[tuple[int, bool]] = []
        for h in dict.fromkeys(hashes):
            if h in self._held:
                del self._held[h]
                changes.append((h, False))
        self._record(changes)

    def clear(self) -> None:
        """The engine's cache is gone (it stopped or died)."""
        self.remove(list(self._held))

    def cached_tokens(self, hashes: Sequence[int]) -> int:
        """The longest held prefix, in tokens (a lookup does not count as a use)."""
        return held_tokens(self._held, hashes, self.block_tokens)

    def correct(self, hashes: Sequence[int], engine_cached_tokens: int) -> None:
        """The engine found only `engine_cached_tokens` of a prompt whose blocks are `hashes`:
        drop the blocks past that. For an index kept from served prompts (no KV events); one kept
        from the engine's events is exact, and by the time the count arrives it already holds
        the blocks this very prompt stored."""
        self.remove(hashes[engine_cached_tokens // self.block_tokens:])

    # -- what peers get ----------------------------------------------------------------------
    def delta(self, since: int, limit_bytes: int) -> bytes | None:
        """The net change from `since` up to as far as fits in `limit_bytes`; None: `since` is
        older than the history kept (or not this index's), so the peer needs a snapshot."""
        if limit_bytes < MIN_DELTA_BYTES:
            raise ValueError(f"a delta needs at least {MIN_DELTA_BYTES} bytes to make progress")
        if not self._base <= since <= self.seq:
            return None
        room = min((limit_bytes - _DELTA.size) // HASH_BYTES, 0xFFFF)
        net: dict[int, bool] = {}
        to = since
        for batch in itertools.islice(self._log, since - self._base, None):
            if len(net) + len({h for h, _ in batch if h not in net}) > room:
                break  # the rest waits for the next push
            net.update(batch)
            to += 1
        added = [h for h, present in net.items() if present]
        removed = [h for h, present in net.items() if not present]
        return _DELTA.pack(self.epoch, since, to - since, len(added), len(removed)) + _pack(added + removed)

    def snapshot(self) -> bytes:
        return _SNAPSHOT.pack(self.epoch, self.seq, len(self._held)) + _pack(list(self._held))

    def _record(self, changes: list[tuple[int, bool]]) -> None:
        for i in range(0, len(changes), BATCH_MAX):
            batch = changes[i:i + BATCH_MAX]
            self.seq += 1
            self._log.append(batch)
            self._log_changes += len(batch)
        while self._log_changes > self._history:
            self._log_changes -= len(self._log.popleft())
            self._base += 1


def feeder(index: PrefixIndex) -> Callable[[str, list[int]], None]:
    """A `KvChains` listener (llmd/backends/kv_chains.py) keeping `index` as the engine's KV
    events say: what it stored, what it evicted, a cleared cache."""
    def feed(kind: str, hashes: list[int]) -> None:
        if kind == "stored":
            index.add(hashes)
        elif kind == "removed":
            index.remove(hashes)
        else:
            index.clear()
    return feed


def delta_end(delta: bytes) -> int:
    """The seq a delta brings a peer to."""
    _, since, span, _, _ = _DELTA.unpack_from(delta)
    return int(since + span)


class PeerPrefixes:
    """One peer's index as this node knows it, from its snapshot and the deltas since."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_blocks: int = 1 << 20) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks  # a bound on memory whatever a peer sends
        self.seq = 0
        self.epoch: int | None = None
        self._held: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, delta: bytes) -> bool:
        """Bring this view up to the delta's `to`. False: a gap (it starts past what this view
        has, or the peer restarted): load a snapshot. Raises ValueError on a malformed delta."""
        if len(delta) < _DELTA.size:
            raise ValueError("prefix delta too short")
        epoch, since, span, n_added, n_removed = _DELTA.unpack_from(delta)
        hashes = _unpack(delta, _DELTA.size, n_added + n_removed)
        if epoch != self.epoch:
            if self.epoch is not None or since != 0:
                return False
            self.epoch = epoch
        if since + span <= self.seq:
            return True  # nothing newer than what is held
        if since > self.seq:
            return False
        for h in hashes[n_added:]:
            self._held.pop(h, None)
        for h in hashes[:n_added]:
            self._held[h] = None
        self._trim()
        self.seq = since + span
        return True

    def load(self, snapshot: bytes) -> None:
        if len(snapshot) < _SNAPSHOT.size:
            raise ValueError("prefix snapshot too short")
        epoch, seq, count = _SNAPSHOT.unpack_from(snapshot)
        self._held = dict.fromkeys(_unpack(snapshot, _SNAPSHOT.size, count))
        self.epoch, self.seq = epoch, seq
        self._trim()

    def cached_tokens(self, hashes: Sequence[int]) -> int:
        return held_tokens(self._held, hashes, self.block_tokens)

    def _trim(self) -> None:
        while len(self._held) > self.max_blocks:
            del self._held[next(iter(self._held))]


def _pack(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def _unpack(data: bytes, offset: int, count: int) -> list[int]:
    if len(data) != offset + count * HASH_BYTES:
        raise ValueError(f"prefix summary of {len(data)} bytes does not hold the {count} hashes it says")
    return list(struct.unpack_from(f"<{count}Q", data, offset))
