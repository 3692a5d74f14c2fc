"""The updates a SWIM node has to spread, each retransmitted a bounded number of times (as
memberlist's transmit-limited queue): piggybacked on every outgoing message, the least-sent
first, those about the message's recipient before all others, within a byte budget."""

from __future__ import annotations

from typing import Any

UPDATE_BUDGET = 700  # bytes of piggybacked updates per message (JSON), so a datagram stays small


class Broadcasts:
    def __init__(self) -> None:
        self._queue: dict[str, list[Any]] = {}  # member -> [its newest update, transmissions left]

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __contains__(self, name: object) -> bool:
        return name in self._queue

    def put(self, update: dict[str, Any], transmits: int) -> None:
        """Queue `update` (it replaces any older one about the same member)."""
        self._queue[update["n"]] = [update, transmits]

    def take(self, to: str | None, first: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The updates for one message to `to`, after `first`; each taken one is counted."""
        picked, size = list(first), 60 * len(first)
        for name, entry in sorted(self._queue.items(), key=lambda kv: (kv[0] != to, -kv[1][1])):
            cost = len(str(entry[0])) + 2
            if size + cost > UPDATE_BUDGET:
                break
            picked.append(entry[0])
            size += cost
            entry[1] -= 1
            if entry[1] <= 0:
                del self._queue[name]
        return picked
