"""The output window holds back only what could still match: per filter, clean text leaves at
once, a candidate waits until it completes (then is redacted or stops the stream) or cannot
match any more (then leaves); holdback_tokens stays the upper bound. And for many random
splits of texts full of matches, no character of a redacted or blocked span ever leaves."""

from __future__ import annotations

import random

import pytest

from llmd.filters.base import HoldsBack, Match
from llmd.filters.builtin import PII, Blocklist, Degenerate
from llmd.filters.chain import OutputWindow
from llmd.filters.normalize import folded

PHRASE = "forbidden phrase"


def feed_all(w: OutputWindow, pieces: list[str], final: bool = True) -> tuple[list[str], Match | None]:
    """What each piece released (the last entry: the final flush), or the blocking match."""
    out = []
    for p in pieces:
        text, hit = w.feed(p, 1, False)
        if hit is not None:
            return out, hit
        out.append(text)
    if final:
        text, hit = w.feed("", 0, True)
        out.append(text)
        return out, hit
    return out, None


def test_clean_text_goes_out_at_once() -> None:
    w = OutputWindow([Blocklist("b", [PHRASE])], 8)
    assert feed_all(w, [" hello", " there", " forbi"], False)[0] == [" hello", " there", " "]  # "forbi" may go on
    pii = OutputWindow([PII("p")], 8)
    # A word waits only until what follows shows it is no address ("world" + "@..."); "3 " might be a phone number.
    assert feed_all(pii, ["Hello, ", "world. ", "It is 3 ", "o'clock."])[0] == \
        ["Hello, ", "world. ", "It is ", "3 o'", "clock."]
    assert pii.held == [] and pii.held_tokens == 0
    loops = OutputWindow([Degenerate("d")], 8)
    assert feed_all(loops, ["ha ", "ha ", "ha"], False)[0] == ["ha ", "ha ", "ha"]  # loops hold nothing


def test_a_phrase_prefix_waits_and_leaves_when_it_diverges() -> None:
    w = OutputWindow([Blocklist("b", [PHRASE])], 8)
    assert feed_all(w, ["Some ", "for", "bid", "den", " ph", "oto", " of it"])[0] == \
        ["Some ", "", "", "", "", "forbidden photo", " of it", ""]
    w = OutputWindow([Blocklist("b", [PHRASE])], 8)
    assert feed_all(w, ["un", "forb"], False)[0] == ["un", "forb"]  # not on a word boundary: no match begins there
    w = OutputWindow([Blocklist("b", [PHRASE])], 8)
    sent, hit = feed_all(w, ["Some ", "for", "bid", "den", " ph", "rase", " here"])
    assert hit is not None and hit.label == "b/word:0" and "".join(sent) == "Some "


def test_a_regex_pattern_holds_its_partial_match() -> None:
    w = OutputWindow([Blocklist("b", patterns=[r"how to (make|build) a bomb"], action="redact")], 8)
    assert feed_all(w, ["Here is how ", "to bu", "ild a b", "omb", "!"])[0] == \
        ["Here is ", "", "", "", "[REDACTED]!", ""]
    w = OutputWindow([Blocklist("b", patterns=[r"how to (make|build) a bomb"], action="redact")], 8)
    assert feed_all(w, ["Here is how ", "to bu", "y a bike"])[0] == ["Here is ", "", "how to buy a bike", ""]


@pytest.mark.parametrize(("pieces", "released"), [  # the last entry: the final flush
    (["Write to ", "ann", "@exa", "mple", ".com", " today"],
     ["Write to ", "", "", "", "", "[REDACTED:email] ", "today"]),
    (["Write to ", "ann", " later!"], ["Write to ", "", "ann later!", ""]),
    (["Call +1 ", "415 ", "555 ", "0134", " now!"], ["Call ", "", "", "", "[REDACTED:phone] now!", ""]),
    (["It was 1999", " when!"], ["It was ", "1999 when!", ""]),
    (["Pay 4111 ", "1111 ", "1111 ", "1111", " ok!"], ["Pay ", "", "", "", "[REDACTED:card] ok!", ""]),
    (["Pay 4111 ", "1111 ", "1111 ", "1112", " ok!"], ["Pay ", "", "", "", "4111 1111 1111 1112 ok!", ""]),  # not Luhn
    (["key: sk-", "abcdefghij", "klmnopqrstuv", "wx", " done!"], ["key: ", "", "", "", "[REDACTED:secret] done!", ""]),
    (["the sk-", "ab is short!"], ["the ", "sk-ab is short!", ""]),
])
def test_pii_holds_a_partial_match_until_it_completes_or_cannot(pieces: list[str], released: list[str]) -> None:
    w = OutputWindow([PII("pii")], 8)
    assert feed_all(w, pieces)[0] == released


def test_a_match_at_the_end_of_the_stream_is_redacted() -> None:
    w = OutputWindow([PII("pii")], 8)
    assert feed_all(w, ["mail ann", "@example"])[0] == ["mail ", "", "[REDACTED:email]"]


@pytest.mark.parametrize("pieces", [
    ["say ", "ＦＯＲ", "ｂｉｄ", "ｄｅｎ ｐ", "ｈｒａｓｅ", " ok"],  # full-width
    ["say ", "for\u200d", "bid\u200b", "den ", "phr\u2060ase", " ok"],  # zero-width joiner, space, word joiner
    ["say ", "fо", "rbiddеn", " phrаse", " ok"],  # Cyrillic о, е, а
    ["say ", "Fo", "RbId", "DeN  ", "pHrAsE", " ok"],  # case, two spaces
])
def test_folded_tricks_are_caught_across_chunks(pieces: list[str]) -> None:
    w = OutputWindow([Blocklist("b", [PHRASE])], 8)
    sent, hit = feed_all(w, pieces)
    assert hit is not None and hit.label == "b/word:0" and "".join(sent) == "say "
    w = OutputWindow([Blocklist("b", [PHRASE], action="redact")], 8)
    sent, hit = feed_all(w, pieces)
    assert hit is None and "".join(sent) == "say [REDACTED] ok"


def test_the_hold_maps_back_through_folding_that_changes_lengths() -> None:
    """"ﬁ" folds to two characters, zero-width ones to none: the held tail is measured on the original."""
    w = OutputWindow([Blocklist("b", ["fire"])], 8)
    assert feed_all(w, ["\u200b\u200bno ", "\ufb01", "\u200b"], False)[0] == ["\u200b\u200bno ", "", ""]
    assert w.feed("r", 1, False) == ("", None)
    assert w.feed("st", 1, False) == ("\ufb01\u200brst", None)


def test_a_candidate_longer_than_the_bound_leaves_from_its_start_then_stops_the_stream() -> None:
    w = OutputWindow([Blocklist("b", [PHRASE])], holdback_tokens=2)
    sent, hit = feed_all(w, ["the ", "for", "bid", "den", " phr", "ase"])
    assert hit is not None and hit.action == "block"
    # Only what the bound pushed out left: what followed waited, though it alone could not begin a match.
    assert "".join(sent) == "the forbid"
    w = OutputWindow([PII("pii")], holdback_tokens=2)
    sent, hit = feed_all(w, ["mail ", "jo", "hn", ".doe", "@exa", "mple.com", " now"])
    assert hit is not None and hit.action == "block" and hit.rule == "email"
    assert "".join(sent) == "mail john.doe"


def test_the_bound_counts_a_split_deltas_tokens() -> None:
    w = OutputWindow([PII("pii")], holdback_tokens=8)
    assert w.feed(" one two 415", 3, False) == (" one two ", None)
    assert w.held == [["415", 1]]  # a third of the delta, rounded up
    assert w.feed("", 0, True) == ("415", None) and w.held_tokens == 0


def test_overlapping_redactions_are_cut_out_as_one() -> None:
    w = OutputWindow([Blocklist("b", ["bad", "bad guy"], action="redact")], 8)
    assert w.feed("the bad guy left", 4, True) == ("the [REDACTED] left", None)
    assert w.redactions == ["b/word:0", "b/word:1"]


class Bangs:
    """A team's filter that declares its hold: three "!" in a row stop the stream; a trailing "!" or "!!" waits."""

    name = "bangs"
    lookback = 2

    def scan(self, text: str, final: bool) -> list[Match]:
        i = text.find("!!!")
        return [Match(self.name, "shouting", "block", i, i + 3)] if i >= 0 else []

    def hold(self, text: str, start: int) -> int:
        return len(text) - max(len(text.rstrip("!")), start)


def test_a_custom_filter_that_declares_its_hold() -> None:
    assert isinstance(Bangs(), HoldsBack) and all(isinstance(f, HoldsBack) for f in chain("block"))
    w = OutputWindow([Bangs()], 8)
    assert feed_all(w, ["calm", " down!", " now!", "!", " ok"])[0] == ["calm", " down", "! now", "", "!! ok", ""]
    sent, hit = feed_all(OutputWindow([Bangs()], 8), ["calm!", "!", "!"])
    assert hit is not None and "".join(sent) == "calm"


# -- property: random splits never let a byte of a redacted or blocked span out ---------------
WORDS = "the cat sat on a mat and then it was 3 or 42 of them, said ann at noon; mail me at home".split()  # noqa: SIM905
PLAIN = [w for w in WORDS if not any(c.isdigit() for c in w)]
SECRETS = ["john.doe@example.com", "a.b-c@mail.example.org", "ann@example", "+1 415 555 0134", "415-555-0134",
           "4111 1111 1111 1111", "5500-0000-0000-0004", "4111111111111111", "sk-abcdefghijklmnopqrstuvwx1234",
           "AKIAABCDEFGHIJKLMNOP", "ghp_" + "a1" * 18]
DISGUISED = ["forbidden phrase", "ＦＯＲＢＩＤＤＥＮ ＰＨＲＡＳＥ", "for\u200dbid\u200bden phrase", "fоrbiddеn phrаse",
             "Forbidden  Phrase"]


def random_text(rng: random.Random, planted: list[str]) -> str:
    parts = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    for item in planted:  # between words without digits, so a match's edges are the same in every split
        at = rng.randint(1, len(parts) - 1)
        parts[at:at] = [rng.choice(PLAIN), item, rng.choice(PLAIN) + rng.choice(["", ".", ","])]
    return " ".join(parts) + rng.choice(["", ".", " ok"])


def random_split(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def chain(action: str) -> list:
    return [Blocklist("b", [PHRASE], action=action), PII("p", action=action), Degenerate("d")]  # type: ignore[arg-type]


def test_random_splits_release_exactly_the_redacted_text() -> None:
    rng = random.Random(20261201)
    for _ in range(400):
        planted = rng.sample(SECRETS, rng.randint(1, 3)) + rng.sample(DISGUISED, rng.randint(0, 2))
        text = random_text(rng, planted)
        whole, hit = OutputWindow(chain("redact"), 10_000).feed(text, 1, True)
        assert hit is None and not any(s in whole for s in planted) and PHRASE not in folded(whole), text
        sent, hit = feed_all(OutputWindow(chain("redact"), 10_000), random_split(rng, text))
        assert hit is None and "".join(sent) == whole, text


def test_random_splits_stop_before_a_blocked_phrase() -> None:
    rng = random.Random(7)
    for _ in range(400):
        text = random_text(rng, [rng.choice(DISGUISED)])
        start = min(text.find(d) for d in DISGUISED if d in text)
        sent, hit = feed_all(OutputWindow(chain("block"), 10_000), random_split(rng, text))
        out = "".join(sent)
        assert hit is not None and hit.label == "b/word:0" and text.startswith(out) and len(out) <= start, text


def test_random_splits_under_the_shipped_bound_never_leak_a_whole_secret() -> None:
    """With holdback_tokens 8 a long candidate may be pushed out from its start; then it stops the stream."""
    rng = random.Random(99)
    for _ in range(300):
        planted = rng.sample(SECRETS, 2)
        text = random_text(rng, planted)
        whole, _ = OutputWindow(chain("redact"), 10_000).feed(text, 1, True)
        sent, hit = feed_all(OutputWindow(chain("redact"), 8), random_split(rng, text))
        out = "".join(sent)
        assert not any(s in out for s in planted), text
        assert out == whole if hit is None else hit.action == "block", text


def test_the_shipped_chain_lets_words_out_at_once_and_still_redacts_numbers() -> None:
    """config.toml's output chain: a word goes out with its own token (e-mail, which would hold
    every newest word one token, is left out of its pii kinds), a phone number is still redacted."""
    from pathlib import Path

    from llmd.config import load_config
    from llmd.filters import Filters

    cfg = load_config(Path(__file__).resolve().parents[2] / "config.toml")

    async def never(model: str, text: str, timeout: float) -> str:
        raise AssertionError("no classifier on output")

    def window() -> OutputWindow:
        w = Filters(cfg, never).output_window(cfg.models[0], cfg.tenants[0])
        assert w is not None
        return w
    assert feed_all(window(), ["Hello", ",", " world", "."], False)[0] == ["Hello", ",", " world", "."]
    out, hit = feed_all(window(), ["Call", " +1", " 415", " 555", " 0134", " now"])
    assert hit is None and "".join(out) == "Call [REDACTED:phone] now", out
