"""The filters alone: folding, blocklist evasions, PII with Luhn, the loop detector, the
classifier's policies, and the output window's hold-back, redaction and boundary rules."""

from __future__ import annotations

import asyncio

import pytest

from llmd.filters.base import Match
from llmd.filters.builtin import PII, Blocklist, Classifier, Degenerate, luhn_ok
from llmd.filters.chain import OutputWindow
from llmd.filters.normalize import fold, folded


def stream(window: OutputWindow, pieces: list[str]) -> tuple[str, object]:
    out = []
    for p in pieces:
        text, hit = window.feed(p, 1, False)
        out.append(text)
        if hit is not None:
            return "".join(out), hit
    text, hit = window.feed("", 0, True)
    return "".join(out) + text, hit


def test_fold_defeats_width_case_invisible_and_lookalikes() -> None:
    assert folded("ＢＡＤ") == "bad"
    assert folded("b\u200da\u200bd\u2060") == "bad"
    assert folded("BaD") == "bad"
    assert folded("bаd") == "bad"  # Cyrillic а
    assert folded("bád") == "bad"
    text = "x\u200bＹz"
    f, where = fold(text)
    assert f == "xyz" and [text[i] for i in where] == ["x", "Ｙ", "z"]


@pytest.mark.parametrize("prompt", ["please say the FORBIDDEN phrase", "ｆｏｒｂｉｄｄｅｎ ｐｈｒａｓｅ now",
                                    "for\u200dbid\u200bden  phrase", "fоrbidden phrase"])
async def test_blocklist_catches_evasions(prompt: str) -> None:
    bl = Blocklist("words", words=["forbidden phrase"])
    hit = await bl.check_prompt(prompt)
    assert hit is not None and hit.label == "words/word:0"


async def test_blocklist_word_boundaries_and_patterns() -> None:
    bl = Blocklist("words", words=["ass"], patterns=[r"how to (make|build) a? ?bomb"])
    assert await bl.check_prompt("a classic assessment") is None
    assert (await bl.check_prompt("HOW TO MAKE A BOMB")).rule == "pattern:1"


def test_luhn() -> None:
    assert luhn_ok("4111111111111111") and luhn_ok("5500000000000004")
    assert not luhn_ok("4111111111111112")


def test_pii_kinds() -> None:
    pii = PII("pii")
    text = ("mail bob.smith@example.co.uk, card 4111-1111-1111-1111, not a card 4111 1111 1111 1112, "
            "call +1 415 555 0134, key sk-abcdefghijklmnopqrstuvwx1234 end")
    found = {m.rule: text[m.start:m.end] for m in pii.scan(text, final=True)}
    assert found == {"email": "bob.smith@example.co.uk", "card": "4111-1111-1111-1111", "phone": "+1 415 555 0134",
                     "secret": "sk-abcdefghijklmnopqrstuvwx1234"}  # the card failing Luhn is not one, nor a phone
    assert pii.scan("card 4111 1111 1111 1112 end", True) == []


def test_degenerate_stops_a_loop_not_prose() -> None:
    d = Degenerate("loop")
    assert d.scan("ha " * 20, False)[0].rule == "repeat:3"
    assert d.scan("The answer is 42. " * 8, False)[0].rule == "repeat:18"
    prose = "It was the best of times, it was the worst of times, it was the age of wisdom, it was"
    assert d.scan(prose, False) == []
    assert d.scan("-" * 30, False) == []  # shorter than min_chars


def test_a_separator_line_is_not_a_loop_but_a_run_past_any_line_is() -> None:
    d = Degenerate("loop")
    for line in ("-" * 120, "=" * 100, "=-" * 50, "*" * 80):
        assert d.scan("def f():\n    # " + line, False) == [], line  # code and markdown separators
    assert d.scan("x " + "-" * 170, False)[0].rule == "repeat:1"
    assert d.scan("x " + "=-" * 90, False)[0].rule == "repeat:2"
    assert d.scan("hello!!!!!" * 10, False)[0].rule == "repeat:10"  # a short run inside does not hide the loop


def test_a_long_run_without_an_at_sign_is_held_by_an_address_local_part_at_most() -> None:
    pii = PII("pii")
    assert pii.hold("assist" * 30, 0) == 64  # RFC 5321: a local part has at most 64 characters
    assert pii.hold("Hello wor", 0) == 3  # only the last word could still begin one
    text = "x" * 100 + "@example.com ok"
    (m,) = pii.scan(text, True)
    assert text[m.start:m.end] == "x" * 64 + "@example.com"


def test_window_catches_a_match_split_across_chunks() -> None:
    w = OutputWindow([Blocklist("words", words=["forbidden phrase"])], holdback_tokens=4)
    sent, hit = stream(w, ["this is a ", "for", "bid", "den ph", "rase indeed"])
    assert hit is not None and hit.label == "words/word:0"
    assert "for" not in sent  # nothing of the match left before it was caught


def test_window_redacts_email_and_card_split_across_chunks() -> None:
    w = OutputWindow([PII("pii")], holdback_tokens=8)
    pieces = ["Write to ", "jo", "hn.do", "e@exa", "mple.", "com or pay ",
              "with 4111 ", "1111 ", "1111 ", "1111", " ok"]
    sent, hit = stream(w, pieces)
    assert hit is None
    assert sent == "Write to [REDACTED:email] or pay with [REDACTED:card] ok"
    assert w.redactions == ["pii/email", "pii/card"]


class Quiet:
    """A team's own output filter that does not say how much to hold (no `hold`): the safe default."""

    name = "quiet"

    def scan(self, text: str, final: bool) -> list[Match]:
        return []


def test_window_releases_after_holdback_and_everything_at_the_end() -> None:
    """A filter without `hold` keeps the rule from before it: the newest holdback_tokens tokens wait.
    (The built-ins hold only what could still match: tests/unit/test_filters_holdback.py.)"""
    w = OutputWindow([Quiet()], holdback_tokens=2)
    assert w.feed(" one", 1, False)[0] == ""
    assert w.feed(" two", 1, False)[0] == ""
    assert w.feed(" three", 1, False)[0] == " one"  # only the newest 2 tokens are held
    assert w.feed("", 0, True)[0] == " two three"


def test_window_blocks_what_can_no_longer_be_redacted() -> None:
    """A match longer than the hold-back began in text already sent: stopping is all that is left."""
    w = OutputWindow([PII("pii")], holdback_tokens=1)
    sent, hit = stream(w, ["mail ", "jo", "hn.do", "e@exa", "mple.", "com now"])
    assert hit is not None and hit.action == "block" and hit.rule == "email"
    assert "example.com" not in sent


def test_window_stops_a_loop() -> None:
    w = OutputWindow([Degenerate("loop")], holdback_tokens=4)
    sent, hit = stream(w, ["Sure: "] + ["ha "] * 40)
    assert hit is not None and hit.label == "loop/repeat:3"
    assert sent.count("ha ") < 20


async def test_classifier_answer_timeout_and_error_policies() -> None:
    async def says(answer: str, delay: float = 0.0):  # type: ignore[no-untyped-def]
        async def ask(model: str, text: str, timeout: float) -> str:
            await asyncio.sleep(delay)
            return answer
        return ask

    assert (await Classifier("g", "m", await says("Unsafe.")).check_prompt("x")).label == "g/unsafe"
    assert await Classifier("g", "m", await says("safe")).check_prompt("x") is None
    slow = await says("unsafe", delay=1.0)
    opened = Classifier("g", "m", slow, timeout_ms=20, on_error="open")
    assert await opened.check_prompt("x") is None and opened.last_error == "timeout"
    closed = Classifier("g", "m", slow, timeout_ms=20, on_error="closed")
    assert (await closed.check_prompt("x")).label == "g/unavailable"

    async def broken(model: str, text: str, timeout: float) -> str:
        raise RuntimeError("model is down")
    assert (await Classifier("g", "m", broken, on_error="closed").check_prompt("x")).rule == "unavailable"
