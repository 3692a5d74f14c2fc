"""What a step of the fake backend costs: its knobs (a base, a share per sequence, prefill at a
rate), or, with `fake.step_model` set, the fitted step-time model of what the step computes, the
same function the simulator advances its replicas by (llmd.stepmodel)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from llmd.backends.base import Prompt
from llmd.config import FakeEngineConfig
from llmd.stepmodel import StepModel, StepShape


class StepReq(Protocol):
    """What pricing needs of a running request."""

    prompt: Prompt
    generated: int  # tokens decoded so far
    prefill_todo: int  # prompt tokens still to compute


def step_shape(batch: Sequence[StepReq], chunk_cap: int) -> StepShape:
    """The step's shape: each prefilling request computes up to `chunk_cap` more prompt tokens
    after those already done; every other one decodes a token over its prompt and output so far."""
    decode = [r for r in batch if r.prefill_todo <= 0]
    chunks = [(min(chunk_cap, r.prefill_todo), r.prompt.num_tokens - r.prefill_todo) for r in batch
              if r.prefill_todo > 0]
    return StepShape(decode_seqs=len(decode), prefill_tokens=sum(c for c, _ in chunks), prefill_seqs=len(chunks),
                     context_tokens=sum(r.prompt.num_tokens + r.generated + 1 for r in decode),
                     prefill_attn=float(sum(c * (before + c / 2) for c, before in chunks)),
                     longest_context=max((r.prompt.num_tokens + r.generated + 1 for r in decode), default=0))


class StepPricer:
    def __init__(self, cfg: FakeEngineConfig) -> None:
        self.cfg = cfg
        # Validated at config load; read again here so a backend built without a config file checks it too.
        self.model = StepModel.load(cfg.step_model) if cfg.step_model is not None else None

    def knobs(self, running: int, prefill_tokens: int = 0) -> float:
        """The knobs' cost: a base, a share per sequence, and `prefill_tokens` at `prefill_tokens_per_s`."""
        rate = self.cfg.prefill_tokens_per_s
        prefill = prefill_tokens / rate if rate else 0.0
        return (self.cfg.step_ms + self.cfg.step_ms_per_seq * running) / 1000.0 + prefill

    def price(self, batch: Sequence[StepReq]) -> float:
        ptps = self.cfg.prefill_tokens_per_step
        if self.model is not None:
            return self.model.seconds(step_shape(batch, ptps))
        return self.knobs(len(batch), sum(min(ptps, r.prefill_todo) for r in batch))
