"""The output filters' fast paths give the answers the plain paths give: folding by ASCII runs
folds like folding each character, and a calm token (one the window releases without asking
each filter's scan and hold) never hides a match: a phone number, card or key split across
tokens, a blocked phrase in another case or with zero-width characters in it, are still
redacted or stopped exactly where the plain path redacts or stops them."""

from __future__ import annotations

import random
import unicodedata

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
