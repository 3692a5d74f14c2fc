"""Building the configured filters and running them: the prompt screen and the output window.

The output window is the part with semantics: streamed text is released to the client
only after every output filter has seen it, and the newest `holdback_tokens` tokens are
held back, so a match that spans chunk or token boundaries is caught (and redacted) before
any of it leaves. Each filter sees the held text plus `lookback` characters of what was
already released, enough for its longest match (and, for the loop detector, its period).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.config import Config, ConfigError, FilterSpec, ModelConfig, TenantConfig
from llmd.filters.base import InputFilter, Match, OutputFilter
from llmd.filters.builtin import PII, Ask, Blocklist, Classifier, Degenerate

# Characters of released text a filter re-reads: enough to see a match that began there
# (which can then only be blocked, no longer redacted) and its word boundaries.
LOOKBACK = {Blocklist: 64, PII: 48}


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
    if isinstance(f, Degenerate):
        return max(f.max_period * f.min_repeats, f.min_chars + f.max_period)
    return LOOKBACK.get(type(f), 256)


class Filters:
    """Every configured filter, built once; chains per (model, tenant)."""

    def __init__(self, config: Config, ask: Ask) -> None:
        self.by_name = {s.name: build(s, ask) for s in config.filters}
        uses: list[tuple[str, type[InputFilter] | type[OutputFilter], str]]
        uses = [(n, InputFilter, "prompts") for m in config.models for n in m.filters.input]
        uses += [(n, OutputFilter, "output") for m in config.models for n in m.filters.output]
        uses += [(n, InputFilter, "prompts") for t in config.tenants for n in t.input_filters]
        uses += [(n, OutputFilter, "output") for t in config.tenants for n in t.output_filters]
        for name, proto, what in uses:  # a team's own class may implement one side only
            if not isinstance(self.by_name[name], proto):
                raise ConfigError(f"{config.path or 'config'}: filter {name!r} cannot screen {what}")

    def input_chain(self, model: ModelConfig, tenant: TenantConfig | None) -> list[InputFilter]:
        names = [*model.filters.input, *(tenant.input_filters if tenant else [])]
        return [f for n in dict.fromkeys(names) if isinstance(f := self.by_name[n], InputFilter)]

    def output_window(self, model: ModelConfig, tenant: TenantConfig | None) -> OutputWindow | None:
        names = [*model.filters.output, *(tenant.output_filters if tenant else [])]
        chain = [f for n in dict.fromkeys(names) if isinstance(f := self.by_name[n], OutputFilter)]
        return OutputWindow(chain, model.filters.holdback_tokens) if chain else None


async def screen_prompt(chain: Sequence[InputFilter], text: str) -> tuple[Match | None, list[str]]:
    """The first match, and a note per filter consulted for the request record: its name,
    with `!<error>` where it could not decide and its fail policy applied."""
    notes: list[str] = []
    for f in chain:
        m = await f.check_prompt(text)
        err = getattr(f, "last_error", None)
        notes.append(f"{f.name}!{err}" if err else f.name)
        if m is not None:
            return m, notes
    return None, notes


@dataclass
class OutputWindow:
    filters: Sequence[OutputFilter]
    holdback_tokens: int
    released_tail: str = ""  # the end of what the client already has
    held: list[list] = field(default_factory=list)  # [text, tokens] per delta, oldest first
    redactions: list[str] = field(default_factory=list)  # labels of the rules that redacted

    def __post_init__(self) -> None:
        self._keep = max((lookback(f) for f in self.filters), default=0)

    @property
    def holding(self) -> bool:
        """Some text came in that has not gone out yet."""
        return bool(self.held)

    def feed(self, text: str, tokens: int, final: bool) -> tuple[str, Match | None]:
        """Take new output; return the text now safe to release, or a blocking match (then
        nothing more may be released)."""
        if text or tokens:
            self.held.append([text, tokens])
        for f in self.filters:
            hit = self._apply(f, final)
            if hit is not None:
                self.held.clear()
                return "", hit
        out = []
        while self.held and (final or sum(t for _, t in self.held) > self.holdback_tokens):
            out.append(self.held.pop(0)[0])
        released = "".join(out)
        if released:
            self.released_tail = (self.released_tail + released)[-self._keep:]
        return released, None

    def _apply(self, f: OutputFilter, final: bool) -> Match | None:
        if not self.held:
            return None
        ctx = self.released_tail[-lookback(f):]
        pending = "".join(t for t, _ in self.held)
        window = ctx + pending
        edits: list[Match] = []
        for m in f.scan(window, final):
            if m.end <= len(ctx):
                continue  # entirely released already: it was judged when it was held
            if m.action == "block" or m.start < len(ctx):
                # a block, or a redaction whose start already left: it cannot be unsent
                return m if m.action == "block" else Match(m.filter, m.rule, "block", m.start, m.end)
            edits.append(m)
        if not edits:
            return None
        for m in sorted(edits, key=lambda m: m.start, reverse=True):
            a, b = m.start - len(ctx), m.end - len(ctx)
            pending = pending[:a] + m.replacement + pending[b:]
            self.redactions.append(m.label)
        self.held = [[pending, sum(t for _, t in self.held)]]
        return None
