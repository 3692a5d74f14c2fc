"""The SLO's latency is the client's: time to first token and inter-token gaps are taken as the
gateway sends tokens, after the output filters' holdback, not as the engine makes them."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

STEP_S = 0.05
TOML = f"""
[server]
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = {STEP_S * 1000}
step_ms_per_seq = 0
[models.filters]
output = ["bl"]
[[filters]]
name = "bl"
type = "blocklist"
words = ["abcdefghijklmnopqr zz"]
"""
# Three characters a token: "abc" ... "pqr" could each still become the blocked phrase, so the
# filter holds them; " an" cannot, and the seven go out together.
SAY = "[[say:abcdefghijklmnopqr and then some more words]]"
HELD = 6


async def test_ttft_includes_the_filters_holdback(make_server: Any, records: list[dict[str, Any]]) -> None:
    live = await make_server(TOML)
    c = openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0)
    t0 = time.monotonic()
    first: float | None = None
    text = ""
    async for chunk in await c.chat.completions.create(model="fake", stream=True, max_tokens=40,
                                                       messages=[{"role": "user", "content": SAY}]):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic() - t0
            text += chunk.choices[0].delta.content
    assert text.startswith("abcdefghijklmnopqr and") and first is not None
    (rec,) = [r for r in records if r["endpoint"] == "/v1/chat/completions"]
    engine_first = rec["queue_time_s"] + rec["prefill_s"]  # arrival to the engine's first token
    # The first token left only once the filter let the held ones go: HELD engine steps later.
    assert rec["ttft_s"] >= engine_first + (HELD - 1) * STEP_S, rec
    assert first >= rec["ttft_s"]  # the client saw it after the gateway sent it
    # Gaps are per token sent: the first chunk's seven tokens have none between them.
    assert len(rec["itl_samples"]) <= rec["output_tokens"] - (HELD + 1)

    async with httpx.AsyncClient() as h:
        fams = {f.name: f for f in text_string_to_metric_families((await h.get(live.url + "/metrics")).text)}
    ttft = {s.name: s for s in fams["llmd:time_to_first_token_seconds"].samples
            if s.labels.get("class") == "interactive" and s.name.endswith(("_sum", "_count"))}
    assert ttft["llmd:time_to_first_token_seconds_count"].value == 1
    assert ttft["llmd:time_to_first_token_seconds_sum"].value == rec["ttft_s"]


async def test_non_streaming_text_is_timed_when_the_filters_release_it(make_server: Any,
                                                                      records: list[dict[str, Any]]) -> None:
    live = await make_server(TOML)
    c = openai.AsyncOpenAI(base_url=live.base, api_key="none", max_retries=0)
    out = await c.completions.create(model="fake", prompt=SAY, max_tokens=40)
    assert out.choices[0].text.startswith("abcdefghijklmnopqr and")
    (rec,) = [r for r in records if r["endpoint"] == "/v1/completions"]
    assert rec["ttft_s"] >= rec["queue_time_s"] + rec["prefill_s"] + (HELD - 1) * STEP_S, rec
    assert rec["ttft_s"] < rec["total_time_s"]


async def test_a_reload_changes_the_slo_series(make_server: Any) -> None:
    import tomllib

    from llmd.config import Config

    live = await make_server(TOML)

    async def targets() -> dict[str, tuple[str, float]]:
        async with httpx.AsyncClient() as h:
            text = (await h.get(live.url + "/metrics")).text
        return {f.name: (f.samples[0].labels.get("le", ""), f.samples[0].value)
                for f in text_string_to_metric_families(text) if f.name.startswith("llmd:slo_")}

    assert await targets() == {"llmd:slo_ttft_p95_seconds": ("1.0", 1.0), "llmd:slo_itl_p95_seconds": ("0.2", 0.2),
                               "llmd:slo_availability": ("", 0.995)}
    new = Config.model_validate(tomllib.loads(TOML + "[slo.models.fake]\nttft_p95_s = 2.5\navailability = 0.99\n"))
    live.node.reload(new)
    assert await targets() == {"llmd:slo_ttft_p95_seconds": ("2.5", 2.5), "llmd:slo_itl_p95_seconds": ("0.2", 0.2),
                               "llmd:slo_availability": ("", 0.99)}
