"""Reservations against stale views: what a router sent a node that the node's gossip does not
show yet. Pure: the clock is injected."""

from __future__ import annotations

from collections.abc import Callable


class Reservations:
    """Tokens sent to a node that its gossip has not reflected yet (stale views, herding).

    A reservation ends after `ttl_s`, or once a state from the node newer than the last one
    seen when it was made arrives (that state counts the request in its own queue)."""

    def __init__(self, clock: Callable[[], float], ttl_s: float) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self._last_seq: dict[str, int] = {}
        self._held: dict[str, list[tuple[float, int, int]]] = {}  # node -> [(expiry, seq seen then, tokens)]

    def add(self, node: str, tokens: int) -> None:
        if tokens > 0:
            self._held.setdefault(node, []).append((self._clock() + self.ttl_s, self._last_seq.get(node, -1), tokens))

    def of(self, node: str) -> int:
        held = self._held.get(node)
        if not held:
            return 0
        now = self._clock()
        held[:] = [r for r in held if r[0] > now]
        return sum(r[2] for r in held)

    def seen(self, node: str, state_seq: int) -> None:
        """A state from `node` arrived: the reservations made before the previous one was seen
        are in it. The latest arrival wins (a restarted node counts from 0 again)."""
        self._last_seq[node] = state_seq
        held = self._held.get(node)
        if held:
            held[:] = [r for r in held if r[1] >= state_seq]

    def release(self, node: str, tokens: int) -> None:
        """The request behind a reservation of `tokens` has had its prefill (its first token
        came): the node's queue no longer holds them, whatever its gossip says yet."""
        held = self._held.get(node)
        if held:
            for i, r in enumerate(held):
                if r[2] == tokens:
                    del held[i]
                    return

    def forget(self, node: str) -> None:
        """The node left or died."""
        self._held.pop(node, None)
        self._last_seq.pop(node, None)
