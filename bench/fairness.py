"""Does llmd keep tenants apart? Noisy neighbour, fair share under overload, and the ITL target.

Every configuration starts a fresh server (`llmd serve --config TMP.toml`, or `llmd-vllm serve`
for the FCFS baseline) on a free loopback port, waits until it is ready, drives it with an
asyncio client (httpx, streaming SSE; TTFT is the time to the first chunk with content, ITL
the gaps between a stream's later content chunks), and stops it by PID.

(a) noisy neighbour: tenant A keeps N long generations in flight; tenant B sends short chats
    at a steady rate. B's TTFT solo, under A's flood through llmd (VTC), through llmd with
    target_itl_ms, and through `llmd-vllm serve` (FCFS, no tenants).
(b) fair share: two tenants offering requests 1:2 at about twice the engine's capacity,
    through llmd with fairness fcfs, vtc, and fcfs plus per-tenant requests_per_minute.
    Service = input tokens x 1 + output tokens x 2, accumulated from the streamed chunks.
(c) ITL target: p95 ITL at saturation, then AIMD (target_itl_ms) against a hand-tuned static
    max_running sweep.

    .venv/bin/python bench/fairness.py                     # all parts, about 20 minutes
    .venv/bin/python bench/fairness.py --parts b --quick   # a short smoke run of part b

Results are printed and written to docs/benchmarks.md, section "## Fairness" (one
subsection per part; a run replaces only the subsections of the parts it ran; --quick
runs write nothing). The parts live in bench/fairness_parts/; this file is their command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.fairness_parts import PartResult, fair_share, itl_target, noisy_neighbour
from bench.lib import report
from bench.lib.engines import Bench, add_server_args

SECTION = "## Fairness"
PARTS = {"a": noisy_neighbour, "b": fair_share, "c": itl_target}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="a,b,c", help="comma list of: a, b, c")
    p.add_argument("--quick", action="store_true", help="a short smoke run (small sizes; writes no docs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--itl-controller", choices=["model", "aimd"], default="model",
                   help="the target_itl_ms rows of parts a and c: the step-time model sizing the seats with AIMD "
                        "correcting it (llmd's default), or AIMD alone (itl_step_model = false)")
    add_server_args(p.add_argument_group("servers"))
    for part in PARTS.values():
        part.add_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--docs", default=str(report.DOC))
    g.add_argument("--no-docs", action="store_true")
    g.add_argument("--keep", action="store_true", help="keep the scratch folder (server logs, configs, raw JSON)")
    args = p.parse_args()
    if args.quick:  # each part's small sizes, where the option was left at its default
        for part in PARTS.values():
            for k, v in part.QUICK.items():
                if getattr(args, k) == p.get_default(k):
                    setattr(args, k, v)
    args.a_configs = [x.strip() for x in args.a_configs.split(",") if x.strip()]
    if any(x not in noisy_neighbour.CONFIGS for x in args.a_configs):
        p.error(f"--a-configs takes a comma list of {', '.join(noisy_neighbour.CONFIGS)}")
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not args.part_list or any(x not in PARTS for x in args.part_list):
        p.error("--parts takes a comma list of a, b, c")
    return args


async def run(bench: Bench) -> dict[str, PartResult]:
    """The chosen parts in order, each noting how long it took and which llmd code its servers ran."""
    out: dict[str, PartResult] = {}
    for x in bench.args.part_list:
        t0 = time.monotonic()
        bench.part_versions = []
        out[x] = await PARTS[x].run(bench)
        out[x].seconds = time.monotonic() - t0
        out[x].version = " then ".join(bench.part_versions) + (" (mixed: its servers ran different code)"
                                                               if len(bench.part_versions) > 1 else "")
        print(f"  part {x} took {out[x].seconds:.0f}s", flush=True)
    return out


def write_docs(args: argparse.Namespace, results: dict[str, PartResult], elapsed: float) -> None:
    """Replace the subsections of the parts that ran in the Fairness section."""
    intro = [("How well llmd keeps tenants apart on one engine; produced by `bench/fairness.py`. Settings for every "
             f"server: model `{args.name}`, dtype float32, eager, max_model_len 2048, "
             f"max_num_seqs {args.max_num_seqs}, "
             f"max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching on, {args.kv_gib} GiB KV cache; "
             "2-core CPU box, client in the same machine. Each subsection names the run that produced it.")]
    cmd = report.command()
    subs = {f"({k})": [f"### {r.title}", "",
                       report.stamp(version=r.version, cmd=cmd, took=f"this part took {r.seconds / 60:.1f} min "
                                                                      f"(whole command {elapsed / 60:.1f} min)"),
                       "", *r.lines]
            for k, r in results.items()}
    report.write_subsections(Path(args.docs), SECTION, intro, subs)
    print(f"wrote section to {args.docs}")


def main() -> int:
    args = parse_args()
    bench = Bench(args)
    print(f"model {bench.model}; llmd at {bench.version}; scratch {bench.scratch}", flush=True)
    t0 = time.monotonic()
    try:
        results = asyncio.run(run(bench))
        (bench.scratch / "results.json").write_text(json.dumps({k: v.data for k, v in results.items()}, default=str))
    finally:
        if args.keep:
            print(f"kept {bench.scratch}")
        else:
            shutil.rmtree(bench.scratch, ignore_errors=True)
    elapsed = time.monotonic() - t0
    for r in results.values():
        print(f"\n### {r.title}\n")
        print("\n".join(r.lines))
    ok = all(v for r in results.values() for _, v in r.verdicts)
    part_times = ", ".join(f"part {k} {r.seconds / 60:.1f}" for k, r in results.items())
    print(f"\nrun time {elapsed / 60:.1f} min ({part_times}), {bench.n_servers} server starts")
    if args.quick or args.no_docs:
        print("docs not written (--quick or --no-docs)")
    else:
        write_docs(args, results, elapsed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
