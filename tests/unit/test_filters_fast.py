"""The output filters' fast paths give the answers the plain paths give: folding by ASCII runs
folds like folding each character, and a calm token (one the window releases without asking
each filter's scan and hold) never hides a match: a phone number, card or key split across
tokens, a blocked phrase in another case or with zero-width characters in it, are still
redacted or stopped exactly where the plain path redacts or stops them."""

from __future__ import annotations

import random
import unicodedata

import pytest

from llmd.filters.base import Match
from llmd.filters.builtin import PII, Blocklist, Degenerate
from llmd.filters.chain import OutputWindow
from llmd.filters.normalize import CONFUSABLES, INVISIBLE, fold


def fold_each(text: str) -> tuple[str, list[int]]:
    """Folding one character at a time: the definition the run-wise `fold` must agree with."""
    out: list[str] = []
    where: list[int] = []
    for i, ch in enumerate(text):
        if ch in INVISIBLE:
            continue
        f = ch.lower() if ch.isascii() else unicodedata.normalize("NFKC", ch).casefold().translate(CONFUSABLES)
        f = "".join(c for c in unicodedata.normalize("NFKD", f) if not unicodedata.combining(c))
        out.append(f)
        where.extend([i] * len(f))
    return "".join(out), where


def test_fold_by_runs_agrees_with_folding_each_character() -> None:
    rng = random.Random(5)
    alphabet = "abXYZ 1-.\u200b\u200d\u00adＢＡＤéﬁßİаοÅ—’\u0301\U0001d400"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        f, where = fold(text)
        assert (f, list(where)) == fold_each(text), text


# -- calm: never True where scan or hold would have something to say ---------------------------
PIECES = ["the", " cat", " ask", " will", " sky", " x", " l", " s", "A", "AK", "gh", "ghp_", "xox", "xoxb-", "ll",
          "llmd-", "sk", "sk-", "-", "--", "-----BEGIN ", "PRIVATE KEY-----", "_", " ", "\n", ".", "(", ")", "+",
          "+1", " 415", "555", "-0134", "4111", " 1111", "１２", "١٢٣", "\U00010d40", "\u09f4", "\u200b", "é", "—", "½",
          "abcdefghij", "KLMNOPQRST",
          "12345678901234567890", "example", " banned", " phrase", "EXAMPLE", "Ban\u200dned", "ｐｈｒａｓｅ", "@",
          "ann", "@example.com", " again", " example banned phrase ", "EXAMPLE BANNED PHRASE.", "ghp_" + "ab" * 18,
          "AKIA" + "ABCDEFGHIJKLMNOP", "sk-" + "abcdefghijklmnopqrstuvwx", "xoxb-" + "abcdefghijkl",
          "llmd-" + "abcdefghijklmnopqrst"]


def filters() -> list:
    return [Blocklist("b", ["example banned phrase"]), Blocklist("r", ["example banned phrase"], action="redact"),
            Blocklist("p", patterns=[r"ba+d \d+"]), PII("shipped", ["phone", "card", "secret"]), PII("all"),
            PII("card", ["card"]), PII("secret", ["secret"]), PII("phone", ["phone"], action="block"),
            Degenerate("d", min_repeats=4, min_chars=8, short_chars=12)]


def test_calm_only_where_scan_finds_no_new_match_and_hold_holds_nothing() -> None:
    rng = random.Random(11)
    calm = {f.name: 0 for f in filters()}
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
        start = rng.randint(0, len(text))
        for f in filters():
            if f.calm(text, start):
                calm[f.name] += 1
                assert not [m for m in f.scan(text, False) if m.end > start], (f.name, text, start)
                assert f.hold(text, start) == 0, (f.name, text, start)
    assert all(n > 100 for n in calm.values()), calm  # it does say calm, on the texts that are


class Plain:
    """A filter without `calm`: the window asks its scan and hold on every token (the plain path)."""

    def __init__(self, f: object) -> None:
        self.f, self.name, self.lookback = f, f.name, f.lookback  # type: ignore[attr-defined]

    def scan(self, text: str, final: bool) -> list[Match]:
        return self.f.scan(text, final)  # type: ignore[attr-defined,no-any-return]

    def hold(self, text: str, start: int) -> int:
        return self.f.hold(text, start)  # type: ignore[attr-defined,no-any-return]


def outcome(chain: list, pieces: list[str], bound: int = 32) -> tuple[list[str], str | None, list[str]]:
    """What each piece released, the stopping rule if any, and the redactions."""
    w, out = OutputWindow(chain, bound), []
    for i, p in enumerate(pieces):
        text, hit = w.feed(p, 1, i == len(pieces) - 1)
        if hit is not None:
            return out, hit.label, w.redactions
        out.append(text)
    return out, None, w.redactions


def shipped() -> list:
    return [Blocklist("b", ["example banned phrase"]), PII("p", ["phone", "card", "secret"]), Degenerate("d")]


@pytest.mark.parametrize(("pieces", "sent", "stop"), [
    (["Call", " +", "1 4", "15 ", "555", " 01", "34", " now", "."], "Call [REDACTED:phone] now.", None),
    (["pay", " 41", "11 1", "111 ", "1111", " 1111", " then"], "pay [REDACTED:card] then", None),
    (["key", " s", "k-", "abcdefghij", "klmnopqrst", "uv", " ok", "!"], "key [REDACTED:secret] ok!", None),
    (["key", " gh", "p_", "a1" * 9, "a1" * 9, " ok", "."], "key [REDACTED:secret] ok.", None),
    (["say", " EXA", "MPLE", " Ban\u200bned", " phr", "ase", " now"], "say ", "b/word:0"),
    (["say", " ｅｘａｍｐｌｅ", " banned", " PHRASE", "!"], "say ", "b/word:0"),
])
def test_split_matches_are_found_as_the_plain_path_finds_them(pieces: list[str], sent: str, stop: str | None) -> None:
    out, hit, _ = outcome(shipped(), pieces)
    assert ("".join(out), hit) == (sent, stop)
    assert outcome(shipped(), pieces) == outcome([Plain(f) for f in shipped()], pieces)


def test_random_streams_release_what_the_plain_path_releases() -> None:
    rng = random.Random(3)
    for bound in (32, 4):
        for _ in range(120):
            text = "".join(rng.choice(PIECES) for _ in range(rng.randint(5, 40)))
            pieces, i = [], 0
            while i < len(text):
                n = rng.randint(1, 5)
                pieces.append(text[i:i + n])
                i += n
            for chain in (shipped(), filters()):
                assert outcome(chain, pieces, bound) == outcome([Plain(f) for f in chain], pieces, bound), pieces


def test_a_calm_token_skips_scan_and_hold() -> None:
    class Quiet:
        name, lookback = "q", 8

        def calm(self, text: str, start: int) -> bool:
            return "!" not in text[start:]

        def scan(self, text: str, final: bool) -> list[Match]:
            self.scans += 1
            return []

        def hold(self, text: str, start: int) -> int:
            return 0

        scans = 0
    q = Quiet()
    assert outcome([q], ["a", " b", " c!", " d"]) == (["a", " b", " c!", " d"], None, [])
    assert q.scans == 2  # " c!" and the final piece; the rest left without a scan


def test_calm_sees_a_loop_of_every_period() -> None:
    rng = random.Random(8)
    d = Degenerate("d")
    for period in range(1, d.max_period + 1):
        unit = "".join(rng.choice("abcdefghij ") for _ in range(period))
        text = "so it goes: " + unit * (d.lookback // period + 2)
        assert d.calm(text, len(text) - period) == (not d.scan(text, False)), period
        assert not d.calm(text, len(text) - period) or not unit.strip(), period


def test_pii_shortcuts_change_no_scan_and_no_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """scan's prefix test and hold's leads only skip searches that would find nothing."""
    from llmd.filters import builtin

    rng = random.Random(21)
    cases = [("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))), rng.random()) for _ in range(1500)]
    cases = [(text, int(at * len(text))) for text, at in cases]

    def answers() -> list[tuple[list[Match], list[Match], int]]:
        p = PII("p")
        return [(p.scan(text, False), p.scan(text, True), p.hold(text, start)) for text, start in cases]
    fast = answers()
    monkeypatch.setattr(builtin, "_secret_marked", lambda text: True)
    monkeypatch.setattr(builtin, "_LEADS", {})
    assert answers() == fast


def test_blocklist_leads_change_no_hold() -> None:
    """hold's word-start lead only skips partial searches that would find nothing."""
    rng = random.Random(34)
    fast, plain = Blocklist("b", ["example banned phrase"]), Blocklist("b", ["example banned phrase"])
    plain._leads = [None]
    for _ in range(1500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        start = rng.randint(0, len(text))
        assert fast.hold(text, start) == plain.hold(text, start), (text, start)
