"""What one engine step computes, after vLLM v1's scheduler: the running sequences that decode
take a token each from the step's token budget (`max_num_batched_tokens`), then the sequences
still prefilling take chunks of their prompts, in the order they were admitted, from what is
left (and from the KV room, where the engine bounds it); the step that computes a prompt's last
chunk also samples its first token.

Shared by the fake backend (llmd/backends/fake.py, which sleeps the step) and the simulator's
engine (llmd/plan/sim/engine.py, which advances its clock by it), so the two compose their steps
the same way by construction and price them by the same StepShape. Pure: integers in, out.
"""

from __future__ import annotations

from collections.abc import Iterable


def prefill_chunks(decode_seqs: int, todo: Iterable[int], budget: int, kv_room: int | None = None) -> list[int]:
    """The prefill chunk of each prefilling sequence (`todo`: its prompt tokens still to compute,
    in admission order) in a step with `decode_seqs` decoding sequences and a token `budget`;
    the list stops at the first sequence that gets nothing (a later one never overtakes it)."""
    left = budget - decode_seqs
    room = kv_room
    out: list[int] = []
    for t in todo:
        c = min(t, left) if room is None else min(t, left, room)
        if c <= 0:
            break
        out.append(c)
        left -= c
        if room is not None:
            room -= c
    return out


def decode_context(prompt: int, generated: int) -> int:
    """KV tokens a decoding sequence attends over in its next step: its prompt and every token
    sampled so far (the last one's KV is written by this step)."""
    return prompt + generated


def chunk_attention(chunk: int, before: int) -> float:
    """A prefill chunk's attention work: each of its tokens attends over the `before` tokens
    already in KV and, on average, half the chunk (StepShape.prefill_attn's term)."""
    return chunk * (before + chunk / 2)
