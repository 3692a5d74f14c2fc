"""Chats across a cluster (issue M): three real llmd nodes (fake engines) on loopback, requests
entering the nodes in turn as a load balancer sends them. A chat's later turn runs where its
history is cached, whichever node it enters, while a hot system prompt split over several homes
still spreads the new chats; a conversation's key (`user`, X-Conversation-Id) names one node
at every ingress."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import openai

from llmd.cluster.node import TRAFFIC_EVERY_S
from tests.unit.test_cluster import _client, start_cluster

FAST = "prefill_tokens_per_s = 20000"
SYSTEM = "You are the support assistant of a hardware shop. " + " ".join(
    f"Rule {i}: answer politely, cite the manual section {i}, never guess a price." for i in range(60))


def question(chat: int, turn: int) -> dict[str, str]:
    """A question long enough to fill summary blocks of its own past the system prompt."""
    return {"role": "user", "content": f"Chat {chat} turn {turn}: " + " ".join(
        f"my order number {chat * 100 + k} has an issue with part {k}" for k in range(20))}


async def ask(server: Any, messages: list[dict[str, str]]) -> tuple[str, str, int, int]:
    """(node that ran it, the answer, prompt tokens, cached prompt tokens)."""
    raw = await _client(server).chat.completions.with_raw_response.create(model="fake", messages=messages,
                                                                          max_tokens=24)
    out = raw.parse()
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return (raw.headers["x-llmd-node"], out.choices[0].message.content or "", out.usage.prompt_tokens,
            out.usage.prompt_tokens_details.cached_tokens or 0)


async def test_later_turns_run_on_their_historys_node_whichever_node_they_enter(make_server: Any,
                                                                               tmp_path: Path) -> None:
    """Issue M: 12 two-turn chats on one long system prompt, each request entering the nodes in
    turn: 5-8 of the 12 second turns ran on the node holding their history, the rest prefilled
    it again on another home of the split system prompt."""
    nodes = await start_cluster(make_server, tmp_path, fake=FAST)  # balanced homes bound (the default)
    system = {"role": "system", "content": SYSTEM}
    for i in range(6):  # the prompt's traffic, heard by every ingress, splits it over the nodes
        await ask(nodes[i % 3], [system, question(100 + i, 1)])
    await asyncio.sleep(TRAFFIC_EVERY_S + 1.2)
    chats = [[system, question(i, 1)] for i in range(12)]
    first = []
    for i, msgs in enumerate(chats):
        node, answer, prompt, _ = await ask(nodes[i % 3], msgs)
        first.append((node, prompt))
        msgs += [{"role": "assistant", "content": answer}, question(i, 2)]
    split = [s.node.cluster.status()["homes"]["per_node"] for s in nodes]
    assert all(len(p) >= 2 for p in split), split  # the system prompt has several homes at every ingress
    assert len({n for n, _ in first}) >= 2, first  # and its new chats spread over them
    await asyncio.sleep(0.8)  # each node's prefix summary reaches the others
    for i, msgs in enumerate(chats):
        node, _, prompt, cached = await ask(nodes[(i + 1) % 3], msgs)  # another node than its first turn's
        assert node == first[i][0], (i, node, first)
        assert cached >= first[i][1] - 64, (i, cached, first[i][1])  # its whole first turn was cached


async def test_a_conversation_runs_on_one_node_whichever_node_its_turns_enter(make_server: Any,
                                                                             tmp_path: Path) -> None:
    """Affinity was remembered by the ingress that routed the turn: a turn entering another node
    ran there (its own node is a hop nearer), off the conversation's cache."""
    nodes = await start_cluster(make_server, tmp_path, fake=FAST)
    ran: dict[str, set[str]] = {}
    for turn in range(6):  # short prompts (no summary block): only the conversation's key says where
        for c in range(8):
            key = f"conversation-{c}"
            kw: dict[str, Any] = {"user": key} if c % 2 else {"extra_headers": {"X-Conversation-Id": key}}
            client: openai.AsyncOpenAI = _client(nodes[(turn + c) % 3])
            raw = await client.chat.completions.with_raw_response.create(
                model="fake", max_tokens=2, messages=[{"role": "user", "content": f"turn {turn} " + "word " * turn}],
                **kw)
            ran.setdefault(key, set()).add(raw.headers["x-llmd-node"])
    assert all(len(n) == 1 for n in ran.values()), ran
    assert len({next(iter(n)) for n in ran.values()}) >= 2, ran  # the conversations spread over the nodes


def test_a_conversations_node_yields_to_a_node_caching_more_of_its_prompt() -> None:
    """The node named for a conversation (remembered here, else by its key's rendezvous hash)
    keeps its turn only while no other node caches more of the prompt: a turn routed elsewhere
    (its node was busy) left the history there, and the cache rules follow it."""
    from llmd.cluster.router import Router
    from llmd.policy.placement import Candidate, ScoreRouting, VersionLoad
    from llmd.policy.rendezvous import conversation_node
    from llmd.policy.reservations import Reservations

    def cand(node: str, cached: int = 0, draining: bool = False) -> Candidate:
        load = VersionLoad("m", "ab" * 32, 100_000, 100_000, 0, 0, 0, 10_000.0, 500.0, draining=draining)
        return Candidate(node, load, cached, 0.1, node == "n0")

    router = Router("n0", lambda job, prompt: [], None, ScoreRouting(Reservations(lambda: 0.0, 2.0), random.Random(1)),
                    2)  # type: ignore[arg-type]  # no forwarding here: only the choice of a sticky node
    named = conversation_node("chat-7", ["n0", "n1", "n2"])
    assert named is not None
    nodes = [cand(n) for n in ("n0", "n1", "n2")]
    assert router.conversation("chat-7", nodes) == named  # no cache says otherwise: the named node
    other = next(n for n in ("n0", "n1", "n2") if n != named)
    held = [cand(n, 640 if n == other else 0) for n in ("n0", "n1", "n2")]
    assert router.conversation("chat-7", held) is None  # its history is elsewhere: the cache rules decide
    router._sessions["chat-7"] = other  # its last turn, routed here, ran there
    assert router.conversation("chat-7", held) == other
    # the named node draining: the key is hashed over the others
    drained = [cand(n, draining=n == named) for n in ("n0", "n1", "n2")]
    assert router.conversation("chat-8", drained) == conversation_node("chat-8", [n for n in ("n0", "n1", "n2")
                                                                               if n != named])
