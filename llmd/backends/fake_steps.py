"""What a step of the fake backend costs: its knobs (a base, a share per sequence, prefill at a
rate), or, with `fake.step_model` set, the fitted step-time model of what the step computes, the
same function the simulator advances its replicas by (llmd.stepmodel)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from llmd.backends.base import Prompt
from llmd.config import FakeEngineConfig
from llmd.stepmodel import StepModel, StepShape
from llmd.stepplan import chunk_attention, decode_context, prefill_chunks


class StepReq(Protocol):
    """What pricing needs of a running request."""

    prompt: Prompt
    generated: int  # tokens decoded so far
    prefill_todo: int  # prompt tokens still to compute


def step_plan(batch: Sequence[StepReq], budget: int) -> list[int]:
    """Each prefilling request's chunk this step, in batch order (llmd.stepplan: decodes first,
    then chunks from what is left of the step's token budget); 0 for a decoding one or one the
    budget did not reach."""
    pre = [r.prefill_todo for r in batch if r.prefill_todo > 0]
    if not pre:  # every one decodes (most steps)
        return [0] * len(batch)
    chunks = iter(prefill_chunks(len(batch) - len(pre), pre, budget))
    return [next(chunks, 0) if r.prefill_todo > 0 else 0 for r in batch]


def step_shape(batch: Sequence[StepReq], budget: int) -> StepShape:
    """The step's shape: the prefilling requests compute their chunks of the `budget` after the
    prompt tokens already done; every other one decodes a token over its prompt and output so far."""
    plan = step_plan(batch, budget)
    decode = [r for r in batch if r.prefill_todo <= 0]
    chunks = [(c, r.prompt.num_tokens - r.prefill_todo) for r, c in zip(batch, plan, strict=True) if c > 0]
    return StepShape(decode_seqs=len(decode), prefill_tokens=sum(c for c, _ in chunks), prefill_seqs=len(chunks),
                     context_tokens=sum(decode_context(r.prompt.num_tokens, r.generated) for r in decode),
                     prefill_attn=float(sum(chunk_attention(c, before) for c, before in chunks)),
                     longest_context=max((decode_context(r.prompt.num_tokens, r.generated) for r in decode), default=0))


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

    def price(self, batch: Sequence[StepReq], plan: Sequence[int] | None = None) -> float:
        """The step's seconds; `plan`: its `step_plan`, when the caller has it already."""
        ptps = self.cfg.prefill_tokens_per_step
        if self.model is not None:
            return self.model.seconds(step_shape(batch, ptps))
        return self.knobs(len(batch), sum(step_plan(batch, ptps) if plan is None else plan))
