"""Structured outputs under the shipped output filters, on the real engine: the shipped
config.toml as is (its blocklist, pii and loops filters, its holdback), 50 calls of the SDK's
`chat.completions.parse` with a schema of a number, a string and an enum field, half of them
asking for phone-like numbers (a hotline in the name, a population to ten decimals). Every one
must come back as JSON that parses into the model: a redaction stays inside a string value and a
float is a quantity, not a phone number (issue M: before the arbiter, 36 of these 50 parsed; the
other 14 had a long float, 12.3456789012, replaced by [REDACTED:phone] and were not JSON)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest

from tests import ahead
from tests.conftest import REPO, EngineServer, start_server_process, stop_process, tmp

MAX_TOKENS = 96
KEY = "sk-llmd-demo-change-me"  # the shipped config's demo tenant (its key is published there)
CITIES = ["New York City", "Paris", "Tokyo", "Lagos", "Lima"]
PROMPTS = [
    "Describe {c} as JSON: its name, population in millions and whether it is a city or a town.",
    "Give {c}'s population in millions with ten decimal places, e.g. 8.3360001234.",
    "Write {c}'s name followed by its tourist hotline number, like {c} +1 212-555-0147.",
    "What is the population of {c} in millions, to 10 decimals? Include the city hall phone 555-123-4567 in the name.",
    "JSON for {c}. The name should be '{c} (call 020 7946 0958)'. Population in millions, precise.",
    "{c}: name, population_millions (a float like 12.3456789012), kind.",
    "Is {c} a city or a town? Give its population in millions.",
    "Put the phone number 415-555-2671 in the name field, then {c}'s population in millions.",
    "Return {c}'s data. Population in millions as a long decimal number such as 21.9087654321.",
    "Summarise {c} in the requested format.",
]


# What an application sends with such a schema: the shape, and one example (without it, this
# 135M model at temperature 0 sometimes loops inside a value until max_tokens, which is no filter's doing).
SYSTEM = ("You answer with one JSON object with the keys name (a string), population_millions (a number) "
          'and kind ("city", "town" or "village"), for example {"name": "Berlin", "population_millions": 3.645, '
          '"kind": "city"}.')


class City(pydantic.BaseModel):
    name: str
    population_millions: float
    kind: Literal["city", "town", "village"]


def shipped_toml() -> str:
    """config.toml as shipped, on a free port and a database of the test's own."""
    text = (REPO / "config.toml").read_text().replace("{", "{{").replace("}", "}}")
    assert "\nport = 8000\n" in text
    return text.replace("\nport = 8000\n", '\nport = {port}\ndb_path = "{db}"\n', 1)


ahead.STARTERS["shipped"] = (lambda: start_server_process(shipped_toml(), tmp("shipped")),
                             lambda srv: stop_process(srv.proc))


@pytest.fixture(scope="module")
def shipped(smollm2_path: Path) -> Iterator[EngineServer]:
    """Started ahead of the engine tests (tests/ahead.py)."""
    yield ahead.take("shipped")
    ahead.finish("shipped")


def parse(srv: EngineServer, prompt: str) -> tuple[City | None, str]:
    """The parsed answer, or None and why not."""
    c = openai.OpenAI(base_url=srv.base, api_key=KEY, max_retries=0, timeout=120)
    try:
        r = c.chat.completions.parse(model="smollm2", messages=[{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": prompt}],
                                     response_format=City, max_tokens=MAX_TOKENS, temperature=0)
    except (openai.LengthFinishReasonError, openai.ContentFilterFinishReasonError) as e:
        return None, f"{type(e).__name__}: {e.completion.choices[0].message.content!r}"
    except (openai.APIError, pydantic.ValidationError) as e:
        return None, f"{type(e).__name__}: {str(e)[:300]}"
    msg = r.choices[0].message
    return msg.parsed, msg.content or ""


def test_fifty_parse_calls_under_the_shipped_filters(shipped: EngineServer) -> None:
    prompts = [p.format(c=c) for p in PROMPTS for c in CITIES]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: parse(shipped, p), prompts))
    bad = [(p, why) for p, (city, why) in zip(prompts, results, strict=True) if city is None]
    ok = len(prompts) - len(bad)
    assert ok == 50, f"{ok}/50 parsed; failures: {json.dumps(bad[:5], indent=1)}"
    for city, content in results:
        assert city is not None and city.kind in ("city", "town", "village")
        assert City.model_validate(json.loads(content)) == city  # the bytes themselves conform
    recs = [json.loads(line) for line in shipped.log_lines() if '"event": "request"' in line and line.startswith("{")]
    chats = [r for r in recs if r.get("endpoint") == "/v1/chat/completions"]
    assert len(chats) == 50 and all(r["status"] == "ok" for r in chats)
    phone_like = sum("REDACTED:phone" in content or _long_float(city) for city, content in results)
    assert phone_like > 0, "no answer had a phone-like number: the prompts no longer exercise the filters"


def _long_float(city: Any) -> bool:
    """A population written with enough digits for the phone pattern (8 or more)."""
    return sum(ch.isdigit() for ch in repr(city.population_millions)) >= 8
