"""The arbiter of a constrained output's bytes: what an output filter may do inside JSON.

A request that promises JSON (response_format json_object or json_schema, a required or named
tool) hands its output to two owners: the engine's grammar and the output filters. The window
(chain.py) asks the arbiter about every match before acting on it, so a filter can never make
the document invalid:

- a match inside a free string *value* is redacted with the filter's replacement, JSON-escaped,
  so the string stays a string (and its span widened to whole escape sequences);
- a match in a key, in a string the schema pins (enum, const, pattern, format, a length bound),
  in an integer, in structure or anything else stops the choice (finish_reason content_filter):
  no replacement there keeps the document valid;
- a number with a fraction or an exponent, or in a field typed `number`, is a quantity, not an
  identifier: the PII phone rule does not apply to it (8.3360001 is a population, not a phone);
- a match touching a number the output has not finished yet waits for it (`hold`): whether it
  is a quantity is known only once the number ends.

The output is read incrementally, one character state machine whose state is kept at the end of
the released text; the held tail is re-read from there on each feed (it is short and may change
as redactions are made).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llmd.filters.base import Match

Verdict = Literal["redact", "stop", "skip", "wait", "as_is"]
QUANTITY_EXEMPT = frozenset({"phone"})  # rules that do not screen quantities (numbers with a fraction, etc.)
_PINNING = ("enum", "const", "pattern", "format", "minLength", "maxLength", "contentEncoding", "not")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_PLAIN = re.compile(r'[^"\\]+')
_SPACE = re.compile(r"[ \t\r\n]+")
Alts = tuple[dict[str, Any], ...]  # a position's schema: any of these (empty dict: anything)
ANY: Alts = ({},)


@dataclass(frozen=True)
class Token:
    """A key, string, number or literal of the document, in document offsets (end None: unfinished)."""

    kind: Literal["key", "string", "number", "literal", "json"]  # json: an object embedded in text
    start: int
    end: int | None
    free: bool = False  # a string value any replacement string keeps valid
    quantity: bool = False  # a number with a fraction or exponent, or one the schema types `number`


@dataclass(frozen=True)
class _Frame:
    container: Literal["o", "a"]
    schema: Alts
    expect: Literal["key", "colon", "value", "comma"]
    key: str = ""
    index: int = 0


@dataclass
class _State:
    pos: int = 0
    stack: tuple[_Frame, ...] = ()
    done: bool = False  # the top-level value ended
    broken: bool = False  # not JSON: everything from here on is "other"
    tok: Token | None = None  # the token in progress
    escape: int = 0  # inside a string: 0 none, 1 after a backslash, 2-5 the \\u digits left + 1
    key_chars: list[str] = field(default_factory=list)
    region: Token | None = None  # embedded: the JSON object being read (None: in text)


class Schema:
    """A JSON schema read for the arbiter: which alternatives apply below a key or an index."""

    def __init__(self, root: dict[str, Any] | None) -> None:
        self.root = root

    def top(self) -> Alts:
        return ANY if self.root is None else self.expand(self.root)

    def expand(self, schema: Any, depth: int = 0) -> Alts:
        """`schema` with $ref resolved and anyOf/oneOf/allOf flattened into alternatives."""
        if not isinstance(schema, dict) or depth > 16:
            return ({},) if schema is True or depth > 16 else ()
        if "$ref" in schema and self.root is not None:
            target: Any = self.root
            for part in str(schema["$ref"]).removeprefix("#/").split("/"):
                target = target.get(part, {}) if isinstance(target, dict) else {}
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self.expand(target, depth + 1) + ((rest,) if set(rest) & set(_PINNING) else ())
        out: Alts = ()
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in schema.get(key) or ():
                out += self.expand(sub, depth + 1)
        own = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "allOf")}
        return (*out, own) if own or not out else out

    def child(self, alts: Alts, key: str | None, index: int) -> Alts:
        """The alternatives for a member (`key`) or an array item (`index`)."""
        out: Alts = ()
        for alt in alts:
            if key is not None:
                props = alt.get("properties") or {}
                if key in props:
                    out += self.expand(props[key])
                    continue
                pats = [s for p, s in (alt.get("patternProperties") or {}).items() if _keyed(p, key)]
                extra = alt.get("additionalProperties", True)
                for s in pats or [extra]:
                    out += self.expand(s)
            else:
                prefix = alt.get("prefixItems") or []
                out += self.expand(prefix[index] if index < len(prefix) else alt.get("items", True))
        return out or ANY


def _keyed(pattern: str, key: str) -> bool:
    """Whether a patternProperties pattern names `key`; one Python cannot read counts (its
    schema then applies too: more alternatives only pin more)."""
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return True


def _accepts(alt: dict[str, Any], kind: str) -> bool:
    t = alt.get("type")
    if t is None:
        return True
    types = [t] if isinstance(t, str) else list(t)
    return kind in types or (kind == "number" and "integer" in types)


def free_string(alts: Alts) -> bool:
    """Every alternative that takes a string takes any string (nothing pins its value or length)."""
    return all(not any(k in a for k in _PINNING) for a in alts if _accepts(a, "string"))


def typed_number(alts: Alts) -> bool:
    """Every alternative that takes a number types it `number` (a quantity), none `integer`."""
    takes = [a for a in alts if _accepts(a, "number")]
    return bool(takes) and all(a.get("type") == "number" or (isinstance(a.get("type"), list)
                               and "number" in a["type"] and "integer" not in a["type"]) for a in takes)


class JsonArbiter:
    """One choice's constrained output: its JSON read so far, and each match's verdict.

    `choice`: the output is one of fixed strings (nothing in it may change). `embedded`: the output
    is text with JSON objects in it (`auto` tool calls in a JSON-based format: hermes, llama3_json,
    the fake's `<<name {...}>>`): a match in the text is the filter's to act on as usual, one that
    touches an object is judged as in a constrained output, so a call's arguments still parse."""

    KEEP = 512  # finished tokens kept behind the released end (the filters' lookback is shorter)

    def __init__(self, schema: dict[str, Any] | None = None, choice: bool = False, embedded: bool = False) -> None:
        self.schema = Schema(schema)
        self.choice, self.embedded = choice, embedded
        self.state = _State()
        self.tokens: list[Token] = []  # finished or open tokens of the released text
        self._view: tuple[str, bool, list[Token], _State] | None = None

    # -- reading ---------------------------------------------------------------
    def commit(self, released: str) -> None:
        """The text the client now has: read it for good."""
        if not released:
            return
        self.state, new = self._read(self.state, released)
        # unfinished ones are re-read: they are in `new`, finished or not
        self.tokens = [t for t in self.tokens if t.end is not None] + new
        floor = self.state.pos - self.KEEP
        if self.tokens and (self.tokens[0].end or floor) < floor:
            self.tokens = [t for t in self.tokens if t.end is None or t.end >= floor]
        self._view = None

    def view(self, pending: str, final: bool) -> list[Token]:
        """Tokens of the released tail and of `pending` (the held text, as it stands now)."""
        if self._view is not None and self._view[0] == pending and self._view[1] == final:
            return self._view[2]
        state, new = self._read(self.state, pending)
        toks = [t for t in self.tokens if t.end is not None] + new
        if final:  # the output ends: so do its unfinished tokens
            toks = [t if t.end is not None else replace(t, end=state.pos) for t in toks]
        self._view = (pending, final, toks, state)
        return toks

    def _read(self, s: _State, text: str) -> tuple[_State, list[Token]]:
        s = replace(s, key_chars=list(s.key_chars))
        out: list[Token] = []
        out += [t for t in (s.region, s.tok) if t is not None]  # reopened: updated as they go on
        i, n = 0, len(text)
        while i < n:
            if self.embedded and (s.region is None or s.done or s.broken):
                i = self._text(s, text, i, out)
                continue
            if s.broken or (s.done and not text[i].isspace()):
                s.broken = True
                s.pos += n - i
                break
            i = self._step(s, text, i, out)
        return s, out

    def _text(self, s: _State, text: str, i: int, out: list[Token]) -> int:
        """Embedded: end the object just read (or abandoned), then skip text to the next `{`."""
        if s.region is not None:
            done = replace(s.region, end=s.pos)
            out[:] = [done if t is s.region else t for t in out]
            if done not in out:
                out.append(done)
            s.region, s.stack, s.tok, s.done, s.broken = None, (), None, False, False
        j = text.find("{", i)
        j = len(text) if j < 0 else j
        s.pos += j - i
        if j < len(text):
            s.region = Token("json", s.pos, None)
            out.append(s.region)
        return j

    def _step(self, s: _State, text: str, i: int, out: list[Token]) -> int:
        """Read from text[i]; return where reading goes on."""
        tok = s.tok
        if tok is not None and tok.kind in ("key", "string"):
            return self._in_string(s, text, i, out)
        ch = text[i]
        if tok is not None:  # a number or literal: goes on while its characters do
            if ch in _NUMBER_CHARS if tok.kind == "number" else ch.isalpha():
                if tok.kind == "number" and ch in ".eE" and not tok.quantity:
                    self._set(s, out, replace(tok, quantity=True))
                s.pos += 1
                return i + 1
            self._set(s, out, replace(tok, end=s.pos))
            s.tok = None
            self._after_value(s)
            return i
        if m := _SPACE.match(text, i):
            s.pos += m.end() - i
            return m.end()
        self._structure(s, ch, out)
        s.pos += 1
        return i + 1

    def _in_string(self, s: _State, text: str, i: int, out: list[Token]) -> int:
        tok = s.tok
        assert tok is not None
        if s.escape:
            s.escape = (5 if text[i] == "u" else 0) if s.escape == 1 else s.escape - 1
            if s.escape == 1:
                s.escape = 0  # the last \\u digit
            if tok.kind == "key":
                s.key_chars.append(text[i])
            s.pos += 1
            return i + 1
        if m := _PLAIN.match(text, i):
            if tok.kind == "key":
                s.key_chars.append(m.group())
            s.pos += m.end() - i
            return m.end()
        ch = text[i]
        s.pos += 1
        if ch == "\\":
            s.escape = 1
            if tok.kind == "key":
                s.key_chars.append(ch)
            return i + 1
        self._set(s, out, replace(tok, end=s.pos))  # the closing quote
        s.tok = None
        if tok.kind == "key":
            raw = "".join(s.key_chars)
            try:
                key = json.loads(f'"{raw}"')
            except ValueError:
                key = raw
            s.stack = (*s.stack[:-1], replace(s.stack[-1], expect="colon", key=key))
        else:
            self._after_value(s)
        return i + 1

    def _set(self, s: _State, out: list[Token], tok: Token) -> None:
        if out and out[-1].start == tok.start:
            out[-1] = tok
        else:
            out.append(tok)
        s.tok = tok

    def _here(self, s: _State) -> Alts:
        """The schema of the value that starts now."""
        if not s.stack:
            return self.schema.top()
        f = s.stack[-1]
        return self.schema.child(f.schema, f.key if f.container == "o" else None, f.index)

    def _structure(self, s: _State, ch: str, out: list[Token]) -> None:
        if not s.stack:
            self._value(s, ch, out)  # the top-level value (anything else breaks it)
            return
        top = s.stack[-1]
        rest, expect = s.stack[:-1], top.expect
        if ch == '"' and expect == "key":
            s.key_chars = []
            self._set(s, out, Token("key", s.pos, None))
        elif ch == ":" and expect == "colon":
            s.stack = (*rest, replace(top, expect="value"))
        elif ch == "," and expect == "comma":
            s.stack = (*rest, replace(top, expect="key" if top.container == "o" else "value", index=top.index + 1))
        elif ch in "}]" and (top.container == "o") == (ch == "}") and expect in (
                ("comma", "key") if ch == "}" else ("comma", "value")):
            s.stack = rest
            self._after_value(s)
        elif expect == "value":
            self._value(s, ch, out)
        else:
            s.broken = True

    def _value(self, s: _State, ch: str, out: list[Token]) -> None:
        alts = self._here(s)
        if ch in "{[":
            s.stack = (*s.stack, _Frame("o" if ch == "{" else "a", alts, "key" if ch == "{" else "value"))
        elif ch == '"':
            self._set(s, out, Token("string", s.pos, None, free=not self.choice and free_string(alts)))
        elif ch in _NUMBER_CHARS:
            self._set(s, out, Token("number", s.pos, None, quantity=typed_number(alts)))
        elif ch.isalpha():
            self._set(s, out, Token("literal", s.pos, None))
        else:
            s.broken = True

    def _after_value(self, s: _State) -> None:
        if not s.stack:
            s.done = True
            return
        s.stack = (*s.stack[:-1], replace(s.stack[-1], expect="comma"))

    # -- judging ---------------------------------------------------------------
    def judge(self, tokens: list[Token], text: str, base: int, m: Match) -> tuple[Verdict, int, int, str]:
        """What the window does with `m` (offsets in `text`, which starts at document offset
        `base`): redact (span widened to whole escapes, replacement escaped), stop, skip, wait."""
        a, b = base + m.start, base + m.end
        overlaps = [t for t in tokens if t.start < b and (t.end is None or a < t.end)]
        if self.embedded and not any(t.kind == "json" for t in overlaps):
            return "as_is", m.start, m.end, m.replacement  # in the text around the objects
        tok = next((t for t in overlaps if t.kind != "json"), None)
        if tok is None or self.choice:
            return "stop", m.start, m.end, ""
        inside = tok.start < a and (tok.end is None or b < tok.end)  # within the quotes, for a string
        if tok.kind == "number" and tok.start <= a and (tok.end is None or b <= tok.end):
            if m.rule not in QUANTITY_EXEMPT or (tok.end is not None and not tok.quantity):
                return "stop", m.start, m.end, ""
            return ("skip" if tok.quantity else "wait"), m.start, m.end, ""  # wait: its end tells
        if tok.kind != "string" or not tok.free or not inside:
            return "stop", m.start, m.end, ""
        lo, hi = _widen(text, tok.start - base + 1, m.start, m.end)
        if tok.end is not None and hi + base >= tok.end:
            return "stop", m.start, m.end, ""
        return "redact", lo, hi, json.dumps(m.replacement, ensure_ascii=False)[1:-1]

    def hold(self, tokens: list[Token], text: str, base: int) -> int:
        """Characters at the end of `text` to hold: an unfinished number not yet known to be a
        quantity (only its end says), so a phone-like match in it is judged whole."""
        if tokens and tokens[-1].end is None and tokens[-1].kind == "number" and not tokens[-1].quantity:
            return len(text) - max(0, tokens[-1].start - base)
        return 0


def _widen(text: str, content: int, a: int, b: int) -> tuple[int, int]:
    """[a, b) widened so it neither starts nor ends inside an escape sequence of the string whose
    content starts at `content` (offsets in `text`; content before the text starts counts from 0)."""
    i = max(0, content)
    while i < b:
        if text[i] == "\\":
            end = i + (6 if i + 1 < len(text) and text[i + 1] == "u" else 2)
            if i < a < end:
                a = i
            if i < b < end:
                b = end
            i = end
        else:
            i += 1
    return a, min(b, len(text))
