"""When a node without KV room now could start a request: its running sequences make room.

Placement (llmd/policy/placement.py) weighs that wait against a node with room now, which may
have to prefill the whole prompt.
"""

from __future__ import annotations

import math


def room_wait_s(running: int, running_tokens: int, decode_tps: float, deficit: int, expected_output: int) -> float:
    """About how long until a node's `running` sequences (`running_tokens` in all, decoding
    `decode_tps` together) free `deficit` more KV tokens: they end spread
    over one answer's decode (`expected_output` tokens at the node's per-sequence rate), each
    freeing a mean sequence's tokens. 0 with room now; inf when nothing running can make it.

    Why: at light load a conversation's node is often full for a moment (a few long chats fill a
    small cache), and a node with room would prefill the whole history again: waiting a step or
    two for room on the node that holds it is far cheaper."""
    if deficit <= 0:
        return 0.0
    if running <= 0 or running_tokens <= 0 or decode_tps <= 0:
        return math.inf
    ending = -(-deficit * running // running_tokens)  # sequences that must end: ceil
    return math.inf if ending > running else ending * max(1, expected_output) / decode_tps
