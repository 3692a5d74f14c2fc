"""Building the configured filters and running them: the prompt screen and the output window.

The output window is the part with semantics: streamed text is released to the client
only after every output filter has seen it, and only once no filter could still match
across it: each says how much of the newest text could still begin a match (`hold`, see
base.py: a prefix of a blocked phrase, "ann@exa"), and the rest leaves at once. So a match
that spans chunk or token boundaries is caught (and redacted) before any of it leaves.
`holdback_tokens` bounds the wait: a candidate that grows past it is released from its
oldest token on, and should it then complete, its start has left and the stream stops.
Each filter sees the held text plus `lookback` characters of what was already released,
enough for its longest match (and, for the loop detector, its period). When nothing is held
and every filter says the new text is calm (base.py's `Calm`: no match, nothing to hold), it
leaves at once without the scans and holds: that is most tokens, and their cost per token.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as replaced
from typing import Protocol

from llmd.config import Config, ConfigError, FilteringConfig, FilterSpec, ModelConfig, TenantConfig
from llmd.filters.base import InputFilter, Match, OutputFilter
from llmd.filters.builtin import PII, Ask, Blocklist, Classifier, Degenerate
from llmd.filters.structured import JsonArbiter


def build(spec: FilterSpec, ask: Ask) -> InputFilter | OutputFilter:
    if ":" in spec.type:  # a team's own filter: "package.module:Class"
        mod, _, cls = spec.type.partition(":")
        f = getattr(importlib.import_module(mod), cls)(name=spec.name, **spec.options)
        if not isinstance(f, (InputFilter, OutputFilter)):
            raise TypeError(f"filter {spec.name!r}: {spec.type} has neither check_prompt nor scan")
        return f
    if spec.type == "blocklist":
        return Blocklist(spec.name, spec.words, spec.patterns, spec.action)
    if spec.type == "pii":
        return PII(spec.name, spec.kinds, spec.action)
    if spec.type == "degenerate":
        return Degenerate(spec.name, spec.min_repeats, spec.max_period, spec.min_chars)
    assert spec.model is not None
    return Classifier(spec.name, spec.model, ask, spec.timeout_ms, spec.on_error, spec.unsafe_answer)


def lookback(f: OutputFilter) -> int:
    """Characters of released text a filter re-reads: enough to see a match that began there
    (which can then only be blocked, no longer redacted) and its word boundaries."""
    return int(getattr(f, "lookback", 256))


class Filters:
    """Every configured filter, built once; chains per (model, tenant)."""

    def __init__(self, config: Config, ask: Ask) -> None:
        self.ask = ask
        self.by_name = {s.name: build(s, ask) for s in config.filters}
        # Each model's filter lists as this config has them: a reload replaces them without
        # touching the served versions' own configs.
        self.models = {m.name: m.filters for m in config.models}
        uses: list[tuple[str, type[InputFilter] | type[OutputFilter], str]]
        uses = [(n, InputFilter, "prompts") for m in config.models for n in m.filters.input]
        uses += [(n, OutputFilter, "output") for m in config.models for n in m.filters.output]
        uses += [(n, InputFilter, "prompts") for t in config.tenants for n in t.input_filters]
        uses += [(n, OutputFilter, "output") for t in config.tenants for n in t.output_filters]
        for name, proto, what in uses:  # a team's own class may implement one side only
            if not isinstance(self.by_name[name], proto):
                raise ConfigError(f"{config.path or 'config'}: filter {name!r} cannot screen {what}")

    def input_chain(self, model: ModelConfig, tenant: TenantConfig | None) -> list[InputFilter]:
        names = [*self._of(model).input, *(tenant.input_filters if tenant else [])]
        # .get: a request authenticated before a reload may name a filter the reload removed.
        return [f for n in dict.fromkeys(names) if isinstance(f := self.by_name.get(n), InputFilter)]

    def output_window(self, model: ModelConfig, tenant: TenantConfig | None,
                      forced_length: bool = False, arbiter: JsonArbiter | None = None) -> OutputWindow | None:
        """`forced_length`: the client asked for every token up to max_tokens (vLLM's ignore_eos,
        what load generators send), so filters that only guard against a degenerate generation
        (`safety = False`: the loop detector) stand aside; the safety filters still apply.
        `arbiter`: the output is constrained JSON (structured.py judges every match in it)."""
        filtering = self._of(model)
        names = [*filtering.output, *(tenant.output_filters if tenant else [])]
        chain = [f for n in dict.fromkeys(names) if isinstance(f := self.by_name.get(n), OutputFilter)
                 and not (forced_length and not getattr(f, "safety", True))]
        return OutputWindow(chain, filtering.holdback_tokens, arbiter=arbiter) if chain else None

    def _of(self, model: ModelConfig) -> FilteringConfig:
        return self.models.get(model.name, model.filters)


async def screen_prompt(chain: Sequence[InputFilter], text: str,
                        offload: Offload | None = None) -> tuple[Match | None, list[str]]:
    """The first match, and a note per filter consulted for the request record: its name,
    with `!<error>` where it could not decide and its fail policy applied. A filter with a
    plain `screen(text)` (the CPU-bound built-ins) runs it through `offload` (a thread of the
    prompt pool), so a long prompt does not hold the event loop; others are awaited here."""
    notes: list[str] = []
    for f in chain:
        screen = getattr(f, "screen", None)
        m = await offload(screen, text) if offload is not None and callable(screen) else await f.check_prompt(text)
        err = getattr(f, "last_error", None)
        notes.append(f"{f.name}!{err}" if err else f.name)
        if m is not None:
            return m, notes
    return None, notes


class Offload(Protocol):
    """Runs a plain function off the event loop (llmd.prompt_pool.PromptPool.run)."""

    def __call__(self, fn: Callable[[str], Match | None], text: str, /) -> Awaitable[Match | None]: ...


@dataclass
class OutputWindow:
    filters: Sequence[OutputFilter]
    holdback_tokens: int  # the most a candidate match is held back; older text leaves regardless
    released_tail: str = ""  # the end of what the client already has
    held: list[list] = field(default_factory=list)  # [text, tokens] per delta still held (or its unsent end)
    redactions: list[str] = field(default_factory=list)  # labels of the rules that redacted
    arbiter: JsonArbiter | None = None  # a constrained (JSON) output: it judges every match first

    def __post_init__(self) -> None:
        self._views = [(f, lookback(f), getattr(f, "hold", None)) for f in self.filters]
        self._keep = max((back for _, back, _ in self._views), default=0)
        self._hold_all = any(h is None for _, _, h in self._views)  # a filter without `hold`: hold it all
        # The bound let out text a candidate may have begun in: look for match starts in the
        # released context too (not only in the pending text), until none begins there.
        self._cut = False
        # Each filter's `calm` with its lookback, when all have one (and `hold`): the quiet path.
        calms = [(c, back) for f, back, _ in self._views if (c := getattr(f, "calm", None)) is not None]
        self._calm = calms if len(calms) == len(self._views) and not self._hold_all else None

    @property
    def held_tokens(self) -> int:
        held = self.held
        if not held:  # most of the time: read before and after every delta
            return 0
        return held[0][1] if len(held) == 1 else sum([t for _, t in held])

    @property
    def holding(self) -> bool:
        """Some text came in that has not gone out yet."""
        return bool(self.held)

    def feed(self, text: str, tokens: int, final: bool) -> tuple[str, Match | None]:
        """Take new output; return the text now safe to release, or a blocking match (then
        nothing more may be released)."""
        held = self.held
        if not held and text and not final and self._calm is not None and not self._cut and self.arbiter is None:
            whole, n = self.released_tail + text, len(text)  # each window is a suffix of it
            for calm, back in self._calm:
                window = whole[-(back + n):] if back else text
                if not calm(window, len(window) - n):
                    break
            else:  # what scan and hold would say: no match, nothing held, so all of it leaves
                self.released_tail = whole[-self._keep:]
                return text, None
        if text or tokens:
            held.append([text, tokens])
        if not held:
            return "", None
        pending = held[0][0] if len(held) == 1 else "".join([t for t, _ in held])
        seen = len(self.redactions)
        tail = self.released_tail
        # A filter calm on its window is neither scanned nor asked to hold (not at the end: a match
        # that ends with the text counts then, which calm does not promise).
        calms = None if final else self._calm
        windows: list[tuple[str, int, bool]] = []  # what each filter was shown: (text, released characters, calm)
        for i, (f, back, _) in enumerate(self._views):
            ctx = tail[-back:] if back else ""
            window = ctx + pending
            if calms is not None and calms[i][0](window, 0 if self._cut else len(ctx)):
                windows.append((window, len(ctx), True))
                continue
            found = f.scan(window, final)
            if found:  # most tokens match nothing: no call to weigh the matches
                pending, hit = self._apply(found, window, len(ctx), final)
                if hit is not None:
                    self.held.clear()
                    return "", hit
            windows.append((window, len(ctx), False))
        if len(self.redactions) != seen:  # a redaction changed the pending text: holds read it afresh
            windows = [(w[:n] + pending, n, False) for w, n, _ in windows]
        released = self._take(len(pending)) if final else self._release(pending, windows)
        if released:
            self.released_tail = (self.released_tail + released)[-self._keep:]
            if self.arbiter is not None:
                self.arbiter.commit(released)
        return released, None

    def _apply(self, matches: list[Match], window: str, n_ctx: int, final: bool) -> tuple[str, Match | None]:
        """A filter's verdict, its `matches` in `window` (`n_ctx` released characters, then the
        pending text): the pending text with its redactions made, or a blocking match."""
        edits: list[Match] = []
        for found in matches:
            if found.end <= n_ctx:
                continue  # entirely released already: it was judged when it was held
            m = found if self.arbiter is None else self._arbitrated(found, window, n_ctx, final)
            if m is None:
                continue
            if m.action == "block" or m.start < n_ctx:
                # a block, or a redaction whose start already left: it cannot be unsent
                return "", m if m.action == "block" else Match(m.filter, m.rule, "block", m.start, m.end)
            edits.append(m)
        pending = window[n_ctx:]
        if not edits:
            return pending, None
        spans: list[tuple[int, int, str]] = []  # overlapping redactions are cut out as one span
        for m in sorted(edits, key=lambda m: m.start):
            if spans and m.start < spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], m.end), spans[-1][2])
            else:
                spans.append((m.start, m.end, m.replacement))
            self.redactions.append(m.label)
        for a, b, replacement in reversed(spans):
            pending = pending[:a - n_ctx] + replacement + pending[b - n_ctx:]
        self.held = [[pending, self.held_tokens]]
        return pending, None

    def _arbitrated(self, m: Match, window: str, n_ctx: int, final: bool) -> Match | None:
        """`m` as the constrained output allows it: redacted inside a free string value (span and
        replacement made JSON-safe), a block anywhere else, None where it does not apply (a
        quantity) or is judged once its number ends (held meanwhile)."""
        assert self.arbiter is not None
        tokens = self.arbiter.view(window[n_ctx:], final)
        verdict, a, b, replacement = self.arbiter.judge(tokens, window, self.arbiter.state.pos - n_ctx, m)
        if verdict in ("skip", "wait"):
            return None
        if verdict == "as_is":  # text around embedded JSON
            return m
        if verdict == "stop":
            return replaced(m, action="block")
        return replaced(m, start=a, end=b, replacement=replacement)

    def _release(self, pending: str, windows: list[tuple[str, int, bool]]) -> str:
        """What no filter could still match across, then whatever is over the bound, oldest first."""
        n = len(pending)
        keep = n if self._hold_all else 0
        if not self._hold_all:
            cut = self._cut
            for (_, _, hold), (window, n_ctx, calm) in zip(self._views, windows, strict=True):
                assert hold is not None  # not _hold_all: each has one
                k = 0 if calm else hold(window, 0 if cut else n_ctx)
                if k > keep:
                    keep = k
            self._cut = cut and keep > n  # a candidate still reaches into released text
            keep = min(keep, n)
        if self.arbiter is not None:  # an unfinished number waits whole
            text = self.released_tail + pending
            held = self.arbiter.hold(self.arbiter.view(pending, False), text, self.arbiter.state.pos - len(
                self.released_tail))
            keep = max(keep, min(held, len(pending)))
        out = self._take(n - keep)
        while self.held and self.held_tokens > self.holdback_tokens:
            out += self.held.pop(0)[0]  # a candidate grew past the bound: its start leaves
            self._cut = True
        return out

    def _take(self, n: int) -> str:
        """The first `n` held characters, cut out of the held deltas (a delta cut in two keeps its
        share of the tokens, rounded up)."""
        out = []
        while self.held and (n > 0 or not self.held[0][0]):
            text, tokens = self.held[0]
            if len(text) <= n:
                out.append(text)
                n -= len(text)
                self.held.pop(0)
            else:
                rest = text[n:]
                self.held[0] = [rest, -(-tokens * len(rest) // len(text))]
                out.append(text[:n])
                n = 0
        return "".join(out)
