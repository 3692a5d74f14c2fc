"""Token counting and chat rendering without loading an engine.

The gateway must count prompt tokens before it admits a request, and the fake
backend needs a tokenizer too. Loading `transformers` for that is slow and heavy,
so a Hugging Face byte-level BPE `tokenizer.json` is converted into a `tiktoken`
Encoding (built locally, nothing is downloaded) and the model's own chat template
is rendered with a sandboxed jinja2, as `transformers` does.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
import zlib
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import regex
import tiktoken
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmd.backends.base import PromptError

# The pre-tokenizer regex of HF's ByteLevel(use_regex=True), i.e. GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_SIMPLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TokenizerError(Exception):
    """A model folder whose tokenizer cannot be converted (not byte-level BPE, no template...)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _token_str(v: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The same environment `transformers` renders chat templates in."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class _SimpleCodec:
    """Word/punctuation pieces, one token each, id = crc32 mod 50000; for tests without model files.

    An id cannot be turned back into its piece, so decoding reads the pieces encoded so far, and
    that memory is the process's, shared by every instance: a real tokenizer loaded again from the
    same files decodes the same ids the same way, so an engine rebuilt after a crash (a new
    instance) must decode the token ids of a prompt its predecessor encoded (a resumed request's).
    Two pieces can share an id; the latest encoded wins, since a decode follows its own encode."""

    n_vocab = 50000
    specials: ClassVar[dict[str, int]] = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    _seen: ClassVar[dict[int, str]] = {i: s for s, i in specials.items()}

    def __init__(self) -> None:
        alts = "|".join(re.escape(s) for s in self.specials)
        self._re = re.compile(rf"{alts}|\s*\w+|\s*[^\w\s]|\s+")

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in self._re.findall(text):
            tid = self.specials.get(piece)
            if tid is None:
                tid = 3 + zlib.crc32(piece.encode()) % (self.n_vocab - 3)
                if len(self._seen) < 1_000_000 or tid in self._seen:
                    self._seen[tid] = piece
            out.append(tid)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._seen.get(i, "") for i in ids)


class TiktokenTokenizer:
    """Encode/decode/render for one model. Build with `from_hf_dir` or `simple`."""

    def __init__(
        self,
        name: str,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        template: str,
        n_vocab: int,
        special_tokens: dict[str, int],
        template_vars: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self._encode, self._decode = encode, decode
        self._template = _jinja_env().from_string(template)
        self.n_vocab = n_vocab
        self.special_tokens = dict(special_tokens)
        self.template_vars = dict(template_vars or {})
        self.bos_token = self.template_vars.get("bos_token")
        self.eos_token = self.template_vars.get("eos_token")

    # -- construction ------------------------------------------------------
    @classmethod
    def simple(cls) -> TiktokenTokenizer:
        """A deterministic stand-in with a ChatML template; needs no model files."""
        codec = _SimpleCodec()
        tv = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
        return cls("simple", codec.encode, codec.decode, _SIMPLE_TEMPLATE, codec.n_vocab, codec.specials, tv)

    @classmethod
    def from_hf_dir(cls, path: Path) -> TiktokenTokenizer:
        """Load (cached per folder and tokenizer.json mtime) the tokenizer of a HF model folder."""
        path = Path(path).resolve()
        tj = path / "tokenizer.json"
        try:
            key = (str(path), tj.stat().st_mtime_ns)
        except OSError:
            raise TokenizerError(f"{path}: no tokenizer.json") from None
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
        if hit is None:
            hit = cls._build(path)
            with _CACHE_LOCK:
                _CACHE[key] = hit
        return hit

    @classmethod
    def _build(cls, path: Path) -> TiktokenTokenizer:
        try:
            spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
            cfg_file = path / "tokenizer_config.json"
            tcfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{path}: cannot read tokenizer files: {e}") from None
        enc, missing, normalize = _hf_encoding(spec, str(path))
        n_vocab = max([*(spec["model"]["vocab"].values()), *enc._special_tokens.values()]) + 1
        has_missing = re.compile(_char_class(missing)).search if missing else None
        slow = _SlowPath(enc, missing)

        def encode(text: str) -> list[int]:
            if normalize:
                text = unicodedata.normalize("NFC", text)
            if has_missing is not None and has_missing(text):
                return slow.encode(text)
            return enc.encode(text, allowed_special="all")

        def decode(ids: Sequence[int]) -> str:
            ids = list(ids)
            if any(not 0 <= i < n_vocab for i in ids):
                raise ValueError("token ids outside the vocabulary")
            return enc.decode_bytes(ids).decode("utf-8", errors="replace")

        template = _read_template(path, tcfg)
        tv = {k: s for k in ("bos_token", "eos_token", "pad_token", "unk_token") if (s := _token_str(tcfg.get(k)))}
        return cls(str(path), encode, decode, template, n_vocab, enc._special_tokens, tv)

    # -- use ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text is encoded as the special token, as chat templates need."""
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(ids)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied with `add_generation_prompt=True`."""
        if not messages:
            raise PromptError("messages must not be empty")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.template_vars)
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template failed: {e}") from None

    def count_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat (the template carries any BOS; nothing is added)."""
        return self.encode(self.render_chat(messages))


_CACHE: dict[tuple[str, int], TiktokenTokenizer] = {}
_CACHE_LOCK = threading.Lock()


def _read_template(path: Path, tcfg: dict[str, Any]) -> str:
    f = path / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    t = tcfg.get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if not isinstance(t, str) or not t:
        raise TokenizerError(f"{path}: no chat template (chat_template.jinja or tokenizer_config.json chat_template)")
    return t


def _pre_tokenizer_pattern(pre: dict[str, Any] | None, where: str) -> str:
    """GPT-2 style ByteLevel(use_regex) or Split(regex) + ByteLevel(use_regex=False); nothing else."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PATTERN
    if pre and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if (
            len(steps) == 2
            and steps[0].get("type") == "Split"
            and "Regex" in (steps[0].get("pattern") or {})
            and steps[0].get("behavior") == "Isolated"
            and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)
            and not steps[1].get("add_prefix_space")
        ):
            return steps[0]["pattern"]["Regex"]
    raise TokenizerError(f"{where}: unsupported pre_tokenizer {json.dumps(pre)[:200]}")


def _hf_encoding(spec: dict[str, Any], where: str) -> tuple[tiktoken.Encoding, frozenset[int], bool]:
    """A tiktoken Encoding equivalent to a HF byte-level BPE; also the ids of filler bytes, and whether to NFC."""
    model = spec.get("model") or {}
    if (model.get("type") != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix")):
        raise TokenizerError(f"{where}: not a byte-level BPE tokenizer (model {model.get('type')!r})")
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise TokenizerError(f"{where}: unsupported normalizer {norm.get('type')!r}")
    pattern = _pre_tokenizer_pattern(spec.get("pre_tokenizer"), where)
    specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []}
    if not isinstance(model.get("vocab"), dict) or not model["vocab"]:
        raise TokenizerError(f"{where}: BPE model without a vocab")
    ranks: dict[bytes, int] = {}
    for tok, tid in model["vocab"].items():
        if tok in specials:
            continue
        try:
            ranks[bytes(_BYTE_DECODER[c] for c in tok)] = tid
        except KeyError:
            raise TokenizerError(f"{where}: not a byte-level BPE vocabulary (token {tok!r})") from None
    # tiktoken merges the adjacent pair whose result has the lowest id; HF the earliest merge.
    # They agree only when merge results' ids grow with merge order.
    last = -1
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        tid = model["vocab"].get(a + b)
        if tid is None or tid <= last:
            raise TokenizerError(f"{where}: merge order does not follow token ids; cannot convert to tiktoken")
        last = tid
    # tiktoken needs every single byte: give absent ones filler ids (encode() never emits them).
    top = max([*ranks.values(), *specials.values()]) + 1
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if any(0x80 <= b < 0xC0 for b in missing):
        raise TokenizerError(f"{where}: the vocabulary lacks UTF-8 continuation bytes; cannot convert to tiktoken")
    for i, b in enumerate(missing):
        ranks[bytes([b])] = top + i
    enc = tiktoken.Encoding(name=f"hf:{where}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    return enc, frozenset(missing), norm is not None


def _char_class(missing: frozenset[int]) -> str:
    """A regex class of the characters whose UTF-8 form holds one of `missing` (ASCII or lead bytes)."""
    ranges = []
    for b in sorted(missing):
        if b < 0x80:
            lo, hi = b, b
        elif 0xC2 <= b < 0xE0:
            lo = (b & 0x1F) << 6
            hi = lo + 0x3F
        elif 0xE0 <= b < 0xF0:
            lo = (b & 0x0F) << 12
            hi = lo + 0xFFF
        elif 0xF0 <= b < 0xF5:
            lo = (b & 0x07) << 18
            hi = lo + 0x3FFFF
        else:  # never part of UTF-8
            continue
        ranges.append(f"\\U{lo:08x}-\\U{hi:08x}")
    return "[" + "".join(ranges) + "]" if ranges else "(?!)"


class _SlowPath:
    """HF drops bytes its vocab lacks (here: a few ASCII controls) *after* splitting, so BPE
    merges across them; tiktoken cannot, so such (rare) text is split and merged piece by piece."""

    def __init__(self, enc: tiktoken.Encoding, missing: frozenset[int]) -> None:
        self._enc = enc
        self._missing = bytes(sorted(missing))
        self._pat = regex.compile(enc._pat_str)
        specials = sorted(enc._special_tokens, key=len, reverse=True)
        self._special_re = regex.compile("(" + "|".join(map(regex.escape, specials)) + ")") if specials else None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        parts = self._special_re.split(text) if self._special_re else [text]
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._enc._special_tokens[part])
                continue
            for piece in self._pat.findall(part):
                b = piece.encode("utf-8", errors="surrogatepass").translate(None, self._missing)
                if b:
                    out.extend(self._enc._encode_single_piece(b))
        return out
