"""Rendezvous hashing: which node a prefix or a conversation belongs to when nothing else says.

Every ingress that sees the same nodes computes the same answer without sharing state, and a
node joining or leaving moves only the keys that are or become its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Final

HOME_BLOCKS: Final = 8  # a prompt's home is drawn from the hash of its first 8 summary blocks (512 tokens)


def home_ranks(key: int, nodes: Iterable[str]) -> dict[str, int]:
    """The order in which the nodes are a prefix's (`key`: a hash of its first blocks) home, 0
    first: rendezvous hashing, so every ingress that sees the same nodes orders them the same,
    and a node joining or leaving moves only the prefixes whose home it is or was."""
    def weight(node: str) -> bytes:
        return hashlib.blake2b(key.to_bytes(8, "little", signed=False) + node.encode(), digest_size=8).digest()

    return {node: i for i, node in enumerate(sorted(set(nodes), key=weight, reverse=True))}


def conversation_node(key: str, nodes: Iterable[str]) -> str | None:
    """The node a conversation (its `user` or X-Conversation-Id) runs on when nothing else says
    where: rendezvous hashing of its key over the nodes, so every ingress names the same node
    without sharing any state, and a node joining or leaving moves only the conversations that
    are or become its own. None when there is no node."""
    def weight(node: str) -> bytes:
        return hashlib.blake2b(key.encode() + b"\0" + node.encode(), digest_size=8, person=b"llmd-conv").digest()

    return max(set(nodes), key=weight, default=None)


def home_key(block_hashes: Sequence[int]) -> int | None:
    """The hash a prompt's home is drawn from: its chain hash after HOME_BLOCKS blocks (covering
    them all), or its last block's when shorter; None when it has no full block."""
    return block_hashes[min(len(block_hashes), HOME_BLOCKS) - 1] if block_hashes else None
