"""The exact bodies two widely used clients send, on the fake engine, read back the way those
clients read them: guidellm 0.8.1's benchmark requests and lm-evaluation-harness 0.4.13's
`local-completions` requests (bench/clients.py runs the clients themselves on the real engine)."""

from __future__ import annotations

import json
import math

import httpx

from tests.conftest import fake_toml


async def test_guidellm_streamed_chat_with_continuous_usage(make_server) -> None:
    """guidellm: content as text parts, max_completion_tokens with ignore_eos (a fixed output
    length), usage in every chunk. It counts a request as errored if any chunk has "error"."""
    live = await make_server(fake_toml())
    body = {"model": "fake", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 24, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Land but [[eos:2]] specific."}]}]}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/chat/completions", json=body)
    assert r.status_code == 200
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert not any("error" in c for c in chunks)
    assert all("usage" in c for c in chunks)  # continuous_usage_stats
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip() and chunks[-1]["usage"]["completion_tokens"] == 24  # ignore_eos: past the model's end


async def test_lm_eval_loglikelihood_batch_of_token_id_prompts(make_server) -> None:
    """lm-eval's log-likelihood request (batch_size > 1): several token-id prompts, echo, logprobs 1,
    max_tokens 1. It sorts choices by index, pairs them with its prompts, and sums
    token_logprobs[ctxlen:-1], checking greediness with max(top_logprobs[i].values())."""
    live = await make_server(fake_toml())
    tok = live.backend().tokenizer
    contexts = [tok.encode("Question: What is 2 plus 3?\nAnswer:"), tok.encode("Question: Capital of Peru?\nAnswer:")]
    prompts = [contexts[0] + tok.encode(" 5"), contexts[0] + tok.encode(" 15"), contexts[1] + tok.encode(" Lima")]
    ctxlens = [len(contexts[0]), len(contexts[0]), len(contexts[1])]
    body = {"model": "fake", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/completions", json=body)
    assert r.status_code == 200
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice, prompt, ctxlen in zip(choices, prompts, ctxlens, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1  # the prompt's tokens, then the one generated
        assert choice["text"].startswith(tok.decode(prompt))
        scored = lp["token_logprobs"][ctxlen:-1]
        assert scored and math.isfinite(sum(scored))
        assert all(isinstance(max(top.values()), float) for top in lp["top_logprobs"][ctxlen:-1])


async def test_lm_eval_generate_until_batch(make_server) -> None:
    """lm-eval's generation request: token-id prompts, greedy, stop strings with the EOS text, a seed."""
    live = await make_server(fake_toml())
    tok = live.backend().tokenizer
    prompts = [tok.encode("Question: 1+1?\nAnswer:"), tok.encode("Say hello")]
    body = {"prompt": prompts, "model": "fake", "max_tokens": 8, "temperature": 0,
            "stop": ["\n\n", "Question:", "<|endoftext|>"], "seed": 1234}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        r = await h.post("/completions", json=body)
    assert r.status_code == 200
    got = r.json()["choices"]
    assert sorted(c["index"] for c in got) == [0, 1] and all(isinstance(c["text"], str) for c in got)
