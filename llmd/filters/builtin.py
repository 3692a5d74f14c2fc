"""The built-in filters: blocklist/regex, PII, degenerate output, and a guard-model classifier.

Each is small and pure (the classifier gets an `ask` callable, not a server), so each is
testable alone; `llmd/filters/chain.py` builds them from config and runs them.
"""

from __future__ import annotations

import asyncio
import re
import string
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import regex

from llmd.filters.base import Action, Match
from llmd.filters.normalize import fold, folded


def undecided(rx: Any, text: str, pos: int = 0, grow: re.Pattern[str] | None = None) -> int | None:
    """Where, at or after `pos`, the first match of `rx` (a `regex` pattern) that more text could
    still change begins: a partial match (regex's partial matching: `text` ends inside it) or a
    complete one that nothing but `grow` follows (by default: that ends where `text` does). None:
    no match can begin there any more, whatever comes next."""
    while (m := rx.search(text, pos, partial=True)) is not None:
        if m.partial or (m.end() == len(text) if grow is None else grow.fullmatch(text, m.end())):
            return m.start() if m.start() < len(text) else None
        pos = m.start() + 1  # a complete match, decided: one beginning inside it may still grow
    return None


class Blocklist:
    """Words/phrases and regexes matched on folded text (see normalize.py), so `ＢＡＤ`,
    `b\u200dad` and `BaD` all match `bad`. Words match on word boundaries; `patterns`
    are regexes over the folded text (write them in lower case; the `regex` module's syntax,
    which accepts what `re` does). Holds back only a tail that could still become a match."""

    lookback = 64  # released characters re-read: a phrase that began there is still seen (then stopped)

    def __init__(self, name: str, words: Iterable[str] = (), patterns: Iterable[str] = (),
                 action: Action = "block") -> None:
        self.name, self.action = name, action
        self.rules: list[tuple[str, Any]] = []  # (rule, compiled `regex` pattern)
        # A word rule's match (partial or whole) begins with its first letter at a word start:
        # where none is, `hold` skips its partial search (a user's pattern has no such lead: None).
        self._leads: list[re.Pattern[str] | None] = []
        # For `calm`, per rule: its `regex` pattern, a word rule's longest word (no match without
        # it) and `_tail` (no match of it may still grow or end with the text without that).
        self._calm: list[tuple[Any, str | None, re.Pattern[str] | None]] = []
        for w in words:
            parts = folded(w).split()
            body = r"\s+".join(regex.escape(part) for part in parts)
            self.rules.append((f"word:{len(self.rules)}", regex.compile(rf"(?<!\w){body}(?!\w)")))
            # (after no ASCII word character: `re`'s \w takes some characters `regex`'s does not)
            self._leads.append(re.compile(rf"(?<![A-Za-z0-9_]){re.escape(parts[0][0])}") if parts else None)
            self._calm.append((self.rules[-1][1], max(parts, key=len), _tail(parts)) if parts else
                              (self.rules[-1][1], None, None))
        for p in patterns:
            self.rules.append((f"pattern:{len(self.rules)}", regex.compile(p)))
            self._leads.append(None)
            self._calm.append((self.rules[-1][1], None, None))
        self._last: tuple[str, str, Sequence[int]] = ("", "", ())  # scan and hold fold the same text

    def _fold(self, text: str) -> tuple[str, Sequence[int]]:
        if text is not self._last[0]:
            self._last = (text, *fold(text))
        return self._last[1], self._last[2]

    def _folded_from(self, text: str, start: int) -> tuple[str, Sequence[int], int]:
        """The folded text, its index map, and where `start` (in `text`) falls in it."""
        f, where = self._fold(text)
        return f, where, start if isinstance(where, range) else bisect_left(where, start)

    def _matches(self, text: str, final: bool) -> list[Match]:
        f, where = self._fold(text)
        out = []
        for rule, rx in self.rules:
            for m in rx.finditer(f):
                if m.end() == len(f) and not final and self.action == "redact":
                    continue  # might still grow ("secret" -> "secrets"): wait for more text
                start = where[m.start()]
                end = where[m.end() - 1] + 1 if m.end() > m.start() else start
                out.append(Match(self.name, rule, self.action, start, end, "[REDACTED]"))
        return out

    def screen(self, text: str) -> Match | None:
        """check_prompt as a plain call: the chain runs it on a prompt-pool thread (pure, thread-safe)."""
        found = self._matches(text, True)
        return found[0] if found else None

    async def check_prompt(self, text: str) -> Match | None:
        return self.screen(text)

    def scan(self, text: str, final: bool) -> list[Match]:
        return self._matches(text, final)

    def calm(self, text: str, start: int) -> bool:
        """No rule matches anywhere in `text` (a word rule cannot without its longest word in the
        folded text, a cheap substring test) and `hold` would answer 0: no rule's partial match, or
        whole one that ends with the text, begins at or after `start` (`_tail` first, then as `hold`)."""
        f, _, pos = self._folded_from(text, start)
        for rx, need, tail in self._calm:
            if (need is None or need in f) and rx.search(f) is not None:
                return False
            if (tail is None or tail.search(f, pos) is not None) and undecided(rx, f, pos) is not None:
                return False
        return True

    def hold(self, text: str, start: int) -> int:
        """From the first folded character that may still begin a rule's match: a prefix of a phrase
        after a word boundary ("the forb"), a pattern's partial match, a match at the very end."""
        f, where, pos = self._folded_from(text, start)
        first = len(f)
        for (_, rx), lead in zip(self.rules, self._leads, strict=True):
            if lead is not None and lead.search(f, pos) is None:
                continue
            s = undecided(rx, f, pos)
            if s is not None and s < first:
                first = s
        return 0 if first == len(f) else len(text) - where[first]  # folded -> original: lengths differ


def _tail(parts: list[str]) -> re.Pattern[str]:
    """Where a word rule's partial match, or whole one ending with the text, may begin: its first
    letter after no ASCII word character (its `regex` word boundary, or more), then to the end
    only the phrase's letters, white space or characters past ASCII (its `regex` spaces, or more)."""
    allowed = set("".join(parts)) | set(string.whitespace) | set("\x1c\x1d\x1e\x1f")
    other = "".join(re.escape(chr(i)) for i in range(128) if chr(i) not in allowed)
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(parts[0][0])}[^{other}]*\Z")


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


# `regex` patterns (partial matching tells the window what could still become one).
_PII: dict[str, Any] = {
    # The top-level domain is optional: a stream cut at max_tokens ("ann@example") still names someone.
    # The local part is at most 64 characters (RFC 5321), so a long run with no "@" (a hash, a
    # token soup) is held back by 64 characters at most, not until the hold-back bound.
    "email": regex.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*"),
    # Digit runs are matched whole: never a piece of a longer group ("1111 1111" inside a card).
    "card": regex.compile(r"(?<!\d)(?<!\d[ -])\d(?:[ -]?\d){12,18}(?![ -]?\d)"),
    "phone": regex.compile(r"(?<![\w+])(?<!\d[ .-])\+?\d{1,3}?[ .-]?\(?\d{2,4}\)?[ .-]?\d{3,4}[ .-]?\d{3,4}"
                           r"(?![ .-]?\d)(?!\w)"),
    "secret": regex.compile(r"\b(?:sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}"
                            r"|xox[baprs]-[A-Za-z0-9-]{10,}|llmd-[A-Za-z0-9_-]{20,}"
                            r"|-----BEGIN [A-Z ]*PRIVATE KEY-----)"),
}


_DIGIT = re.compile(r"\d")
# What may follow a match that could still grow into a longer one: a card or phone number
# goes on after a space or dash, an address after a dot ("a@b.co" -> "a@b.com").
_MAY_GROW = {"card": re.compile(r"[ .()-]*"), "phone": re.compile(r"[ .()-]*"), "email": re.compile(r"[.-]*"),
             "secret": re.compile(r"")}

# For `PII.calm` and `PII.hold` (`re`, faster than `regex` here, and never narrower than the
# patterns): what a kind's match, or the start of one, past `start` needs there. A card or a phone
# number ends in a digit, so one ending past `start` has one there, and one beginning there starts
# with a digit or "+": `_HOT` characters (a non-ASCII one only where `regex`'s own `\d` takes it,
# whose Unicode may be newer than `re`'s). A secret beginning there starts after a character that
# is no ASCII word character (its pattern's word boundary) with the first two characters of a
# prefix, or one of their first characters at the very end (`_SECRET_LEAD`, "--" or a last "-"
# for "-----BEGIN"). A whole secret anywhere has its full prefix (`_SECRET_MARK`), and that a "-",
# a "_" or "AKIA" (`_secret_marked`).
_HOT = {"card": "0123456789+", "phone": "0123456789+", "secret": "", "email": ""}
_SECRET_LEAD = re.compile(r"(?<![A-Za-z0-9_])(?:sk|AK|gh|xo|ll|[sAgxl]\Z)|--|-\Z")
_SECRET_MARK = re.compile(r"sk-|AKIA|gh[pousr]_|xox[baprs]-|llmd-|-----BEGIN ")

# What a kind's match must begin with (its first consumed character), where that is narrower than
# any text: without one at or after `start`, neither a partial nor a complete match can begin there,
# so `hold` skips that kind's partial search (most output has no digit). Any non-ASCII character
# counts as a digit here: `regex`'s digits (the patterns') include some newer than `re`'s.
_LEADS = {"card": re.compile(r"\d|[^\x00-\x7f]"), "phone": re.compile(r"[\d+]|[^\x00-\x7f]"),
          "secret": _SECRET_LEAD}


def _hot(kinds: Iterable[str]) -> tuple[re.Pattern[str], Any]:
    """Any character past ASCII or among `kinds`' `_HOT` ones (`re`: a negated class, fast), and
    the `_HOT` ones as `regex` reads them (its digits), for a text where the first finds one past ASCII."""
    hot = "".join(dict.fromkeys("".join(_HOT[k] for k in kinds)))
    fast = re.compile("[^" + "".join(re.escape(chr(i)) for i in range(128) if chr(i) not in hot) + "]")
    return fast, regex.compile("[" + regex.escape(hot).replace("0123456789", r"\d") + "]" if hot else "(?!)")


def _secret_marked(text: str) -> bool:
    """Whether `text` has a whole secret's prefix: without one, the secret pattern cannot match,
    and substring tests are cheaper than any search."""
    return ("-" in text or "_" in text or "AKIA" in text) and _SECRET_MARK.search(text) is not None


class PII:
    """E-mail addresses, phone numbers, payment cards (Luhn-checked) and API-key-like secrets;
    `action` block or redact (replaced by `[REDACTED:<kind>]`). Matched on the raw text (after
    NFKC, so full-width digits count) because redaction must cut the original span. Holds back
    only a trailing run that could still grow into one ("ann@exa", "4111 1111", "sk-ab")."""

    lookback = 48  # released characters re-read: an address that began there is still seen (then stopped)

    def __init__(self, name: str, kinds: Iterable[str] = ("email", "phone", "card", "secret"),
                 action: Action = "redact") -> None:
        self.name, self.action = name, action
        bad = [k for k in kinds if k not in _PII]
        if bad:
            raise ValueError(f"unknown PII kinds {bad}; choose from {sorted(_PII)}")
        self.kinds = list(kinds)
        self._hot, self._hot_rx = _hot(self.kinds)
        self._secret, self._email = "secret" in self.kinds, "email" in self.kinds

    def calm(self, text: str, start: int) -> bool:
        """No kind's match ends after `start` and none may begin there: nothing a kind needs past
        `start`, no whole secret's prefix anywhere (see `_HOT`). With "email" (any word may
        begin an address), what `scan` and `hold` answer."""
        if self._email:
            return not [m for m in self.scan(text, False) if m.end > start] and self.hold(text, start) == 0
        hot = self._hot.search(text, start)
        if hot is not None and (hot.group().isascii() or self._hot_rx.search(text, start) is not None):
            return False  # a non-ASCII character is hot only if the patterns' own `\d` takes it
        if not self._secret:
            return True
        if _SECRET_LEAD.search(text, start) is not None:
            return False
        return not _secret_marked(text)

    def scan(self, text: str, final: bool) -> list[Match]:
        out: list[Match] = []
        taken: list[tuple[int, int]] = []
        digits = _DIGIT.search(text) is not None
        marked = _secret_marked(text)
        if not digits and not marked and "@" not in text:
            return out  # every kind needs one of them (most text: the loop below skips each kind)
        for kind in ("secret", "email", "card", "phone"):  # a card is not also a phone
            if kind not in self.kinds or (kind == "email" and "@" not in text) or (
                    kind in ("card", "phone") and not digits) or (kind == "secret" and not marked):
                continue
            for m in _PII[kind].finditer(text):
                if not final and _MAY_GROW[kind].fullmatch(text, m.end()):
                    continue  # only separators follow: it might go on, so decide with more text
                if kind == "card" and not luhn_ok(re.sub(r"\D", "", m.group())):
                    continue
                if any(s < m.end() and m.start() < e for s, e in taken):
                    continue
                taken.append(m.span())
                out.append(Match(self.name, kind, self.action, m.start(), m.end(), f"[REDACTED:{kind}]"))
        return out

    def hold(self, text: str, start: int) -> int:
        """From the first place a kind's match may still begin: its partial match, or a complete one
        followed only by what it may go on with (`_MAY_GROW`, what `scan` waits on). A card is held
        whatever its Luhn sum so far: more digits change it."""
        first = len(text)
        for kind in self.kinds:
            lead = _LEADS.get(kind)
            if lead is not None and lead.search(text, start) is None:
                continue  # no character its match could begin with: nothing to hold for it
            s = undecided(_PII[kind], text, start, _MAY_GROW[kind])
            if s is not None and s < first:
                first = s
        return len(text) - first

    def screen(self, text: str) -> Match | None:
        """check_prompt as a plain call: the chain runs it on a prompt-pool thread (pure, thread-safe)."""
        found = self.scan(text, True)
        return found[0] if found else None

    async def check_prompt(self, text: str) -> Match | None:
        return self.screen(text)


class Degenerate:
    """Stops a looping generation: the text ends in the same span repeated `min_repeats`
    times (a span of 1 to `max_period` characters, covering at least `min_chars`). A span of
    fewer than `SHORT` characters must cover `short_chars`: a line of dashes or equals signs
    is a separator, not a loop. It saves tokens rather than guards content (`safety = False`):
    a client that forces the length (ignore_eos) gets its tokens, loops and all."""

    SHORT = 3  # spans this short ("-", "=-", "*-*") repeat in separator lines

    action: Action = "block"
    safety = False

    def __init__(self, name: str, min_repeats: int = 8, max_period: int = 64, min_chars: int = 48,
                 short_chars: int = 160) -> None:
        self.name, self.min_repeats, self.max_period, self.min_chars = name, min_repeats, max_period, min_chars
        self.short_chars = max(short_chars, min_chars)  # longer than a separator line (80-120 characters)

    @property
    def lookback(self) -> int:
        """Released characters re-read: the longest loop it looks for, whole."""
        return max(self.max_period * self.min_repeats, self.min_chars + self.max_period, self.short_chars)

    def calm(self, text: str, start: int) -> bool:
        """No loop ends `text` (nothing is ever held): at once where `scan`'s first look finds no
        candidate period (its last 4 characters nowhere in the `max_period` before them)."""
        n = len(text)
        if n < 8 or text.rfind(text[n - 4:], max(0, n - 4 - self.max_period), n - 1) < 0:
            return True
        return not self.scan(text, False)

    def hold(self, text: str, start: int) -> int:
        """Nothing: a loop only stops the stream (it is never cut out of the text), and it is found on
        released text as well as held text, so what left before is harmless repetition."""
        return 0

    def scan(self, text: str, final: bool) -> list[Match]:
        n = len(text)
        if n < 8:
            return []
        # Candidate periods: where the last 4 characters occurred before (str.rfind, C speed);
        # a tail repeating with period p has them again p characters back.
        suffix, lo = text[n - 4:], max(0, n - 4 - self.max_period)
        end = n - 1
        while (i := text.rfind(suffix, lo, end)) >= 0:
            end = i + 3
            p = n - 4 - i
            tail = text[n - p:]
            short = self._short(tail)
            span = p * max(self.min_repeats, -(-(self.short_chars if short else self.min_chars) // p))
            if span > n:
                if short:
                    continue  # a longer period may still fit
                break
            if tail.strip() and text[n - span:] == tail * (span // p):
                return [Match(self.name, f"repeat:{p}", "block", n - span, n)]
        return []

    def _short(self, tail: str) -> bool:
        """Whether `tail` is a unit shorter than SHORT repeated ("----" is "-" four times)."""
        return any(len(tail) % q == 0 and tail == tail[:q] * (len(tail) // q) for q in range(1, self.SHORT))


Ask = Callable[[str, str, float], Awaitable[str]]  # (model, text, timeout_s) -> the model's answer

GUARD_PROMPT = ("You are a content safety classifier. Answer with one word: 'unsafe' if the user text "
                "asks for or contains harmful content, otherwise 'safe'.")


class Classifier:
    """Asks a guard model served by this llmd whether a prompt is unsafe. Its answer is
    unsafe when it starts with `unsafe_answer`; a timeout or an error applies `on_error`:
    'open' lets the prompt through (logged), 'closed' refuses it. An `ask` with a `windows`
    method (llmd/filters/guard.py) cuts a prompt longer than the guard's context into
    overlapping windows, asked at once (each within `timeout_ms`); any unsafe window refuses
    the prompt, and a windowed prompt whose screening fails is refused whatever `on_error`
    says: a prompt is never passed unscreened because it was too long to read."""

    def __init__(self, name: str, model: str, ask: Ask, timeout_ms: float = 2000, on_error: str = "open",
                 unsafe_answer: str = "unsafe") -> None:
        self.name, self.model, self.ask = name, model, ask
        self.timeout_s, self.on_error, self.unsafe = timeout_ms / 1000, on_error, unsafe_answer.lower()
        self.windows: Callable[[str, str], list[str]] | None = getattr(ask, "windows", None)
        self.last_error: str | None = None

    async def check_prompt(self, text: str) -> Match | None:
        try:
            parts = [text] if self.windows is None else self.windows(self.model, text)  # the loop's tokenizer
        except Exception as e:  # the guard cannot read it at all: refused, never passed unscreened
            self.last_error = f"{type(e).__name__}: {e}"
            return Match(self.name, "unscreenable", "block")
        try:
            async with asyncio.timeout(self.timeout_s * len(parts)):
                answers = await asyncio.gather(*(self.ask(self.model, p, self.timeout_s) for p in parts))
        except Exception as e:  # a timeout, FilterError or the model's failure: the policy decides
            self.last_error = "timeout" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            if self.on_error == "closed" or len(parts) > 1:
                return Match(self.name, "unavailable", "block")
            return None
        self.last_error = None
        if any(a.strip().lower().startswith(self.unsafe) for a in answers):
            return Match(self.name, "unsafe", "block")
        return None
