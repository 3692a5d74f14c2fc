"""What the fake engine says in each case, and what the client must then receive.

The prompt carries a `[[say:...]]` marker: the fake backend emits exactly that text (three
characters a token), under a JSON grammar too. The secret a filter acts on comes after a
harmless opening, so a fault or a cancellation strikes while tokens flow and before the
filter's match; a `|` in the script is left out of the output, so the prompt itself does not
hold the phrase it asks for."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tests.matrix.features import Case

EMAIL = "john.doe@example.com"
PHONE = 5551234567  # a phone-length integer: in an integer field it cannot be redacted, so it stops
QUANTITY = 8336817.5  # phone-like digits with a fraction: a quantity, never screened as a phone
# Pieces of what must never leave the server: the start of each secret, so a partial send counts.
NEVER_SENT = ("john.d", "@example", "555123", "forbid")
OPENING = "All is calm along the river today, and the boats drift slowly past the old mill. " * 3
LONG = "The water keeps moving under the bridge while the town sleeps on. " * 40
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"notes": {"type": "string"}, "city": {"type": "string"}, "population": {"type": "number"},
                   "kind": {"enum": ["town", "city"]}, "code": {"type": "integer"}},
    "required": ["notes", "city", "population", "kind", "code"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "record_city", "description": "Record a city.",
                                         "parameters": SCHEMA}}
MAX_TOKENS = 2000


@dataclass(frozen=True)
class Script:
    say: str  # what the engine is told to emit
    expected: str | None  # what the client receives when the run completes; None: not complete


def structured(case: Case) -> bool:
    return case["format"] == "json" or case["tools"] != "none"


def _opening(case: Case) -> str:
    """Long enough that a fault struck at the first chunk a loaded client reads finds it running."""
    return OPENING * (4 if case["fault"] != "none" else 1) + (LONG if case["end"] != "complete" else "")


def _text(case: Case) -> Script:
    body = _opening(case)
    if case["filter"] == "redact":
        say = f"Write to {EMAIL} soon. {body}The end." if case["end"] != "complete" else \
            f"{body}Write to {EMAIL} soon. The end."
        return Script(say, say.replace(EMAIL, "[REDACTED:email]"))
    if case["filter"] == "stop":
        return Script(f"{body}Then the forbid|den phrase appears. The end.", None)
    return Script(f"{body}The end.", f"{body}The end.")


def _json(case: Case) -> Script:
    notes = _opening(case)
    doc: dict[str, Any] = {"notes": notes, "city": "Springfield", "population": QUANTITY, "kind": "town",
                           "code": 42}
    if case["filter"] == "redact":
        doc["city"] = f"Write to {EMAIL}"
        if case["end"] != "complete":  # the address before the long part, so it is screened before the end
            doc = {"city": doc["city"], **{k: v for k, v in doc.items() if k != "city"}}
        return Script(json.dumps(doc), json.dumps(doc).replace(EMAIL, "[REDACTED:email]"))
    if case["filter"] == "stop":
        return Script(json.dumps(doc | {"code": PHONE}), None)
    return Script(json.dumps(doc), json.dumps(doc))


def script(case: Case) -> Script:
    return _json(case) if structured(case) else _text(case)
