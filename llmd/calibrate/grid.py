"""The calibration grid: which engine steps `llmd plan calibrate` makes the engine take.

Three kinds of grid point, each one configuration whose steps all cost about the same:
- decode: B sequences decoding at context ≈ P (B × P spans batch 1..64, context 64..2049);
- prefill: one prompt chunk of C tokens after K tokens already in the KV cache (C 16..2048);
- mixed: C prompt tokens computed in the same step as B sequences decoding at context P.
Contexts are 128·m + 1 tokens where they exceed a block, so a warmed prefix covers all but one
token of each prompt and B sequences at context P cost one prefill, not B (vLLM's CPU blocks
are 128 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    kind: str  # "decode" | "prefill" | "mixed"
    batch: int = 0  # sequences decoding in each measured step
    context: int = 0  # their prompt length (decode, mixed); tokens cached before the chunk (prefill)
    chunk: int = 0  # prompt tokens computed in each measured step (prefill, mixed)

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} ctx={self.context}"
        if self.kind == "prefill":
            return f"prefill chunk={self.chunk} before={self.context}"
        return f"mixed B={self.batch} ctx={self.context} chunk={self.chunk}"


@dataclass(frozen=True)
class Grid:
    name: str
    points: tuple[Point, ...]
    decode_steps: int  # max_tokens of a decode point's sequences (about that many measured steps)
    repeats: int  # measured prefill steps per prefill or mixed point

    def longest(self) -> int:
        """The longest sequence the grid makes (the engine's max_model_len must hold it)."""
        return max(max(p.context + p.chunk + 1, p.context + self.decode_steps + 1) for p in self.points)


def _grid(name: str, batches: tuple[int, ...], contexts: tuple[int, ...], chunks: tuple[int, ...],
          befores: tuple[int, ...], mixed: tuple[tuple[int, int, int], ...], steps: int, repeats: int) -> Grid:
    pts = [Point("decode", b, c) for c in contexts for b in batches]
    pts += [Point("prefill", 0, k, c) for k in befores for c in chunks]
    pts += [Point("mixed", b, p, c) for b, p, c in mixed]
    return Grid(name, tuple(pts), steps, repeats)


FULL = _grid("full", (1, 2, 4, 8, 16, 32, 64), (64, 257, 1025, 2049), (16, 64, 256, 512, 1024, 2048), (0, 1024),
             tuple((b, p, c) for b in (4, 16, 64) for p in (257, 1025) for c in (64, 512, 2048)),
             steps=16, repeats=3)
QUICK = _grid("quick", (1, 8, 32), (64, 1025), (64, 512), (0,), ((8, 257, 256), (32, 257, 64)),
              steps=8, repeats=2)
GRIDS = {"full": FULL, "quick": QUICK}
