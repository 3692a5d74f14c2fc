"""One choice's output as OpenAI shows it: text or tool calls, logprobs, a completion's echo.

Deltas come in already screened (llmd/dispatch.py). Logprobs name tokens, so they must not
say more than the text did: behind output filters a token's logprob goes out only once the
window has let all its text out, and a token inside a span a filter redacted goes out
with its text blanked and no alternatives.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring
from typing import Any

from llmd.backends.base import Delta, TokenLogprob
from llmd.protocol import logprobs as lp_shapes
from llmd.protocol import responses
from llmd.runtime import Choice, Job


class ChoiceOutput:
    """What one choice has produced, and what of it may go out now."""

    def __init__(self, job: Job, choice: Choice, chat: bool) -> None:
        self.job, self.choice, self.chat = job, choice, chat
        self.parts: list[str] = []
        self.finish: str | None = None
        self.logprobs: list[TokenLogprob] = []  # released, in order
        self._held: list[TokenLogprob] = []  # their text not yet all released
        self._redactions = 0
        self._called = False  # tool_choice auto: the parser found a call (finish_reason tool_calls)
        self._offset = 0  # characters of this choice's text already sent (completions' text_offset)
        self._started = False
        self._unsent = 0  # tokens taken and not yet sent (`sent`)
        self._t_sent: float | None = None  # when this choice's last tokens went to the client
        self.wants_logprobs = choice.sampling.logprobs is not None
        # The common case (text only) is encoded from templates: per token, one string escape.
        self.plain = not self.wants_logprobs and job.tools is None and not choice.prompt_only
        key = "delta" if chat else "text"
        self._open = f'{{"index":{choice.index},"{key}":' + ('{"content":' if chat else "")
        self._close = ("}" if chat else "") + ',"logprobs":null,"finish_reason":'

    # -- taking deltas -----------------------------------------------------
    def take(self, d: Delta) -> list[TokenLogprob]:
        """Record a screened delta; returns the logprob entries that may go out with it."""
        self._unsent += d.num_tokens
        if self.choice.prompt_only:  # echo with max_tokens 0: the prompt (and its logprobs) is all
            scored = list(d.prompt_logprobs or ()) if self.wants_logprobs else []
            self.logprobs += scored
            self.finish = d.finish_reason or self.finish
            return scored
        self.parts.append(d.text)
        if d.finish_reason is not None:
            self.finish = d.finish_reason
        if not self.wants_logprobs:
            return []
        entries: list[TokenLogprob] = list(d.prompt_logprobs or ()) if self.job.echo_logprobs else []
        self._held += d.logprobs
        window = self.choice.window
        if window is not None and window.holding and d.finish_reason is None:
            return entries  # some of their text is still held back
        if window is not None and len(window.redactions) != self._redactions:
            self._redactions = len(window.redactions)
            self._held = [TokenLogprob("", e.token_id, e.logprob) for e in self._held]
        entries += self._held
        self._held = []
        self.logprobs += entries
        return entries

    def sent(self) -> None:
        """The tokens taken since the last call go to the client now: a stream's chunk is being
        written, or a response body's text was released by the filters (that body leaves whole
        at the end: its wait is e2e latency). They time the client-observed TTFT and ITL."""
        if n := self._unsent:
            self._unsent = 0
            now = time.monotonic()
            self.job.record.on_sent(n, now, self._t_sent)
            self._t_sent = now

    def streamed(self, d: Delta) -> str | None:
        """A stream's step for one delta: `take` it, its chunk's choice as JSON (`chunk_json`), and
        `sent` when there is one. The common case (text only, past the first chunk) is done here
        in one call, as those three would: this runs once per token of every stream."""
        if not self.plain or not self._started or (self.chat and not d.text):
            piece = self.chunk_json(d, self.take(d))
            if piece is not None:
                self.sent()
            return piece
        self._unsent += d.num_tokens
        self.parts.append(d.text)
        finish = d.finish_reason
        if finish is None:
            if not d.text:
                return None
        else:
            self.finish = finish
        if n := self._unsent:
            self._unsent = 0
            now = time.monotonic()
            self.job.record.on_sent(n, now, self._t_sent)
            self._t_sent = now
        tail = "null" if finish is None else f'"{finish}"'
        return f"{self._open}{encode_basestring(d.text)}{self._close}{tail}}}"

    @property
    def text(self) -> str:
        return self.choice.echo + "".join(self.parts)

    # -- shapes ----------------------------------------------------------
    def chunk_json(self, d: Delta, entries: list[TokenLogprob]) -> str | None:
        """The stream chunk's choice for this delta as JSON, or None when there is nothing to say."""
        if not self.plain or not self._started or (self.chat and not d.text):
            piece = self.chunk_choice(d, entries)
            return None if piece is None else json.dumps(piece, separators=(",", ":"), ensure_ascii=False)
        if not d.text and d.finish_reason is None:
            return None
        finish = "null" if d.finish_reason is None else f'"{d.finish_reason}"'
        # encode_basestring is what json.dumps(str, ensure_ascii=False) runs, less its per-call encoder
        return f"{self._open}{encode_basestring(d.text)}{self._close}{finish}}}"

    def chunk_choice(self, d: Delta, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """The stream chunk's choice for this delta, or None when there is nothing to say."""
        tools = self.job.tools
        text = "" if self.choice.prompt_only else d.text
        if not self.chat:
            if not self._started:
                self._started, text = True, self.choice.echo + text
            if not text and d.finish_reason is None and not entries:
                return None
            lp = lp_shapes.completion(entries, self._offset) if self.wants_logprobs else None
            self._offset += len(text)
            return responses.text_choice(self.choice.index, text, d.finish_reason, lp)
        delta = self._tool_delta(text, d) if tools is not None else ({"content": text} if text else {})
        finish = self._finish(d.finish_reason)
        if not delta and finish is None and not entries:
            return None  # nothing to say yet (a role-only chunk would only fake an early first token)
        if not self._started:
            self._started = True
            delta = {"role": "assistant", **(delta or {"content": ""})}
        lp = lp_shapes.chat(entries) if self.wants_logprobs else None
        return responses.chat_delta(self.choice.index, delta, finish, lp)

    def _tool_delta(self, text: str, d: Delta) -> dict[str, Any]:
        """Named function: the arguments stream as they come. `required`: the calls, whole, at the end.
        `auto`: whatever the model's tool parser makes of each piece, text or call deltas."""
        tools, last = self.job.tools, d.finish_reason is not None
        assert tools is not None
        if tools.auto:
            return self._auto_delta(text, d, last)
        if tools.function is not None:
            if not self._started:
                head = {"index": 0, "id": self._call_id, "type": "function",
                        "function": {"name": tools.function, "arguments": text}}
                return {"content": None, "tool_calls": [head]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if not last:
            return {}
        calls = tools.calls("".join(self.parts))
        if not calls:
            return {"content": "".join(self.parts)}  # cut short: what there is, as text
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}

    def _auto_delta(self, text: str, d: Delta, last: bool) -> dict[str, Any]:
        reader = self.choice.tools
        assert reader is not None and self.job.tools is not None
        # The text is what the output filters released; the token ids are the engine's (parsers
        # that look for a marker token see it as soon as it is generated).
        content, calls = reader.feed(text, d.token_ids, last)
        if not self.job.tools.many:
            calls = [c for c in calls if c.get("index", 0) == 0]  # parallel_tool_calls false: the first
        self._called = self._called or bool(calls)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def _call_id(self) -> str:
        return f"call_{self.job.record.request_id[4:28]}{self.choice.index}"

    def _finish(self, finish: str | None) -> str | None:
        tools = self.job.tools
        if finish == "stop" and tools is not None and (self._called or not tools.auto):
            return "tool_calls"
        return finish

    def body_choice(self) -> dict[str, Any]:
        """The whole choice, for a non-streaming response."""
        if not self.chat:
            lp = lp_shapes.completion(self.logprobs, 0) if self.wants_logprobs else None
            return responses.text_choice(self.choice.index, self.text, self.finish, lp)
        lp = lp_shapes.chat(self.logprobs) if self.wants_logprobs else None
        tools = self.job.tools
        if tools is not None and tools.auto:
            return self._auto_body(lp)
        calls = tools.calls(self.text) if tools is not None else None
        if calls:
            if tools is not None and tools.function is not None:
                calls[0]["id"] = self._call_id
            return responses.chat_choice(self.choice.index, None, self._finish(self.finish), lp, calls)
        return responses.chat_choice(self.choice.index, self.text, self.finish, lp)

    def _auto_body(self, lp: dict[str, Any] | None) -> dict[str, Any]:
        """`auto`, whole: the calls the model's tool parser finds, and any text outside them."""
        reader = self.choice.tools
        assert reader is not None and self.job.tools is not None
        content, calls = reader.parse(self.text)
        calls = calls if self.job.tools.many else calls[:1]
        if not calls:
            return responses.chat_choice(self.choice.index, content or "", self.finish, lp)
        self._called = True
        return responses.chat_choice(self.choice.index, content, self._finish(self.finish), lp, calls)
