"""Fuzz `llmd serve` from its own /openapi.json: schemathesis cases, positive and negative, on
every operation, over real HTTP, on the fake backend (bench/lib/fuzz.py says what is sent and
judged). Targets: 0 responses 5xx (and no dropped connection, no error without an OpenAI error
body), the server still ready afterwards.

    .venv/bin/python bench/fuzz.py                 # 10,000 cases, seed 0
    .venv/bin/python bench/fuzz.py --cases 500 --no-write

Results are printed and written to docs/benchmarks.md, section "## Fuzzing" (replaced; other
sections are kept). `make reliability` runs the same 10,000 cases as a test
(tests/reliability/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import fuzz, report
from bench.lib.servers import start_server_process, stop

TITLE = "## Fuzzing: schemathesis against /openapi.json"


def run(cases: int, seed: int, tmp: Path) -> tuple[fuzz.FuzzResult, float, bool]:
    """(result, seconds, still ready) of `cases` cases against a fresh `llmd serve` (fake backend)."""
    srv = start_server_process(fuzz.FUZZ_TOML, tmp, ready_timeout=120)
    try:
        t0 = time.monotonic()
        result = fuzz.fuzz(srv.url, cases, seed)
        seconds = time.monotonic() - t0
        return result, seconds, fuzz.ready(srv.url)
    finally:
        stop(srv.proc)


def report_lines(args: argparse.Namespace, r: fuzz.FuzzResult, seconds: float, ready: bool) -> list[str]:
    ok = r.server_errors == 0 and not r.failures and ready
    rows = [(op, n) for op, n in sorted(r.per_op.items())]
    return [
        TITLE, "",
        report.stamp(seconds),
        "",
        f"`llmd serve` on the fake backend (bench/lib/fuzz.py's config: one tenant, an admin key), "
        f"{len(r.per_op)} operations from its own /openapi.json, schemathesis {_version()} positive and negative "
        f"cases with a key drawn per case (mostly the right one; an admin's, none, an unknown one), seed {args.seed}. "
        f"{r.cases} cases in {seconds:.0f} s ({r.cases / seconds:.0f}/s).",
        "",
        *report.table(["status", "responses"], sorted(r.statuses.items())),
        "",
        *report.table(["operation", "cases"], rows),
        "",
        f"Answers the document does not describe (status, content type or body shape): {len(r.drift)}.",
        "",
        *report.verdict_lines([(f"{r.cases} cases (>= 10,000): 0 responses 5xx ({r.server_errors}); 0 failures "
                                f"of any kind, 5xx, dropped connections and errors without an OpenAI error body "
                                f"together ({len(r.failures)})", ok and r.cases >= 10000),
                               ("server still ready afterwards", ready)]),
    ]


def _version() -> str:
    from importlib.metadata import version

    return version("schemathesis")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10000, help="at least this many cases (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="Hypothesis seed: the same seed sends the same cases")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmd-fuzz-") as tmp:
        r, seconds, ready = run(args.cases, args.seed, Path(tmp))
    lines = report_lines(args, r, seconds, ready)
    print("\n".join(lines))
    for f in r.failures[:20] + r.drift[:20]:
        print("\n" + f, file=sys.stderr)
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if r.server_errors == 0 and not r.failures and ready else 1


if __name__ == "__main__":
    sys.exit(main())
