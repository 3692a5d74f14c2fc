"""Signing between nodes: forged, replayed, stale and unsigned messages are dropped and counted;
key rotation accepts the old key while the new one signs."""

from __future__ import annotations

from llmd.cluster.signing import Signer

SECRET, OTHER, NEW = b"s" * 32, b"o" * 32, b"n" * 32


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_sealed_message_opens_once_and_a_replay_is_dropped() -> None:
    clock = Clock()
    a, b = Signer("a", [SECRET], clock), Signer("b", [SECRET], clock)
    msg = a.seal(b'{"ping": 1}')
    got = b.open(msg)
    assert got is not None and got.sender == "a" and got.payload == b'{"ping": 1}'
    assert b.open(msg) is None and b.dropped["replayed"] == 1


def test_forged_tampered_and_unsigned_messages_are_dropped() -> None:
    clock = Clock()
    b = Signer("b", [SECRET], clock)
    assert b.open(Signer("x", [OTHER], clock).seal(b"hi")) is None
    tampered = Signer("a", [SECRET], clock).seal(b"load=1")[:-1] + b"9"
    assert b.open(tampered) is None
    assert b.open(b"plain text") is None
    assert b.dropped["forged"] == 2 and b.dropped["unsigned"] == 1


def test_truncated_or_garbled_datagrams_are_dropped_never_raise() -> None:
    """The header is binary (a length-prefixed name): every cut of a genuine datagram, a name
    longer than the datagram, and a name that is not UTF-8 are counted as unsigned or forged."""
    clock = Clock()
    b = Signer("b", [SECRET], clock)
    msg = Signer("a", [SECRET], clock).seal(b"load=1")
    for cut in range(len(msg)):
        assert b.open(msg[:cut]) is None
    assert b.open(b"\xa7\xff" + msg[2:]) is None
    assert b.open(msg[:2] + b"\xff" + msg[3:]) is None  # the name's byte garbled
    assert sum(b.dropped.values()) == len(msg) + 2 and set(b.dropped) <= {"unsigned", "forged"}
    assert b.open(msg) is not None  # the genuine one still opens: none of the above took its nonce


def test_a_message_outside_the_window_is_stale_and_a_nonce_is_forgotten_after_it() -> None:
    clock = Clock()
    a, b = Signer("a", [SECRET], clock, window_s=5), Signer("b", [SECRET], Clock(1010.0), window_s=5)
    assert b.open(a.seal(b"old")) is None and b.dropped["stale"] == 1
    b2 = Signer("b", [SECRET], clock, window_s=5)
    for _ in range(3):
        assert b2.open(a.seal(b"x")) is not None
    clock.t += 100
    assert b2.open(a.seal(b"y")) is not None
    assert len(b2._seen) == 1  # the expired nonces went


def test_rotation_new_key_signs_old_key_still_verifies() -> None:
    clock = Clock()
    rotated = Signer("a", [NEW, SECRET], clock)
    old = Signer("b", [SECRET], clock)
    both = Signer("c", [NEW, SECRET], clock)
    assert both.open(old.seal(b"from the old key")) is not None
    assert both.open(rotated.seal(b"from the new key")) is not None
    assert old.open(rotated.seal(b"the old node lacks the new key")) is None


def test_http_headers_sign_method_path_and_body() -> None:
    clock = Clock()
    a, b = Signer("a", [SECRET], clock, purpose="http"), Signer("b", [SECRET], clock, purpose="http")
    h = a.headers("POST", "/internal/v1/run", b'{"x": 1}')
    assert b.verify("POST", "/internal/v1/run", h, b'{"x": 1}') == "a"
    assert b.verify("POST", "/internal/v1/run", h, b'{"x": 1}') is None  # replayed
    h = a.headers("POST", "/internal/v1/run", b'{"x": 1}')
    assert b.verify("POST", "/internal/v1/run", h, b'{"x": 2}') is None  # another body
    assert b.verify("POST", "/internal/v1/other", a.headers("POST", "/internal/v1/run"), b"") is None
    assert b.verify("GET", "/x", {}, b"") is None
    assert b.dropped == {"replayed": 1, "forged": 2, "unsigned": 1}
    gossip = Signer("b", [SECRET], clock)  # another purpose: another subkey
    assert gossip.verify("POST", "/p", a.headers("POST", "/p"), b"") is None
