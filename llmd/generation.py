"""What a request asks the engine for, free of HTTP: its prompts rendered and counted, its
sampling (with logprobs, logit bias and any structured-output constraint), and what the
prompt filters read. Admission (llmd/service.py) decides whether it runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmd.backends import Backend, PromptError
from llmd.backends.base import Prompt, Sampling, Structured
from llmd.errors import bad_request
from llmd.protocol import ChatRequest, CompletionRequest


def prompts(req: ChatRequest | CompletionRequest, backend: Backend,
            tools: list[dict[str, Any]] | None) -> list[tuple[Prompt, str]]:
    """Each prompt as the engine sees it, with its text for a completion's echo."""
    try:
        if isinstance(req, ChatRequest):
            return [(backend.render_chat(req.chat_messages(), tools), "")]
        out = []
        for p in req.prompts():
            prompt = backend.render_completion(p)
            out.append((prompt, (p if isinstance(p, str) else backend.decode(p)) if req.echo else ""))
        return out
    except PromptError as e:
        raise bad_request(str(e), "messages" if isinstance(req, ChatRequest) else "prompt") from None


def screened_text(req: ChatRequest | CompletionRequest, backend: Backend) -> str:
    """What the prompt filters read: the messages, or every prompt (token ids decoded)."""
    if isinstance(req, ChatRequest):
        return "\n".join(m.text() for m in req.messages)
    try:
        return "\n".join(p if isinstance(p, str) else backend.decode(p) for p in req.prompts())
    except (ValueError, KeyError) as e:
        raise bad_request(f"the prompt's token ids cannot be decoded: {e}", "prompt") from None


def response_format(req: ChatRequest | CompletionRequest) -> Structured | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object" or rf.json_schema is None or rf.json_schema.schema_ is None:
        return Structured(json_object=True)
    return Structured(json_schema=rf.json_schema.schema_)


def sampling(req: ChatRequest | CompletionRequest, max_tokens: int, structured: Structured | None) -> Sampling:
    echo_logprobs = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
    return Sampling(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop_list(),
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, top_k=req.top_k, min_p=req.min_p,
        min_tokens=req.min_tokens or 0, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=req.top_logprobs_wanted(),
        prompt_logprobs=req.top_logprobs_wanted() if echo_logprobs else None,
        logit_bias=_logit_bias(req.logit_bias), structured=structured,
    )


def for_choice(s: Sampling, j: int) -> Sampling:
    """The j-th of n choices: a seeded request gives each choice its own seed (the same
    seed would give n copies of one sample)."""
    if j == 0 or s.seed is None:
        return s
    # Kept within int64 (a seed near its top would overflow it), as the engine needs.
    return replace(s, seed=(s.seed + j + 2**63) % 2**64 - 2**63)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers, as strings)", "logit_bias") from None
