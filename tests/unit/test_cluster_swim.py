"""SWIM as a pure state machine, on a fake clock and a fake network (each message goes through
JSON, is delivered one step later, or dropped by a rule): suspicion then death, refutation,
indirect probes, partitions healing, graceful leave, and Lifeguard's local health."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace

from llmd.cluster.swim import Member, Swim, Timing

T = Timing(probe_interval_s=0.5, probe_timeout_s=0.25, indirect_probes=2, suspicion_s=1.5)
STEP = 0.01


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Net:
    """Nodes named n0..n{k-1}; `drop(src, dst)` loses a message; `down` nodes neither run nor hear."""

    def __init__(self, k: int, timing: Timing = T, seed: int = 1) -> None:
        self.clock = Clock()
        self.nodes = {f"n{i}": Swim(f"n{i}", ("127.0.0.1", 7000 + i), f"http://n{i}", timing, self.clock,
                                    random.Random(seed * 100 + i)) for i in range(k)}
        self.by_addr = {s.addr: n for n, s in self.nodes.items()}
        self.drop: Callable[[str, str], bool] = lambda src, dst: False
        self.down: set[str] = set()
        self.inflight: list[tuple[str, str, str]] = []
        self.log: list[tuple[float, str, Member]] = []  # (time, observer, member as changed)
        self.sent: list[tuple[str, str, str, float]] = []  # (src, dst, type, time)

    def send(self, src: str, outs: list[tuple[tuple[str, int], dict]]) -> None:
        for addr, msg in outs:
            dst = self.by_addr[addr]
            self.sent.append((src, dst, msg["t"], self.clock.t))
            if not self.drop(src, dst):
                self.inflight.append((src, dst, json.dumps(msg)))

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP)):
            self.clock.t += STEP
            batch, self.inflight = self.inflight, []
            for src, dst, raw in batch:
                if dst not in self.down:
                    self.nodes[dst].heard(src)
                    self.send(dst, self.nodes[dst].receive(json.loads(raw), src, self.nodes[src].addr))
            for name, node in self.nodes.items():
                if name not in self.down:
                    self.send(name, node.tick())
                    self.log += [(self.clock.t, name, c) for c in node.changes]
                    node.changes.clear()

    def join_all(self) -> None:
        for name, node in self.nodes.items():
            if name != "n0":
                self.send(name, node.join([self.nodes["n0"].addr]))
        self.run(3)
        assert self.views_of_all() == {"alive"}

    def view(self, observer: str, member: str) -> str:
        return next(m.state for m in self.nodes[observer].members() if m.name == member)

    def views_of_all(self) -> set[str]:
        return {m.state for name, n in self.nodes.items() if name not in self.down for m in n.members()
                if m.name not in self.down}

    def states_seen(self, member: str, observers: set[str] | None = None) -> list[str]:
        return [m.state for _, o, m in self.log if m.name == member and (observers is None or o in observers)]


def test_a_killed_member_is_suspected_then_declared_dead_by_everyone() -> None:
    net = Net(4)
    net.join_all()
    net.down.add("n3")
    killed_at = net.clock.t
    net.run(6)
    for o in ("n0", "n1", "n2"):
        assert net.view(o, "n3") == "dead"
    seen = [(t, m.state) for t, _, m in net.log if m.name == "n3" and t > killed_at]
    first_suspect = min(t for t, s in seen if s == "suspect")
    first_dead = min(t for t, s in seen if s == "dead")
    assert first_suspect < first_dead
    assert first_dead - first_suspect >= T.suspicion_s - STEP  # not before the suspicion timeout
    assert first_dead - killed_at <= 3.0  # probe round + timeout + suspicion, on the fake clock


def test_a_suspected_member_that_is_alive_refutes_with_a_higher_incarnation() -> None:
    net = Net(4)
    net.join_all()
    net.drop = lambda src, dst: dst == "n2"  # n2 hears nothing for a while: it gets suspected
    net.run(1.2)
    assert "suspect" in net.states_seen("n2")
    net.drop = lambda src, dst: False
    net.run(4)
    assert net.nodes["n2"].incarnation >= 1
    assert "dead" not in net.states_seen("n2")
    for o in ("n0", "n1", "n3"):
        m = next(m for m in net.nodes[o].members() if m.name == "n2")
        assert m.state == "alive" and m.incarnation == net.nodes["n2"].incarnation


def _lossy_pair(indirect: int) -> Net:
    net = Net(4, replace(T, indirect_probes=indirect))
    net.join_all()
    net.drop = lambda src, dst: {src, dst} == {"n0", "n1"}  # the direct path n0<->n1 is broken
    net.run(20)
    return net


def test_indirect_probes_keep_a_member_alive_when_only_the_direct_path_is_lossy() -> None:
    net = _lossy_pair(indirect=2)
    assert "suspect" not in net.states_seen("n1", {"n0"}) and "suspect" not in net.states_seen("n0", {"n1"})
    assert net.views_of_all() == {"alive"}
    assert any(t == "preq" for src, _, t, _ in net.sent if src == "n0")
    # the same loss without indirect probes: n0 suspects n1
    assert "suspect" in _lossy_pair(indirect=0).states_seen("n1", {"n0"})


def test_a_healed_partition_converges_back_to_alive() -> None:
    net = Net(6)
    net.join_all()
    left, right = {"n0", "n1", "n2"}, {"n3", "n4", "n5"}
    net.drop = lambda src, dst: (src in left) != (dst in left)
    net.run(20)  # a partition looks like our own fault at first (helpers across it send no nacks)
    for a in left:
        for b in right:
            assert net.view(a, b) == "dead" and net.view(b, a) == "dead"
    net.drop = lambda src, dst: False
    net.run(15)
    assert net.views_of_all() == {"alive"}


def test_a_graceful_leave_is_left_not_dead_and_is_not_probed_again() -> None:
    net = Net(4)
    net.join_all()
    net.send("n2", net.nodes["n2"].leave())
    net.run(0.05)
    net.down.add("n2")
    sent_before = len(net.sent)
    net.run(10)
    for o in ("n0", "n1", "n3"):
        assert net.view(o, "n2") == "left"
    assert "dead" not in net.states_seen("n2") and "suspect" not in net.states_seen("n2")
    assert not [s for s in net.sent[sent_before:] if s[1] == "n2"]


def test_a_dead_member_that_comes_back_is_readmitted() -> None:
    net = Net(3)
    net.join_all()
    net.down.add("n2")
    net.run(6)
    assert net.view("n0", "n2") == "dead"
    net.down.discard("n2")  # it was only paused (SIGSTOP): it still believes it is alive
    net.run(8)
    assert net.views_of_all() == {"alive"}
    assert net.nodes["n2"].incarnation >= 1


def test_lifeguard_a_node_that_cannot_hear_raises_its_timeouts_and_holds_off_its_verdicts() -> None:
    def deaf(max_health: int) -> Net:
        net = Net(4, replace(T, max_health=max_health))
        net.join_all()
        net.drop = lambda src, dst: dst == "n0"  # n0 is starved: nothing reaches it
        net.run(4)
        return net

    net = deaf(8)
    n0 = net.nodes["n0"]
    assert n0.health >= 3
    assert n0.suspicion_timeout() >= 4 * T.suspicion_s
    assert "dead" not in {net.view("n0", o) for o in ("n1", "n2", "n3")}
    # without Lifeguard the starved node declares healthy members dead
    plain = deaf(0)
    assert "dead" in {plain.view("n0", o) for o in ("n1", "n2", "n3")}


def test_lifeguard_a_healthy_node_probing_a_dead_member_stays_healthy() -> None:
    net = Net(4)
    net.join_all()
    net.down.add("n3")
    net.run(6)
    assert net.nodes["n0"].health == 0  # the others' nacks say the fault is not ours


def test_membership_updates_piggyback_a_bounded_number_of_times() -> None:
    net = Net(5)
    net.join_all()
    a = net.nodes["n0"]
    a._apply({"n": "n1", "s": "s", "i": 0})
    copies = 0
    for _ in range(40):
        msg = a.attach({"t": "g"})
        copies += sum(1 for u in msg.get("u", []) if u["n"] == "n1")
    assert 3 <= copies <= 10


def test_a_member_that_falls_silent_is_probed_at_once_not_at_its_turn() -> None:
    net = Net(8)
    net.join_all()
    probed_n7: set[str] = set()  # the nodes that had a probe of their own on n7 in flight

    def chatter(seconds: float) -> None:  # every node pushes its state to every other every 250 ms (as Gossip)
        for _ in range(round(seconds / 0.25)):
            for name, node in net.nodes.items():
                if name not in net.down:
                    net.send(name, [(o.addr, {"t": "st"}) for o in net.nodes.values() if o is not node])
            net.run(0.25)
            probed_n7.update(o for o, n in net.nodes.items() if any(p.target == "n7" for p in n._probes.values()))

    chatter(5)
    net.down.add("n7")
    probed_n7.clear()
    chatter(1.25)
    # at its turn, n7 could wait 7 probe intervals (3.5 s) for a given node's probe; silent for
    # ~3 of its usual gaps, it is probed by every node
    assert probed_n7 == {f"n{i}" for i in range(7)}
