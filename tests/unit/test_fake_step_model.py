"""The fake backend priced by a step model (`[models.fake] step_model`): config errors name the key
and the file; through real HTTP, every step costs exactly StepModel.seconds of what it computed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from llmd.backends.base import Prompt
from llmd.backends.fake_steps import step_plan, step_shape
from llmd.config import ConfigError, load_config
from llmd.stepmodel import StepModel, StepShape

# No context or attention terms: each step's price is then known from its StepRecord alone.
COEF = {"c_step": 0.003, "c_seq": 0.0004, "c_tok": 0.00002}

TOML = """
[server]
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 256
[models.engine]
max_model_len = 4096
[models.fake]
max_num_seqs = 8
prefill_tokens_per_step = 64
step_model = "{path}"
"""


def _model_file(tmp_path: Path, text: str | None = None) -> Path:
    p = tmp_path / "step.json"
    p.write_text(text if text is not None else StepModel(COEF, {"engine": "test"}).to_json())
    return p


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read step model"),
    ("{not json", "not a step model"),
    ('{"coef": {"c_warp": 1}}', "unknown terms"),
])
def test_config_error_names_the_key_and_the_file(tmp_path: Path, content: str | None, says: str) -> None:
    model = tmp_path / "step.json"
    if content is not None:
        model.write_text(content)
    cfg = tmp_path / "config.toml"
    cfg.write_text(TOML.format(path=model))
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    msg = str(e.value)
    assert str(cfg) in msg and "step_model" in msg and str(model) in msg and says in msg


class _R:
    def __init__(self, prompt: int, generated: int, todo: int) -> None:
        self.prompt, self.generated, self.prefill_todo = Prompt(list(range(prompt))), generated, todo


def test_step_shape_of_a_mixed_batch() -> None:
    # Two decoding (prompt 100 + 5 out, prompt 10 + 1 out), one prefilling 300 of 500 (200 done), and
    # one more prefilling 50 of 50; a step budget of 256 tokens: the decodes take 2, the first
    # prefill the remaining 254, the second nothing (it waits: a later one never overtakes).
    s = step_shape([_R(100, 5, 0), _R(10, 1, 0), _R(500, 0, 300), _R(50, 0, 50)], 256)
    assert s == StepShape(decode_seqs=2, prefill_tokens=254, prefill_seqs=1, context_tokens=105 + 11,
                          prefill_attn=254 * (200 + 127), longest_context=105)
    assert step_plan([_R(100, 5, 0), _R(500, 0, 300), _R(50, 0, 50)], 400) == [0, 300, 50]
    assert step_plan([_R(100, 5, 0), _R(500, 0, 300), _R(50, 0, 50)], 320) == [0, 300, 19]


async def test_steps_cost_what_the_model_says_through_http(make_server: Any, tmp_path: Path) -> None:
    srv = await make_server(TOML.format(path=_model_file(tmp_path)))
    model = StepModel(COEF)
    client = AsyncOpenAI(base_url=srv.base, api_key="x")
    import asyncio
    await asyncio.gather(*(client.completions.create(model="fake", prompt="word " * (40 * (i + 1)), max_tokens=12)
                           for i in range(4)))
    be = srv.backend()
    hist = list(be.stats.history)
    assert sum(r.prefill_tokens for r in hist) > 64 and any(r.decode_seqs >= 2 for r in hist)
    priced = [model.seconds(StepShape(r.decode_seqs, r.prefill_tokens, r.prefill_seqs)) for r in hist]
    # The engine charged exactly the model's price for every step, and slept at least that long.
    assert be.busy_s == pytest.approx(sum(priced), rel=1e-9)
    assert all(r.duration >= p * 0.999 for r, p in zip(hist, priced, strict=True))
    # The knobs (step_ms 5 + 0.2/seq) would have priced them differently.
    assert be.busy_s != pytest.approx(sum(be.step_seconds(r.running) for r in hist), rel=0.01)
    await client.close()
