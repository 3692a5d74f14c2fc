"""Preemption rules: which running sequences yield their seats this tick, and who takes them.

A preempted sequence is aborted, re-queued and later resumed from the tokens it already
has; that costs a re-prefill, which every running stream feels, so each rule is narrow.
The scheduler runs its rules in order, each seeing what the ones before it chose:

- `BatchOverCap`: batch sequences over their seat cap while interactive traffic is about;
- `OverSeatLimit`: sequences over a seat limit the ITL controller lowered (waiting for them
  to end would take a whole generation);
- `BatchForInteractive`: batch sequences, one per waiting interactive request;
- `FairShare`: the most over-share tenant's newest sequence, for a tenant below its fair share.

The last two act only when seats or KV are what a waiting request waits for, not the
engine's own queue (that drains by itself within a step). A victim's seat may go straight
to the request it was preempted for (its heir), without waiting for its abort.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from llmd.policy.classes import BATCH, INTERACTIVE, ClassQueue, ModelQueue
from llmd.policy.queue import QueuedRequest

Heir = Callable[[], QueuedRequest | None]  # pops the request that takes a victim's seat, if any is left


class SeatView(Protocol):
    """What preemption rules read from the scheduler (SchedulerCore satisfies it)."""

    @property
    def queue(self) -> ModelQueue: ...

    def holds(self, tenant: str) -> int:
        """Seats the tenant holds now."""

    def fair_share(self, limit: int) -> int:
        """Seats each active tenant is due out of `limit`."""

    def below_share(self, share: int) -> Callable[[str], bool]:
        """A predicate on tenants: holds fewer than `share` seats (when called)."""

    def batch_cap(self, limit: int) -> int:
        """Seats batch-class work may hold now."""

    def blocked_on_capacity(self, running: int) -> bool:
        """A waiting request waits for seats or KV (not the engine's queue) with `running` seated."""


@dataclass(init=False)
class PreemptionRound:
    """One tick's preemption decision as the rules build it (the __init__ written out:
    llmd.policy.placement.VersionLoad says why)."""

    seats: SeatView
    running: int  # sequences holding seats, those already asked to yield included
    limit: int  # the seat limit this tick
    pending: int  # asked to yield in an earlier tick, not gone yet
    live: list[QueuedRequest]  # running, preemptible and not asked to yield, in dispatch order
    waiting_interactive: int
    victims: list[QueuedRequest]
    heirs: list[Heir]
    prefer: Callable[[QueuedRequest], bool] | None  # heirs are chosen as the queue seats: on time first

    def __init__(self, seats: SeatView, running: int, limit: int, pending: int, live: list[QueuedRequest],
                 waiting_interactive: int, victims: list[QueuedRequest] | None = None,
                 heirs: list[Heir] | None = None, prefer: Callable[[QueuedRequest], bool] | None = None) -> None:
        self.seats = seats
        self.running = running
        self.limit = limit
        self.pending = pending
        self.live = live
        self.waiting_interactive = waiting_interactive
        self.victims = [] if victims is None else victims
        self.heirs = [] if heirs is None else heirs
        self.prefer = prefer

    def untaken(self) -> list[QueuedRequest]:
        """Live sequences no rule has chosen yet."""
        taken = set(map(id, self.victims))
        return [t for t in self.live if id(t) not in taken]

    def blocked(self) -> bool:
        """Seats or KV are full even after this round's victims leave."""
        return self.seats.blocked_on_capacity(self.running - len(self.victims))

    def interactive_heir(self) -> Heir:
        queue, prefer = self.seats.queue.classes[INTERACTIVE], self.prefer
        return lambda: queue.pop_next(None, prefer)


class PreemptionRule(Protocol):
    def choose(self, r: PreemptionRound) -> None:
        """Add victims (and heirs for them) to the round."""


def _newest_batch(seqs: Iterable[QueuedRequest]) -> list[QueuedRequest]:
    return sorted((t for t in seqs if t.klass == BATCH), key=lambda t: -t.seq)


class BatchOverCap:
    """Batch sequences beyond their cap while interactive traffic is about, newest first:
    every sequence in a step lengthens it, so batch work that merely shares the engine
    still delays interactive tokens. Waiting interactive requests inherit the seats."""

    def choose(self, r: PreemptionRound) -> None:
        held = sum(1 for t in r.live if t.klass == BATCH)
        over = held - r.seats.batch_cap(r.limit)  # asked every tick: the cap notes interactive traffic
        if over <= 0:
            return  # the usual tick: nothing over the cap, nothing to sort
        chosen = _newest_batch(r.live)[:over]
        r.victims += chosen
        r.heirs += [r.interactive_heir()] * min(len(chosen), r.waiting_interactive)


class OverSeatLimit:
    """Sequences over a seat limit the ITL controller lowered: batch before interactive, then
    the tenant holding the most seats, then its newest sequence. No heirs: the limit itself
    asked for fewer sequences."""

    def choose(self, r: PreemptionRound) -> None:
        excess = r.running - r.pending - len(r.victims) - r.limit
        if excess <= 0:
            return
        rest = r.untaken()
        rest.sort(key=lambda t: (t.klass == BATCH, r.seats.holds(t.tenant), t.seq), reverse=True)
        r.victims += rest[:excess]


class BatchForInteractive:
    """With the seats (or KV) full: the newest batch sequences, one for each waiting
    interactive request not already served by a victim; each seat goes to one of them."""

    def choose(self, r: PreemptionRound) -> None:
        if not r.blocked():
            return
        need = r.waiting_interactive - r.pending - len(r.heirs)
        if need <= 0:
            return
        victims = _newest_batch(r.untaken())[:need]
        r.victims += victims
        r.heirs += [r.interactive_heir()] * len(victims)


class FairShare:
    """With the seats (or KV) full and a tenant below its fair share of seats waiting: the
    most over-share tenant's newest sequence (batch first), its seat to an under-share
    tenant. One at a time, and only when no other preemption is under way: each costs a
    re-prefill, which every running stream feels."""

    def choose(self, r: PreemptionRound) -> None:
        if r.pending or r.heirs or not r.blocked():
            return
        seats = r.seats
        share = seats.fair_share(r.limit)
        # A waiting batch request may not have the seat while batch work is capped: BatchOverCap
        # would take it back next tick, and the two would trade the seat, a re-prefill each time.
        batch_held = sum(1 for t in r.untaken() if t.klass == BATCH)
        queue: ModelQueue | ClassQueue = seats.queue
        heads = list(seats.queue.heads())
        if batch_held >= seats.batch_cap(r.limit):
            queue = seats.queue.classes[INTERACTIVE]
            heads = list(queue.heads().values())
        if not any(seats.holds(q.tenant) < share for q in heads):
            return
        victim = most_over_share(seats, r.untaken(), share)
        if victim is not None:
            r.victims.append(victim)
            r.heirs.append(lambda: queue.pop_next(seats.below_share(share), r.prefer))


def most_over_share(seats: SeatView, live: list[QueuedRequest], share: int) -> QueuedRequest | None:
    cands = [t for t in live if seats.holds(t.tenant) > share]
    if not cands:
        return None
    # Batch before interactive, then the tenant holding the most seats, then its newest sequence.
    return max(cands, key=lambda t: (t.klass == BATCH, seats.holds(t.tenant), t.seq))


def preemption_rules(preempt_batch: bool = True, preempt_for_fairness: bool = True) -> list[PreemptionRule]:
    """The rules the config asks for, in the order they must run. OverSeatLimit always runs:
    a lowered limit is reached by preemption whatever else is enabled."""
    rules: list[PreemptionRule] = []
    if preempt_batch:
        rules.append(BatchOverCap())
    rules.append(OverSeatLimit())
    if preempt_batch:
        rules.append(BatchForInteractive())
    if preempt_for_fairness:
        rules.append(FairShare())
    return rules
