"""The ingress's router: each choice of an admitted request runs on the node that will start it
soonest (policy/placement.py), here or on a peer, and is resumed elsewhere if that node fails.

This is the job runner a clustered node hands every Job (`Job.runner`), in place of running
on its own engine. The request was already authenticated, charged to its tenant's quota,
screened, rendered and counted here, and its ledger row opened here; whatever node runs it,
its tokens are counted here (`dispatch.account`) and its row closed here, once.

Failover: a node that fails (connection lost, declared dead, suspect and silent) before
sending anything: the choice runs elsewhere from the start. After sending tokens: it resumes
elsewhere from the prompt plus the tokens delivered (the same sampling, seed included). A
structured output cannot resume (its grammar would restart): streamed, it fails; not streamed
(`dispatch.held`: nothing of it has left) it runs again from the start. At most `max_failovers`
times; then, or when no node is left, the stream ends with the terminal `node_failed` error.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

from llmd import dispatch
from llmd.backends.base import Delta, Prompt, Sampling
from llmd.cluster.forward import Forwarder, PeerLost
from llmd.cluster.wire import RunRequest, encode_prompt_input, sampling_to_json
from llmd.errors import unavailable
from llmd.policy.placement import Candidate, RoutingPolicy
from llmd.policy.rendezvous import conversation_node
from llmd.runtime import Choice, Job
from llmd.telemetry import log

MAX_SESSIONS = 100_000  # conversations remembered for affinity (least recent forgotten; any ingress
# names the same node for one it does not remember: `conversation_node`)
NODE_HEADER = "X-LLMD-Node"  # the node that ran the request (the first one, for a stream that failed over)
Candidates = Callable[[Job, Prompt], list["Target"]]


@dataclass(frozen=True)
class Target:
    """A node that could run the choice: the policy's view of it, and where to reach it."""

    candidate: Candidate
    url: str | None  # None: this node


class Router:
    def __init__(self, node: str, candidates: Candidates, forwarder: Forwarder, policy: RoutingPolicy,
                 max_failovers: int, ran: Callable[[str, Prompt, int], None] | None = None) -> None:
        self.node = node
        self._candidates = candidates
        self._forwarder = forwarder
        self.policy = policy
        self.reservations = policy.reservations
        self.max_failovers = max_failovers
        self._ran = ran  # (node, prompt, cached tokens the engine reported): what caches now hold
        self.failovers = 0
        self._sessions: OrderedDict[str, str] = OrderedDict()  # conversation -> the node of its last turn
        self.placed: dict[str, int] = {}  # node -> choices placed there

    def pick(self, job: Job, prompt: Prompt, sampling: Sampling, excluded: set[str]) -> Target | None:
        targets = [t for t in self._candidates(job, prompt) if t.candidate.node not in excluded]
        last = self.conversation(job.affinity, [t.candidate for t in targets]) if job.affinity else None
        targets = [Target(replace(t.candidate, sticky=True), t.url) if t.candidate.node == last else t
                   for t in targets]
        chosen = self.policy.choose([t.candidate for t in targets], prompt.num_tokens, sampling.max_tokens)
        if chosen is None:
            return None
        target = next(t for t in targets if t.candidate.node == chosen.node)
        if job.affinity:  # the conversation's next turn prefers this node (its cache holds this turn)
            self._sessions[job.affinity] = chosen.node
            self._sessions.move_to_end(job.affinity)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self.placed[chosen.node] = self.placed.get(chosen.node, 0) + 1
        return target

    def conversation(self, key: str, cands: list[Candidate]) -> str | None:
        """The node this conversation's turn sticks to: the node of its last turn routed here,
        else the one every ingress names for it (`conversation_node`), so its turns meet on one
        node whichever ingress they enter; either only while no candidate caches more of this
        prompt than it does (then its history is elsewhere and the caches say where)."""
        held = {c.node: c.cached_tokens for c in cands}
        most = max(held.values(), default=0)
        ready = [c.node for c in cands if not (c.load.draining or c.load.standby)]
        for node in (self._sessions.get(key), conversation_node(key, ready)):
            if node is not None and node in held and held[node] >= most:
                return node
        return None

    async def run(self, job: Job, choice: Choice) -> AsyncGenerator[Delta, None]:
        """The choice's deltas, from whichever node runs it; raises APIError as dispatch.run does."""
        prompt, sampling = choice.prompt, choice.sampling
        produced: list[int] = []
        excluded: set[str] = set()
        hold = dispatch.held(job, choice)
        while True:
            target = self.pick(job, prompt, sampling, excluded)
            if target is None:
                if not excluded and not self._candidates(job, prompt):  # nobody holds those weights now
                    raise unavailable(f"no node of the cluster serves version {(job.record.version or '')[:12]} of "
                                      f"model '{job.record.model}' now", "version_not_served_here", retry_after=1)
                raise unavailable("no node in the cluster can run this request now", "node_failed", retry_after=5)
            node = target.candidate.node
            job.headers[NODE_HEADER] = node  # (a stream's headers leave with its first payload)
            first, kept = True, []  # kept: a held choice's deltas from a peer, until it finishes
            try:
                source = (dispatch.run(job, choice, prompt, sampling) if target.url is None
                          else self._remote(job, choice, target, prompt, sampling))
                async with contextlib.aclosing(source) as deltas:
                    async for d in deltas:
                        if first:
                            self.reservations.release(node, max(0, prompt.num_tokens - target.candidate.cached_tokens))
                            if self._ran is not None:
                                self._ran(node, prompt, d.cached_prompt_tokens)
                        first = False
                        if hold and d.finish_reason is None:
                            kept.append(d)
                            continue
                        for x in (*kept, d):
                            produced.extend(x.token_ids)
                            yield x
                return
            except PeerLost as lost:
                excluded.add(node)
                self.failovers += 1
                log.info("cluster_failover", request_id=job.record.request_id, node=node, why=lost.why,
                         delivered=len(produced), t=time.time())
                if len(excluded) > self.max_failovers or (produced and not choice.flow.preemptible):
                    raise unavailable(f"the node running this request failed ({lost.why}) and it cannot be "
                                      "resumed elsewhere", "node_failed", retry_after=5) from None
                job.record.mark(f"failover:{node}")
                if kept:  # a held answer nobody has seen: it starts over, its lost tokens unbilled
                    dispatch.discard(job, kept)
                if produced or kept:
                    job.record.resumed += 1
                if produced:
                    prompt, sampling = dispatch.resumed(choice.prompt, choice.sampling, produced)

    async def _remote(self, job: Job, choice: Choice, target: Target, prompt: Prompt,
                      sampling: Sampling) -> AsyncGenerator[Delta, None]:
        rec = job.record
        assert target.url is not None and rec.tenant is not None and rec.model is not None and rec.version
        req = RunRequest(request_id=rec.request_id, engine_id=f"{choice.engine_id}-{uuid.uuid4().hex[:6]}",
                         tenant=rec.tenant, klass=choice.flow.klass, model=rec.model, version=rec.version,
                         prompt_token_ids=prompt.token_ids, engine_input=encode_prompt_input(prompt),
                         sampling=sampling_to_json(sampling), seconds_left=max(0.001, _left(job)),
                         tokenizer=job.runtime.backend.tokenizer_id)
        if rec.t_dispatch is None:
            rec.t_dispatch = time.monotonic()
        rec.replica = f"{target.candidate.node}/{rec.model}@{rec.version[:12]}"
        async with contextlib.aclosing(self._forwarder.stream(target.candidate.node, target.url, req)) as deltas:
            async for d in deltas:
                dispatch.account(job, choice, d, here=False)
                yield d


def _left(job: Job) -> float:
    return job.deadline - time.monotonic()
