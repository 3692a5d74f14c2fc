"""The sections of `config.toml`: the server, each model (engine, scheduling, pricing, filters,
degradation), each tenant, the batch tier and auth. Strict: an unknown key is an error."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Annotated, Literal

import regex
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from llmd.config.base import _Strict
from llmd.config.engines import EngineConfig, FakeEngineConfig
from llmd.policy.classes import CLASSES, INTERACTIVE

DEFAULT_CONFIG_ENV = "LLMD_CONFIG"


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and key."""


class TLSConfig(_Strict):
    """`[server.tls]`: the certificate chain and private key (PEM files), checked at start and
    read again on SIGHUP (`llmd reload`), so a renewed certificate needs no restart."""

    cert_file: Path
    key_file: Path

    @field_validator("cert_file", "key_file")
    @classmethod
    def _readable(cls, p: Path) -> Path:
        if not p.is_file():
            raise ValueError(f"{p}: no such file")
        return p


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # Deadlines bound the whole life of a request, queueing included.
    default_deadline_s: Annotated[float, Field(gt=0)] = 120.0
    max_deadline_s: Annotated[float, Field(gt=0)] = 600.0
    max_body_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # The SQLite file for usage, telemetry and idempotency (default: $LLMD_HOME/llmd.db).
    db_path: Path | None = None
    node: str = Field(default_factory=socket.gethostname)
    # How long an idempotent run waits for a reader to reconnect before it is cancelled.
    resume_grace_s: Annotated[float, Field(ge=0)] = 10.0
    # HTTPS; without it a non-loopback host is refused unless allow_plaintext says a proxy in
    # front terminates TLS (docs/deploy.md).
    tls: TLSConfig | None = None
    allow_plaintext: bool = False
    # How long a finished idempotent run's outcome is kept for replay (OpenAI and Stripe: 24 h);
    # the same key after that is a new request, run and billed again.
    idempotency_ttl_s: Annotated[float, Field(gt=0)] = 24 * 3600.0
    # Hostile clients (docs/architecture.md, "Connections"): connections open at once (one more
    # is answered 503 and closed, after idle keep-alive ones are reclaimed); a request's header
    # must arrive whole within header_timeout_s of its first byte (of the connection, for the
    # first request), its body within body_timeout_s plus one second per body_min_rate bytes
    # received, however it is trickled.
    max_connections: Annotated[int, Field(gt=0)] = 4096
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    body_min_rate: Annotated[int, Field(gt=0)] = 16384
    # Threads that render, tokenize and screen prompts (and compile structured-output grammars)
    # off the event loop, so one huge prompt cannot stall every other stream.
    prompt_workers: Annotated[int, Field(gt=0, le=64)] = 2
    # A generation request's top-level fields that llmd does not know (a router's own extensions,
    # such as SGLang's `no_stop_trim`) are ignored and named in X-LLMD-Ignored-Fields, as
    # `vllm serve` does; true refuses them with OpenAI's 400 `unknown_parameter` instead.
    strict_parameters: bool = False
    # A tenant refused more than ~10 times a second (a client ignoring Retry-After) has its
    # refusals answered after min(Retry-After, refusal_hold_s), not at once: its resubmit loop
    # slows to one try per hold and costs the other tenants nothing (llmd/policy/pacing.py). 0: off.
    refusal_hold_s: Annotated[float, Field(ge=0, le=60)] = 1.0
    # The hold grows with the knocking (at k times that rate, refusal_hold_s·(k−1)) up to this:
    # many streams resubmitting at once are paced to a few tries a second between them.
    refusal_hold_max_s: Annotated[float, Field(ge=0, le=120)] = 10.0
    # ... and its requests run batch-class (they yield their seats to other tenants' interactive
    # work) while it hammers and this long after. 0: never demoted.
    refusal_demote_s: Annotated[float, Field(ge=0)] = 30.0

    @model_validator(mode="after")
    def _deadlines(self) -> ServerConfig:
        if self.default_deadline_s > self.max_deadline_s:
            raise ValueError("default_deadline_s must not exceed max_deadline_s")
        if self.refusal_hold_max_s < self.refusal_hold_s:
            raise ValueError("refusal_hold_max_s must not be under refusal_hold_s")
        return self


def _known_class(name: str) -> str:
    if name not in CLASSES:
        raise ValueError(f"unknown priority class {name!r}; use one of {list(CLASSES)}")
    return name


PriorityClass = Annotated[str, AfterValidator(_known_class)]  # a name from llmd.policy.classes
KEY_HASH = r"^sha256:[0-9a-f]{64}$"
PROMPT_BYTES_PER_TOKEN = 8  # the default max_prompt_bytes per token of a model's prompt limit


class SchedulingConfig(_Strict):
    """How our queue feeds the engine; see llmd/policy/."""

    fairness: Literal["vtc", "fcfs"] = "vtc"
    w_in: Annotated[float, Field(ge=0)] = 1.0
    w_out: Annotated[float, Field(ge=0)] = 2.0
    max_queue: Annotated[int, Field(gt=0)] = 4096
    # Sequences we let into the engine at once; default: the engine's max_num_seqs.
    max_running: Annotated[int, Field(gt=0)] | None = None
    kv_high: Annotated[float, Field(gt=0, le=1)] = 0.95
    # An interactive request whose estimated wait for a seat is longer than this is refused at
    # once (503 overloaded, Retry-After) rather than queued: a chat turn that starts after its
    # time-to-first-token objective has failed already. Off by default (None or 0): measured on a
    # 2-core CPU it refused more than it saved (docs/decisions/2026-12-06-on-time-admission.md).
    max_wait_s: Annotated[float, Field(ge=0)] | None = None
    # An interactive request that has waited this long for a seat has missed its first-token
    # objective: it yields to those still on time, and runs when there is room. Unset: the
    # model's [slo] ttft_p95_s; 0: arrival order (within a tenant's ordering), late or not.
    late_after_s: Annotated[float, Field(ge=0)] | None = None
    # Seats kept for tenants with nothing running, so a flood from one tenant cannot
    # make a newcomer wait for a long generation to end before its first token.
    reserved_seats: Annotated[int, Field(ge=0)] = 2
    target_itl_ms: Annotated[float, Field(gt=0)] | None = None
    # The ITL controller aims at this fraction of target_itl_ms: the engine's ITL is measured
    # before our streaming path and the network, which add to what a client sees.
    target_itl_margin: Annotated[float, Field(gt=0, le=1)] = 0.88
    # With target_itl_ms: size the seats from a step-time model fitted on the engine's own steps
    # (within a second or two of a load change), AIMD on the clients' p95 correcting it; false:
    # AIMD alone, window by window (how llmd ran before issue H).
    itl_step_model: bool = True
    preempt_batch: bool = True
    # While interactive requests run or wait (and interactive_quiet_s after the last), batch-class
    # sequences hold at most this many seats; unset = a quarter of the seats. Each sequence in a
    # step lengthens it (on a CPU by a few ms each), so this is how far batch work may slow
    # interactive tokens.
    batch_seats_with_interactive: Annotated[int, Field(ge=0)] | None = None
    interactive_quiet_s: Annotated[float, Field(ge=0)] = 1.0
    # Then batch work regains the other seats over this many seconds (0: all at once): a refill
    # of every seat is one long prefill step that an interactive request arriving meanwhile waits behind.
    batch_ramp_s: Annotated[float, Field(ge=0)] = 30.0
    # Preempt (and later resume) the most over-share tenant's newest sequence for a tenant
    # below its fair share of seats when the engine is full.
    preempt_for_fairness: bool = True
    # Throughput assumed before any is measured, for wait estimates (output tokens/s).
    prior_tokens_per_s: Annotated[float, Field(gt=0)] = 200.0


class PricingConfig(_Strict):
    """Prices per million tokens, for the usage ledger's cost column."""

    input_per_mtok: Annotated[float, Field(ge=0)] = 0.0
    output_per_mtok: Annotated[float, Field(ge=0)] = 0.0
    # Batch API items pay this fraction of the list price (a tenant may override it).
    batch_multiplier: Annotated[float, Field(ge=0)] = 0.5


class DegradationConfig(_Strict):
    """What a model gives up, in this order, under sustained overload (empty: nothing)."""

    steps: list[Literal["cap_max_tokens", "fallback", "batch"]] = Field(default_factory=list)
    overload_wait_s: Annotated[float, Field(gt=0)] = 10.0  # estimated queue wait that counts as overload
    sustain_s: Annotated[float, Field(ge=0)] = 10.0  # overloaded this long: one more step
    recover_s: Annotated[float, Field(ge=0)] = 30.0  # calm this long: one step back
    max_tokens_cap: Annotated[int, Field(gt=0)] = 256
    fallback_model: str | None = None

    @model_validator(mode="after")
    def _check(self) -> DegradationConfig:
        if len(set(self.steps)) != len(self.steps):
            raise ValueError("a degradation step is listed twice")
        if "fallback" in self.steps and not self.fallback_model:
            raise ValueError("the 'fallback' step needs fallback_model")
        return self


class BatchConfig(_Strict):
    """The Batch API: uploaded files and batches live under `data_dir` and in SQLite."""

    # Default: a "<db name>-files" folder next to the SQLite file.
    data_dir: Path | None = None
    max_file_bytes: Annotated[int, Field(gt=0)] = 100 * 1024 * 1024
    max_requests: Annotated[int, Field(gt=0)] = 50_000  # lines per batch
    max_line_bytes: Annotated[int, Field(gt=0)] = 1024 * 1024
    # Items a batch keeps queued or running at once, per model (0: twice the model's seats),
    # so the engine stays full when interactive traffic stops, without flooding the queue.
    max_in_flight: Annotated[int, Field(ge=0)] = 0
    completion_windows: list[str] = Field(default_factory=lambda: ["24h"])
    # Bytes a tenant may keep: files (uploads, batch results) and its batches' stored rows
    # (request bodies, results not yet in a file); unset: no limit.
    max_bytes_per_tenant: Annotated[int, Field(gt=0)] | None = None
    # Batches a tenant may have unfinished (validating, in progress, finalizing, cancelling) at once.
    max_open_batches_per_tenant: Annotated[int, Field(gt=0)] = 16
    # Files are deleted this long after they were made (OpenAI's batch files: 30 days), unless an
    # upload says otherwise (`expires_after`); unset: kept until deleted. Purged while serving.
    file_ttl_days: Annotated[float, Field(gt=0)] | None = 30.0

    @field_validator("completion_windows")
    @classmethod
    def _windows(cls, v: list[str]) -> list[str]:
        for w in v:
            if not re.fullmatch(r"[1-9][0-9]*[hms]", w):
                raise ValueError(f"completion window {w!r} must be a whole number of hours, minutes or "
                                 "seconds, like '24h' or '90m'")
        return v


PIIKind = Literal["email", "phone", "card", "secret"]
PII_KINDS: tuple[PIIKind, ...] = ("email", "phone", "card", "secret")


class FilterSpec(_Strict):
    """One named filter (`[[filters]]`); models and tenants list the names they run."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")]
    # A built-in, or your own class as "package.module:Class", built as Class(name=..., **options).
    type: Literal["blocklist", "pii", "degenerate", "classifier"] | Annotated[
        str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]
    options: dict[str, object] = Field(default_factory=dict)  # for your own filter class
    action: Literal["block", "redact"] = "block"  # blocklist and pii
    words: list[str] = Field(default_factory=list)  # blocklist: matched on folded text, word-bounded
    patterns: list[str] = Field(default_factory=list)  # blocklist: regexes over folded (lower-case) text
    kinds: list[PIIKind] = Field(default_factory=lambda: list(PII_KINDS))  # pii
    min_repeats: Annotated[int, Field(ge=2)] = 8  # degenerate
    max_period: Annotated[int, Field(ge=1, le=1000)] = 64
    min_chars: Annotated[int, Field(ge=1)] = 48
    model: str | None = None  # classifier: a model this llmd serves
    timeout_ms: Annotated[float, Field(gt=0)] = 2000.0
    on_error: Literal["open", "closed"] = "open"
    unsafe_answer: str = "unsafe"

    @field_validator("patterns")
    @classmethod
    def _regexes(cls, patterns: list[str]) -> list[str]:
        for p in patterns:  # compiled as the blocklist compiles them (the `regex` module)
            try:
                regex.compile(p)
            except regex.error as e:
                raise ValueError(f"{p!r} is not a valid regex: {e}") from None
        return patterns

    @model_validator(mode="after")
    def _check(self) -> FilterSpec:
        if ":" in self.type:
            import importlib
            mod, _, cls = self.type.partition(":")
            try:
                if not callable(getattr(importlib.import_module(mod), cls)):
                    raise AttributeError(cls)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load filter class {self.type!r}: {e}") from None
        if self.type == "blocklist" and not (self.words or self.patterns):
            raise ValueError("a blocklist filter needs `words` or `patterns`")
        if self.type == "classifier" and not self.model:
            raise ValueError("a classifier filter needs `model` (a model this llmd serves)")
        return self


class FilteringConfig(_Strict):
    """Which filters a model runs: `input` on the prompt before admission, `output` on a
    sliding window of the stream; output is released only after passing every filter, and
    only a tail that could still become a match is held back, by at most `holdback_tokens`."""

    input: list[str] = Field(default_factory=list)
    output: list[str] = Field(default_factory=list)
    holdback_tokens: Annotated[int, Field(ge=0, le=256)] = 8


class ModelConfig(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-/]*$")]
    # `source` names a model in the weight store; `version` pins one stored version
    # (a prefix of its id); without it the newest stored version is served.
    source: str | None = None
    version: str | None = None
    backend: Literal["vllm", "fake"] = "vllm"
    max_prompt_tokens: Annotated[int, Field(gt=0)] | None = None
    # Checked before anything tokenizes a prompt (each prompt's UTF-8 bytes); default 8 bytes
    # per token of the prompt limit, more than any real text needs per token.
    max_prompt_bytes: Annotated[int, Field(gt=0)] | None = None
    max_output_tokens: Annotated[int, Field(gt=0)] = 1024
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    output_tokens_policy: Literal["reject", "clamp"] = "reject"
    # The backend's tool parser for `tool_choice: "auto"` (for vllm, a registered vLLM tool parser
    # such as "hermes", "llama3_json" or "pythonic") that reads the calls in the format this
    # model's chat template teaches; unset: "auto" is refused (`required` and named tools need none).
    tool_parser: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")] | None = None
    engine: EngineConfig = Field(default_factory=EngineConfig)
    fake: FakeEngineConfig = Field(default_factory=FakeEngineConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    pricing: PricingConfig = Field(default_factory=PricingConfig)
    filters: FilteringConfig = Field(default_factory=FilteringConfig)
    degradation: DegradationConfig = Field(default_factory=DegradationConfig)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.backend == "vllm" and not self.source:
            raise ValueError("a vllm model needs `source` (a model name in the weight store)")
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError("default_max_tokens must not exceed max_output_tokens")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens >= self.engine.max_model_len:
            raise ValueError("max_prompt_tokens must be below engine.max_model_len")
        return self

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens or self.engine.max_model_len - 1

    @property
    def prompt_byte_limit(self) -> int:
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.prompt_limit

    @property
    def seats(self) -> int:
        """Sequences our scheduler lets into the engine at once."""
        engine_seats = self.fake.max_num_seqs if self.backend == "fake" else self.engine.max_num_seqs
        return self.scheduling.max_running or engine_seats


class TenantConfig(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")]
    # API keys are stored only as hashes: `llmd keys new TENANT` prints a key and its line.
    keys: list[Annotated[str, Field(pattern=KEY_HASH)]] = Field(default_factory=list)
    weight: Annotated[float, Field(gt=0)] = 1.0
    tokens_per_minute: Annotated[int, Field(gt=0)] | None = None
    requests_per_minute: Annotated[int, Field(gt=0)] | None = None
    max_concurrent: Annotated[int, Field(gt=0)] | None = None
    models: list[str] = Field(default_factory=lambda: ["*"])
    default_class: PriorityClass = INTERACTIVE
    classes: list[PriorityClass] = Field(default_factory=lambda: list(CLASSES))
    ordering: Literal["fifo", "deadline"] = "fifo"
    # Filters this tenant's requests run in addition to the model's (names from [[filters]]).
    input_filters: list[str] = Field(default_factory=list)
    output_filters: list[str] = Field(default_factory=list)
    # Overrides the model's pricing.batch_multiplier for this tenant's Batch API items.
    batch_multiplier: Annotated[float, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _check(self) -> TenantConfig:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not among classes {self.classes}")
        return self

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models


class AuthConfig(_Strict):
    admin_keys: list[Annotated[str, Field(pattern=KEY_HASH)]] = Field(default_factory=list)
    # Set: /metrics needs one of these keys (or an admin key), and /ready answers only its status
    # without one: tenant names and costs are business data.
    metrics_keys: list[Annotated[str, Field(pattern=KEY_HASH)]] = Field(default_factory=list)
    # On a non-loopback bind /metrics needs metrics_keys, unless this says it is public on purpose
    # (a scraper on a trusted network that cannot send a key).
    public_metrics: bool = False
    # Keys that open only the dashboard (/dashboard): read-only views for on-call people (an admin key opens it too).
    dashboard_keys: list[Annotated[str, Field(pattern=KEY_HASH)]] = Field(default_factory=list)

    @field_validator("public_metrics")
    @classmethod
    def _metrics(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("metrics_keys"):
            raise ValueError("public_metrics = true and metrics_keys are both set: /metrics is either open or "
                             "guarded by the keys; drop one")
        return v
