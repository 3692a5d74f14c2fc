"""The arbiter of constrained output (llmd/filters/structured.py) behind the real output window:
a redaction lands only inside a free JSON string value and keeps the document valid; a match in a
key, a pinned string (enum, pattern, const, a length bound) or an integer stops the choice; a
quantity (a fraction, an exponent, a `number` field) is not a phone number. Every case is fed in
pieces of every size, so state carried across chunks (escapes, keys, numbers) is exercised."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from llmd.filters.base import Match
from llmd.filters.builtin import PII, Blocklist, Degenerate
from llmd.filters.chain import OutputWindow
from llmd.filters.structured import JsonArbiter, Schema, free_string, typed_number
from llmd.protocol.requests import Tool
from llmd.tools import _required_schema

PHONE = "555-123-4567"
CITY: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population_millions": {"type": "number"},
                   "kind": {"type": "string", "enum": ["city", "town"]}, "code": {"type": "integer"},
                   "zip": {"type": "string", "pattern": "^[0-9-]+$"}, "short": {"type": "string", "maxLength": 20},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "home": {"$ref": "#/$defs/Place"}, "either": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "$defs": {"Place": {"type": "object", "properties": {"street": {"type": "string"},
                                                          "country": {"const": "FR"}}}},
}


class Quoting:
    """A team's filter whose replacement has JSON's special characters in it."""

    name = "quoting"

    def scan(self, text: str, final: bool) -> list[Match]:
        i = text.find("secret")
        return [Match(self.name, "q", "redact", i, i + 6, 'a "quoted"\\ word')] if i >= 0 else []

    def hold(self, text: str, start: int) -> int:
        return next((len(text) - i for i in range(max(start, len(text) - 5), len(text))
                     if "secret".startswith(text[i:])), 0)


def window(schema: dict[str, Any] | None = CITY, choice: bool = False, email: bool = False,
           embedded: bool = False) -> OutputWindow:
    kinds = ("email", "phone", "card", "secret") if email else ("phone", "card", "secret")
    return OutputWindow([Blocklist("words", ["forbidden phrase"]), PII("pii", kinds), Quoting(), Degenerate("loops")],
                        32, arbiter=JsonArbiter(schema, choice=choice, embedded=embedded))


def run(text: str, size: int, **kw: Any) -> tuple[str, Match | None]:
    """Feed `text` in pieces of `size` characters, one token each; what left, and a stop."""
    w, out = window(**kw), []
    for i in range(0, len(text), size):
        piece, hit = w.feed(text[i:i + size], 1, False)
        if hit is not None:
            return "".join(out), hit
        out.append(piece)
    piece, hit = w.feed("", 0, True)
    return "".join(out) + piece, hit


def every_split(text: str, **kw: Any) -> set[tuple[str, str | None]]:
    """The outcomes over every piece size; a well-behaved arbiter has one."""
    runs = (run(text, size, **kw) for size in range(1, len(text) + 1))
    return {(out, hit.label if hit else None) for out, hit in runs}


def redacted(doc: dict[str, Any], **kw: Any) -> dict[str, Any]:
    (out, hit), = every_split(json.dumps(doc), **kw)
    assert hit is None
    return json.loads(out)


def stopped(text: str, label: str = "pii/phone", **kw: Any) -> None:
    outcomes = every_split(text, **kw)
    assert {h for _, h in outcomes} == {label}
    assert all(PHONE[:3] not in out or PHONE not in out for out, _ in outcomes)


def test_a_phone_number_in_a_string_value_is_redacted_and_the_document_stays_valid() -> None:
    got = redacted({"name": f"call {PHONE} now", "population_millions": 8.336, "kind": "city"})
    assert got == {"name": "call [REDACTED:phone] now", "population_millions": 8.336, "kind": "city"}
    nested = {"home": {"street": f"{PHONE} Main St"}, "tags": ["a", f"x {PHONE}"], "either": PHONE}
    assert redacted(nested) == {"home": {"street": "[REDACTED:phone] Main St"},
                                "tags": ["a", "x [REDACTED:phone]"], "either": "[REDACTED:phone]"}


def test_json_object_without_a_schema_redacts_any_string_value() -> None:
    doc = {"a": [{"b": f"mail ann@example.com or {PHONE}"}], "c": 1}
    assert redacted(doc, schema=None, email=True) == {"a": [{"b": "mail [REDACTED:email] or [REDACTED:phone]"}],
                                                      "c": 1}


@pytest.mark.parametrize("field", ["kind", "zip", "short"])
def test_a_pinned_string_cannot_be_redacted_so_the_choice_stops(field: str) -> None:
    stopped(json.dumps({"name": "x", field: PHONE}))


def test_a_const_behind_a_ref_is_pinned_too() -> None:
    stopped(json.dumps({"home": {"country": PHONE}}))


def test_a_match_in_a_key_stops() -> None:
    stopped(json.dumps({"name": "x", PHONE: "y"}), schema=None)
    stopped(json.dumps({"forbidden phrase": 1}), label="words/word:0", schema=None)


def test_quantities_are_not_phone_numbers() -> None:
    doc = {"population_millions": 8.3360001234, "code": 1, "name": "x"}
    assert redacted(doc) == doc  # the reported bug: this float read as a phone number
    assert redacted({"a": 83360001234.5, "b": 5.551234567e9}, schema=None) == {"a": 83360001234.5, "b": 5.551234567e9}
    # a `number` field is a quantity whatever its digits
    assert redacted({"population_millions": 5551234567}) == {"population_millions": 5551234567}


def test_an_integer_of_phone_length_stops() -> None:
    stopped('{"code": 5551234567}')
    stopped('{"n": 5551234567}', schema=None)
    stopped('{"n": [1, 5551234567]}', schema=None)


def test_an_unfinished_number_waits_whole_then_is_judged() -> None:
    w = window(schema=None)
    assert w.feed('{"n": 555', 1, False) == ('{"n": ', None)
    assert w.feed("1234567", 1, False) == ("", None)
    assert w.feed(".25", 1, False) == ("", None)
    assert w.feed("}", 1, False) == ("5551234567.25}", None)


def test_escapes_across_chunks_and_a_replacement_that_needs_escaping() -> None:
    doc = {"name": f'she said "{PHONE}"\\ and \u00e9 \n then secret'}
    got = redacted(doc)
    assert got == {"name": 'she said "[REDACTED:phone]"\\ and \u00e9 \n then a "quoted"\\ word'}
    ascii_doc = json.dumps({"name": "\u00e9\u00e9 secret \u00e9"})  # \u00e9 escapes around the match
    (out, hit), = every_split(ascii_doc)
    assert hit is None and json.loads(out) == {"name": '\u00e9\u00e9 a "quoted"\\ word \u00e9'}


def test_a_string_value_that_only_looks_like_a_key_is_a_value() -> None:
    text = '{"name": "a\\": \\"' + PHONE + '", "kind": "city"}'
    (out, hit), = every_split(text)
    assert hit is None and json.loads(out) == {"name": 'a": "[REDACTED:phone]', "kind": "city"}


def test_a_fixed_choice_and_text_that_is_not_json_only_stop() -> None:
    stopped(f"call {PHONE}", choice=True)
    stopped(f'{{"a": 1}} and then {PHONE}', schema=None)


def test_required_tools_pin_the_name_and_free_the_arguments() -> None:
    tool = Tool.model_validate({"type": "function", "function": {
        "name": "dial", "parameters": {"type": "object", "properties": {"note": {"type": "string"}}}}})
    schema = _required_schema([tool], parallel=False)
    got = redacted([{"name": "dial", "parameters": {"note": f"ring {PHONE}"}}], schema=schema)  # type: ignore[arg-type]
    assert got == [{"name": "dial", "parameters": {"note": "ring [REDACTED:phone]"}}]
    stopped(json.dumps([{"name": PHONE, "parameters": {}}]), schema=schema)


def test_schema_reading() -> None:
    s = Schema(CITY)
    top = s.top()
    assert free_string(s.child(top, "name", 0)) and not free_string(s.child(top, "kind", 0))
    assert typed_number(s.child(top, "population_millions", 0)) and not typed_number(s.child(top, "code", 0))
    assert not typed_number(s.child(top, "unknown", 0)) and free_string(s.child(top, "unknown", 0))
    assert not free_string(s.child(s.child(top, "home", 0), "country", 0))
    odd = Schema({"type": "object", "patternProperties": {"^x": {"enum": ["a"]}, "(?<bad": {"type": "string"}},
                  "additionalProperties": {"type": "string"}})
    assert not free_string(odd.child(odd.top(), "xy", 0)) and free_string(odd.child(odd.top(), "(y", 0)) is True


def test_random_documents_and_splits_never_break_json_or_leak() -> None:
    rng = random.Random(7)
    values = [f"x {PHONE}", "plain", 8.3360001234, 5551234567, "forbidden phrase", "a\\b\"c", 12, None, True]
    for _ in range(150):
        doc = {rng.choice(["name", "tags", "q", "n"]) + str(i): rng.choice(values) for i in range(rng.randint(1, 5))}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5)
        out, hit = run(text, rng.randint(1, 9), schema=None)
        assert PHONE not in out and "forbidden phrase" not in out and "5551234567" not in out
        if hit is None:
            got = json.loads(out)
            assert set(got) == set(doc)
            assert all(got[k] == v for k, v in doc.items() if not isinstance(v, str) or PHONE not in v)
        else:
            assert hit.label in ("pii/phone", "words/word:0")


def test_auto_tool_calls_judge_the_json_inside_the_text() -> None:
    """`auto`: text with calls in it (here the fake parser's `<<name {...}>>`): the text is redacted
    as usual, a call's string argument in place, its integer stops, its quantity is kept."""
    text = f'Ring {PHONE} {{or}} <<dial {{"note": "ring {PHONE}", "m": 8.3360001234}}>> then {PHONE}.'
    (out, hit), = every_split(text, schema=None, embedded=True)
    assert hit is None
    assert out == ('Ring [REDACTED:phone] {or} <<dial {"note": "ring [REDACTED:phone]", "m": 8.3360001234}>> '
                   'then [REDACTED:phone].')
    stopped('Sure. <<dial {"n": 5551234567}>>', schema=None, embedded=True)
    stopped(f'Sure. <<dial {{"{PHONE}": 1}}>>', schema=None, embedded=True)
    (out, hit), = every_split(f"{{not json}} {PHONE}", schema=None, embedded=True)  # braces in prose
    assert hit is None and out == "{not json} [REDACTED:phone]"


def test_a_loop_inside_an_unfinished_number_still_stops() -> None:
    """Only the phone rule waits for a number's end; the loop detector stops a runaway number."""
    w, hit = window(schema=None), None
    pieces = ['{"n": 1.', *["000"] * 100]
    for p in pieces:
        _, hit = w.feed(p, 1, False)
        if hit is not None:
            break
    assert hit is not None and hit.label.startswith("loops/")
