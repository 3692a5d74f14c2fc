"""The `llmd` command's entry point: for `llmd plan sim` and `llmd plan search`, llmd's modules
compiled with mypyc are put in place (llmd/plan/compiled.py) before llmd.cli imports any of
them; every other command starts llmd.cli as it is."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "plan" and sys.argv[2] in ("sim", "search") \
            and not {"-h", "--help"} & set(sys.argv[3:]):
        from llmd.plan.compiled import CompileError, use

        try:
            use(log=lambda line: print(line, file=sys.stderr, flush=True))
        except CompileError as e:
            print(f"Error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    from llmd.cli import main as cli_main

    cli_main()
