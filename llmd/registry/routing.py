"""Routing rules, pure: a weighted split across a model's versions, sticky per conversation,
and pinning to an exact version with `model@version`.

A conversation key (a conversation id header, else the `user` field) hashes to a point in
[0, 1); the split lays its versions out on that interval in a fixed order, so a conversation
stays on one version while the split is unchanged, and a change of weights moves only the
conversations whose point falls in the part of the interval that changed hands.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field


class RoutingError(Exception):
    """A pin names no loaded version, or names several; or a model has no version in rotation."""


class NotServedHere(RoutingError):
    """The split picked a version this node does not serve (in a cluster, a peer does)."""

    def __init__(self, model: str, version: str) -> None:
        super().__init__(f"model {model!r}: version {version[:12]} of its split is not served on this node")
        self.model, self.version = model, version


def unit_point(key: str) -> float:
    """A stable point in [0, 1) for `key` (the same on every node and after every restart)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


@dataclass(frozen=True)
class Split:
    """Versions in rotation with their weights (> 0), in a fixed (sorted) order."""

    weights: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, weights: Mapping[str, float]) -> Split:
        bad = {v: w for v, w in weights.items() if not isinstance(w, (int, float)) or w < 0}
        if bad:
            raise ValueError(f"split weights must be numbers >= 0, got {bad}")
        kept = tuple(sorted((v, float(w)) for v, w in weights.items() if w > 0))
        if not kept:
            raise ValueError("a split needs at least one version with a weight above 0")
        return cls(kept)

    def as_dict(self) -> dict[str, float]:
        return dict(self.weights)

    def shares(self) -> dict[str, float]:
        total = sum(w for _, w in self.weights)
        return {v: w / total for v, w in self.weights}

    def pick(self, point: float) -> str:
        edge = 0.0
        for version, share in self.shares().items():
            edge += share
            if point < edge:
                return version
        return self.weights[-1][0]  # rounding at the top edge


@dataclass(frozen=True)
class RoutingView:
    """One immutable snapshot of every model's routing; a change builds a new one and swaps
    it in with one assignment, so a request sees either the old rules or the new, never a mix."""

    splits: Mapping[str, Split] = field(default_factory=dict)
    loaded: Mapping[str, frozenset[str]] = field(default_factory=dict)  # pinnable versions per model
    # Versions of a split not served here (a cluster split naming a version this node lacks):
    # their part of [0, 1) stays theirs, so a conversation there is refused, never sent to other
    # weights (the cluster router sends it to a node that holds its version).
    absent: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def route(self, model: str, key: str | None = None, pin: str | None = None) -> str:
        """The version id for a request to `model` (a pin is a version id or a unique prefix)."""
        if pin is not None:
            found = [v for v in self.loaded.get(model, ()) if v.startswith(pin)]
            if len(found) != 1:
                raise RoutingError(f"model {model!r} has {'no' if not found else 'more than one'} loaded "
                                   f"version matching {pin!r}")
            return found[0]
        split = self.splits.get(model)
        if split is None:
            raise RoutingError(f"model {model!r} has no version in rotation")
        absent = self.absent.get(model, frozenset())
        if not key and absent and (here := {v: w for v, w in split.weights if v not in absent}):
            split = Split.of(here)  # no conversation to keep on one version: draw among those served here
        version = split.pick(unit_point(key) if key else unit_point(uuid.uuid4().hex))
        if version in absent:
            raise NotServedHere(model, version)
        return version


def parse_model(name: str) -> tuple[str, str | None]:
    """'model@version' -> ('model', 'version'); 'model' -> ('model', None)."""
    model, sep, pin = name.partition("@")
    return model, (pin or None) if sep else None
