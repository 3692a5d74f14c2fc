"""Unicode folding so trivial evasions fail: full-width letters, zero-width joiners, mixed
case and look-alike letters all fold to plain lower-case ASCII-ish text.

`fold` keeps a map from each folded character back to the original index, so a match on
the folded text can still redact the original span.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence

# Invisible characters that split words without showing: zero-width space/joiners, word
# joiner, BOM, soft hyphen, Mongolian vowel separator, and the bidi marks.
INVISIBLE = frozenset("\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e\u200e\u200f\u202a\u202b\u202c\u202d\u202e")
# Look-alikes NFKC leaves alone (Cyrillic and Greek letters that read as Latin ones).
CONFUSABLES = str.maketrans({
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c",
    "т": "t", "у": "y", "х": "x", "і": "i", "ј": "j", "ѕ": "s", "ԁ": "d", "ɡ": "g", "ӏ": "l",
    "α": "a", "β": "b", "ε": "e", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u",
    "χ": "x", "ѵ": "v", "ԛ": "q", "ԝ": "w",
})


# Splits a text around each non-ASCII character: only these go through the folding below.
_SPLIT = re.compile(r"([^\x00-\x7f])")


@functools.lru_cache(maxsize=4096)
def _fold_char(ch: str) -> str:
    """One non-ASCII character folded (empty for an invisible one); the same few characters
    (dashes, curly quotes, accented letters) recur in every window, so each is folded once."""
    if ch in INVISIBLE:
        return ""
    f = unicodedata.normalize("NFKC", ch).casefold().translate(CONFUSABLES)
    return "".join(c for c in unicodedata.normalize("NFKD", f) if not unicodedata.combining(c))


def fold(text: str) -> tuple[str, Sequence[int]]:
    """(folded text, index in `text` of each folded character). Folding is per character, and
    an ASCII character only changes case, so ASCII runs are lowered whole (at C speed); where
    every other character folds to one character (a dash, a curly quote, an accented letter),
    the index map is the identity too."""
    if text.isascii():  # the common case: only case folds, each character stays where it is
        return text.lower(), range(len(text))
    parts = _SPLIT.split(text)  # ASCII runs at even places, one non-ASCII character at each odd one
    parts[0::2] = [run.lower() for run in parts[0::2]]
    chars = parts[1::2] = [_fold_char(ch) for ch in parts[1::2]]
    if all(len(f) == 1 for f in chars):
        return "".join(parts), range(len(text))
    where: list[int] = []
    i = 0
    for n, part in enumerate(parts):
        if n % 2 == 0:
            where.extend(range(i, i + len(part)))
            i += len(part)
        else:
            where.extend([i] * len(part))
            i += 1
    return "".join(parts), where


def folded(text: str) -> str:
    return fold(text)[0]
