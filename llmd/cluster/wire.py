"""What travels between an ingress node and the node that runs a choice for it: the choice to
run (prompt as token ids, sampling, who it is for) and its deltas back, one JSON line each.

Token ids, not text: the executor runs exactly the prompt the ingress rendered and counted
(and, after a failover, the prompt plus the tokens already delivered), so the text at
temperature 0 is the same whichever node runs it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from llmd.backends.base import Delta, Prompt, Sampling, Structured, TokenLogprob
from llmd.errors import APIError

RUN_PATH = "/internal/v1/run"


class RunRequest(BaseModel):
    """One choice, admitted by the ingress, to run on this node's copy of `version`."""

    model_config = ConfigDict(extra="forbid")

    request_id: str  # the ingress's request id (one ledger row, there)
    engine_id: str  # this attempt's engine request id
    tenant: str
    klass: str
    model: str
    version: str  # the exact version (content hash): never other weights
    prompt_token_ids: list[int]
    engine_input: Any = None  # the backend's own input (a fake engine reads its text), when JSON-able
    sampling: dict[str, Any]
    seconds_left: Annotated[float, Field(gt=0)]
    hops: Annotated[int, Field(ge=0, le=1)] = 1  # forwarded once: an executor never forwards again
    tokenizer: str = ""  # what rendered prompt_token_ids (llmd.store.tokenizer_id; "": not said)

    def prompt(self) -> Prompt:
        ids = list(self.prompt_token_ids)
        return Prompt(token_ids=ids, engine_input=self.engine_input or {"prompt_token_ids": ids})


def encode_prompt_input(prompt: Prompt) -> Any:
    """The backend's input object, if it survives JSON as it is (text, ids, a plain dict)."""
    try:
        json.dumps(prompt.engine_input)
    except (TypeError, ValueError):
        return None
    return prompt.engine_input


def sampling_to_json(s: Sampling) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    if s.logit_bias is not None:
        d["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    return d


def sampling_from_json(d: dict[str, Any]) -> Sampling:
    d = dict(d)
    if d.get("structured") is not None:
        st = dict(d["structured"])
        if st.get("choice") is not None:
            st["choice"] = tuple(st["choice"])
        d["structured"] = Structured(**st)
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
    d["stop"] = tuple(d.get("stop") or ())
    return Sampling(**d)


def _lp(t: TokenLogprob) -> list[Any]:
    return [t.token, t.token_id, t.logprob, [list(x) for x in t.top]]


def _lp_back(x: list[Any]) -> TokenLogprob:
    return TokenLogprob(x[0], x[1], x[2], tuple((a, b) for a, b in x[3]))


def delta_line(d: Delta) -> bytes:
    out: dict[str, Any] = {"t": d.text, "n": d.num_tokens}
    if d.token_ids:
        out["ids"] = list(d.token_ids)
    if d.finish_reason is not None:
        out["f"] = d.finish_reason
    if d.cached_prompt_tokens:
        out["c"] = d.cached_prompt_tokens
    if d.logprobs:
        out["lp"] = [_lp(t) for t in d.logprobs]
    if d.prompt_logprobs is not None:
        out["plp"] = [_lp(t) for t in d.prompt_logprobs]
    return json.dumps(out, separators=(",", ":")).encode() + b"\n"


def end_line() -> bytes:
    return b'{"end":true}\n'


def error_line(e: APIError) -> bytes:
    return json.dumps({"error": e.body()["error"], "status": e.status}, separators=(",", ":")).encode() + b"\n"


def error_from(d: dict[str, Any]) -> APIError:
    """The executor's error, as the ingress raises it (a stream's terminal event, or a status)."""
    err = d.get("error") or {}
    return APIError(int(d.get("status", 500)), str(err.get("message", "the node running it failed")),
                    str(err.get("type", "server_error")), err.get("code"), err.get("param"))


def parse_line(line: bytes | str) -> Delta | dict[str, Any]:
    """A delta, or the stream's last line as a dict (`end`, or `error` with its status)."""
    d = json.loads(line)
    if "end" in d or "error" in d:
        return dict(d)
    return Delta(d["t"], d["n"], d.get("f"), d.get("c", 0), tuple(d.get("ids", ())),
                 tuple(_lp_back(x) for x in d.get("lp", ())),
                 tuple(_lp_back(x) for x in d["plp"]) if "plp" in d else None)
