"""Engines behind the gateway. `build_backend` turns one model's config into a Backend.

vLLM is imported only when a vllm model is configured, so the fake backend (and
the unit tests that use it) never pay for importing it.
"""

from __future__ import annotations

import asyncio

from llmd.backends.base import Backend, BackendError, EngineDead, PromptError
from llmd.config import ModelConfig
from llmd.store import StoreError, WeightStore, tokenizer_id

__all__ = ["Backend", "BackendError", "EngineDead", "PromptError", "build_backend", "unknown_tool_parser"]


def unknown_tool_parser(cfg: ModelConfig) -> str | None:
    """Why the model's `tool_parser` names no parser its backend has (None: it does, or none is set).
    Checked at start, so a typo is an error there, not a 400 on every `auto` request."""
    if cfg.tool_parser is None:
        return None
    if cfg.backend == "vllm":
        from llmd.backends.vllm_tools import parser_names
    else:
        from llmd.backends.fake_tools import parser_names
    names = parser_names()
    if cfg.tool_parser in names:
        return None
    return f"unknown tool parser {cfg.tool_parser!r}; the {cfg.backend} backend has: {', '.join(names)}"


async def build_backend(cfg: ModelConfig, store: WeightStore) -> Backend:
    """Resolve and verify the weights, then construct (not start) the backend."""
    stored = None
    if cfg.source:
        stored = store.resolve(cfg.source, cfg.version)
        await asyncio.to_thread(store.verify, stored)
    backend: Backend
    override = None
    if cfg.backend == "vllm":
        from llmd.backends.vllm_engine import VllmBackend

        assert stored is not None  # config validation guarantees a source
        backend = VllmBackend(cfg.name, stored.version, stored.path, cfg.engine, cfg.tool_parser)
        override = cfg.engine.extra.get("tokenizer")
    elif cfg.backend == "fake":
        from llmd.backends.fake import FakeBackend
        from llmd.backends.tokenizer import TiktokenTokenizer

        tok = TiktokenTokenizer.from_hf_dir(stored.path) if stored else TiktokenTokenizer.simple()
        version = stored.version if stored else "fake-" + cfg.name
        backend = FakeBackend(cfg.name, version, cfg.engine.max_model_len, cfg.fake, tok)
    else:
        raise StoreError(f"unknown backend {cfg.backend!r}")
    path = stored.path if stored else None
    backend.tokenizer_id = await asyncio.to_thread(tokenizer_id, path, str(override) if override else None)
    return backend
