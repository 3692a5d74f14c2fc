"""The pure side of bench/cluster_registry.py: the registry changes it makes, which versions a
request may have run on while they travel."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.lib.streams import Stream


@dataclass
class Change:
    kind: str  # "split" or "rollback"
    node: str  # where it was made
    t0: float  # the admin call sent
    rev: int = 0
    split: dict[str, float] = field(default_factory=dict)  # the cluster split it made
    seen: dict[str, float] = field(default_factory=dict)  # node -> when its view first showed it
    fetch_s: list[float] = field(default_factory=list)  # signed snapshot GETs, timed after it

    def served(self) -> set[str]:
        return {v for v, w in self.split.items() if w > 0}


def plan(versions: list[str], n: int) -> list[tuple[str, int, dict[str, float] | None]]:
    """Splits and rollbacks alternating; a split and its rollback on different nodes, every node
    making both kinds. Some splits leave out the configured version, some share between two."""
    v1, v2, v3 = versions
    splits: list[dict[str, float]] = [{v2: 1}, {v3: 1}, {v1: 1, v2: 1}, {v3: 3, v1: 1}, {v2: 1, v3: 1}]
    return [("split", i % 3, splits[(i // 2) % len(splits)]) if i % 2 == 0 else ("rollback", (i + 1) % 3, None)
            for i in range(n)]


def check_versions(changes: list[Change], initial: set[str], sent: list[tuple[str, Stream, float]],
                   ) -> tuple[int, int, list[str]]:
    """Each finished request against the splits its node could have held while admitting it
    (between sending it and its first token): split k from the moment it was made until that
    node showed split k+1. Returns (requests checked, those admitted while a change was on its
    way to their node, the wrong ones)."""
    wrong, moving = [], 0
    for node, s, t_end in sent:
        if not s.ok:
            continue
        lo, hi = s.t_send, s.t_first or t_end
        allowed = set(initial) if not changes or lo <= changes[0].seen[node] else set()
        for k, c in enumerate(changes):
            until = changes[k + 1].seen[node] if k + 1 < len(changes) else float("inf")
            if c.t0 <= hi and until >= lo:
                allowed |= c.served()
            moving += c.t0 <= hi and c.seen[node] >= lo
        if s.version not in allowed:
            wrong.append(f"{node}: {s.version} at {lo:.2f}-{hi:.2f}, allowed {sorted(allowed)}")
    return sum(1 for _, s, _ in sent if s.ok), moving, wrong


def demoted(samples: list[tuple[float, int, bool]]) -> bool:
    """n2 was promoted, and is not any more."""
    return any(p for _, _, p in samples) and not samples[-1][2]
