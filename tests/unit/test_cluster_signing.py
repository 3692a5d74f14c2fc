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
    assert b.open(b"\xa7\x02\xff" + msg[3:]) is None  # a name longer than the datagram
    assert b.open(msg[:3] + b"\xff" + msg[4:]) is None  # the name's byte garbled
    assert b.open(b"\xa7\x01" + msg[2:]) is None  # another format version
    assert sum(b.dropped.values()) == len(msg) + 3 and set(b.dropped) <= {"unsigned", "forged", "version"}
    assert b.dropped["version"] == 1
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
    h = a.headers("POST", "/internal/v1/run", b'{"x": 1}', to="b")
    assert b.verify("POST", "/internal/v1/run", h, b'{"x": 1}') == "a"
    assert b.verify("POST", "/internal/v1/run", h, b'{"x": 1}') is None  # replayed
    h = a.headers("POST", "/internal/v1/run", b'{"x": 1}', to="b")
    assert b.verify("POST", "/internal/v1/run", h, b'{"x": 2}') is None  # another body
    assert b.verify("POST", "/internal/v1/other", a.headers("POST", "/internal/v1/run", to="b"), b"") is None
    assert b.verify("GET", "/x", {}, b"") is None
    c = Signer("c", [SECRET], clock, purpose="http")  # the same call, replayed to another node
    assert c.verify("POST", "/internal/v1/run", a.headers("POST", "/internal/v1/run", to="b"), b"") is None
    assert b.dropped == {"replayed": 1, "forged": 2, "unsigned": 1} and c.dropped == {"misaddressed": 1}
    gossip = Signer("b", [SECRET], clock)  # another purpose: another subkey
    assert gossip.verify("POST", "/p", a.headers("POST", "/p", to="b"), b"") is None


def test_a_response_and_its_stream_lines_are_signed_for_the_call_they_answer() -> None:
    clock = Clock()
    a, b = Signer("a", [SECRET], clock, purpose="http"), Signer("b", [SECRET], clock, purpose="http")
    call = a.headers("GET", "/internal/v1/registry", to="b")
    nonce = call["X-LLMD-Nonce"]
    answer = b.headers("RESPONSE", "/internal/v1/registry", b"{}", to="a", reply_to=nonce)
    assert a.verify("RESPONSE", "/internal/v1/registry", answer, b"{}", reply_to="another", sender="b") is None
    assert a.verify("RESPONSE", "/internal/v1/registry", answer, b"{}", reply_to=nonce, sender="c") is None
    assert a.verify("RESPONSE", "/internal/v1/registry", answer, b"{}", reply_to=nonce, sender="b") == "b"
    lines = [b.sign_line(nonce, i, x) for i, x in enumerate([b'{"t":"hi"}\n', b'{"end":true}\n'])]
    assert [a.open_line(nonce, i, x) for i, x in enumerate(lines)] == [b'{"t":"hi"}', b'{"end":true}']
    assert a.open_line(nonce, 0, lines[1]) is None  # out of order
    assert a.open_line("another", 0, lines[0]) is None  # another call's
    assert a.open_line(nonce, 0, b'{"t":"injected"}') is None
    assert a.dropped == {"forged": 3, "misaddressed": 1, "unsigned": 1}
