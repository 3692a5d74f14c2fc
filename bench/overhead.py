"""How much does llmd cost over vLLM's own server? Measured with vLLM's own benchmark.

Both servers run the same model with the same engine settings; `llmd-vllm bench serve`
(random prompts, OpenAI completions endpoint) drives each in turn. Every round starts a
fresh server on a free port, waits until it is ready, benchmarks it, and stops it by PID.
The first round of each server is a discarded warm-up; measured rounds alternate the
server order (ABBA) so slow drift on a shared machine does not favour one side.

    .venv/bin/python bench/overhead.py                      # vllm, llmd as shipped, llmd without filters
    .venv/bin/python bench/overhead.py --servers vllm --rounds 1 --num-prompts 16

The summary (medians over rounds of the per-round llmd/vLLM ratios) is checked against
the targets and written to docs/benchmarks.md, section "## Overhead: llmd vs vllm serve".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report, stats
from bench.lib.servers import dump_toml, free_port, model_dir, running, tail, tool

SECTION = "## Overhead: llmd vs vllm serve"
SHIPPED = Path(__file__).resolve().parent.parent / "config.toml"
DEMO_KEY = "sk-llmd-demo-change-me"  # config.toml's demo tenant
TARGET_THROUGHPUT = 0.97  # llmd/vLLM output throughput, at least
TARGET_TTFT = 1.05  # llmd/vLLM median TTFT, at most
# (label, key in bench serve's JSON result)
METRICS = [
    ("out tok/s", "output_throughput"),
    ("TTFT p50 ms", "p50_ttft_ms"),
    ("TTFT p95 ms", "p95_ttft_ms"),
    ("ITL p50 ms", "p50_itl_ms"),
    ("ITL p95 ms", "p95_itl_ms"),
]


@dataclass
class Server:
    name: str
    ready_path: str
    command: Callable[[int, Path], list[str]]  # (port, scratch dir) -> argv


def servers(args: argparse.Namespace, model: Path) -> dict[str, Server]:
    def vllm(port: int, _: Path) -> list[str]:
        return [tool("llmd-vllm"), "serve", str(model), "--served-model-name", args.name,
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
                "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]

    def llmd(filters: bool) -> Callable[[int, Path], list[str]]:
        def command(port: int, scratch: Path) -> list[str]:
            cfg = scratch / f"llmd-{port}.toml"
            cfg.write_text(dump_toml(shipped_config(port, scratch / f"llmd-{port}.db", filters)))
            return [tool("llmd"), "serve", "--config", str(cfg)]
        return command

    return {"vllm": Server("vllm", "/health", vllm), "llmd": Server("llmd", "/ready", llmd(True)),
            "llmd-nofilters": Server("llmd-nofilters", "/ready", llmd(False))}


def shipped_config(port: int, db: Path, filters: bool) -> dict[str, Any]:
    """config.toml as users run it (filters, tenant, ITL target, degradation); only the port and
    the usage DB moved. `filters=False`: the bench-only variant without input and output filters."""
    cfg = tomllib.loads(SHIPPED.read_text(encoding="utf-8"))
    cfg["server"] |= {"host": "127.0.0.1", "port": port, "db_path": str(db)}
    if not filters:
        for m in cfg["models"]:
            m.pop("filters", None)
    return cfg


def bench(args: argparse.Namespace, model: Path, port: int, out: Path, env: dict[str, str]) -> dict:
    cmd = [tool("llmd-vllm"), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--host", "127.0.0.1", "--port", str(port), "--model", args.name, "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.max_concurrency), "--request-rate", str(args.request_rate),
           "--seed", str(args.seed), "--temperature", str(args.temperature),
           "--num-warmups", str(args.num_warmups), "--percentile-metrics", "ttft,itl",
           "--metric-percentiles", "50,95", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    log = out.with_suffix(".log")
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc != 0 or not out.exists():
        raise RuntimeError(f"bench serve failed (rc {rc}); log {log}:\n{tail(log)}")
    return json.loads(out.read_text())


def probe(args: argparse.Namespace, port: int) -> str:
    """One request shaped like bench serve's, to show why the server refused its requests."""
    body = {"model": args.name, "prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1.0,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {DEMO_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return f"HTTP {r.status}: {r.read(300).decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read(500).decode(errors='replace')}"


def one_round(args: argparse.Namespace, model: Path, srv: Server, scratch: Path, tag: str) -> dict:
    """A fresh server, benchmarked once by `bench serve`, then stopped with its process group."""
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    log = scratch / f"{tag}-{srv.name}-server.log"
    t0 = time.monotonic()
    with running(srv.command(port, scratch), f"http://127.0.0.1:{port}{srv.ready_path}", log,
                 args.ready_timeout, env) as proc:
        print(f"  {srv.name} ready on :{port} after {time.monotonic() - t0:.0f}s (pid {proc.pid})", flush=True)
        load1 = os.getloadavg()[0]  # the machine is shared: record how busy it was
        result = bench(args, model, port, scratch / f"{tag}-{srv.name}.json",
                       {**os.environ, **env, "OPENAI_API_KEY": DEMO_KEY})
        result["load1_before"] = load1
        if result.get("failed"):
            print(f"WARNING: {srv.name}: {result['failed']} of {args.num_prompts} requests failed; "
                  f"a probe request gets {probe(args, port)}", flush=True)
        if not result.get("completed"):
            raise RuntimeError(f"{srv.name}: no request completed")
        return result


def table(rows: list[tuple[str, str, dict]]) -> list[str]:
    """Every measured round's figures (bench serve's own percentiles: numpy's, as bench/lib/stats.py)."""
    head = ["round", "server"] + [m[0] for m in METRICS] + ["ok/failed", "load1 before"]
    return report.table(head, [[rnd, name, *(f"{r.get(k, float('nan')):.1f}" for _, k in METRICS),
                                f"{r.get('completed')}/{r.get('failed')}", f"{r['load1_before']:.2f}"]
                               for rnd, name, r in rows])


def summary(results: dict[str, list[dict]]) -> tuple[list[str], bool | None]:
    """Medians over rounds per server, and the median of the per-round llmd/vLLM ratios against the targets."""
    names = [n for n in ("vllm", "llmd", "llmd-nofilters") if results.get(n)]
    both = "vllm" in names and "llmd" in names
    variants = [n for n in names if n != "vllm"] if "vllm" in names else []
    head = (["figure"] + [f"{n} (median)" for n in names]
            + [f"{n}/vllm (median of rounds)" for n in variants])
    rows: list[list[str]] = []
    ratios: dict[str, float] = {}
    for label, key in METRICS:
        cells = [label] + [f"{stats.median(r[key] for r in results[n]):.1f}" for n in names]
        for n in variants:
            ratio = stats.median(lm[key] / v[key] for lm, v in zip(results[n], results["vllm"], strict=True))
            cells.append(f"{ratio:.3f}")
            if n == "llmd":
                ratios[key] = ratio
        rows.append(cells)
    lines = report.table(head, rows)
    if not both:
        return lines, None
    tp, ttft = ratios["output_throughput"], ratios["p50_ttft_ms"]
    verdicts = [(f"output throughput ratio {tp:.3f} (target >= {TARGET_THROUGHPUT})", tp >= TARGET_THROUGHPUT),
                (f"median TTFT ratio {ttft:.3f} (target <= {TARGET_TTFT})", ttft <= TARGET_TTFT)]
    notes = [HOLD_NOTE] if "llmd-nofilters" in names else []
    return [*lines, "", *report.verdict_lines(verdicts), *notes], all(ok for _, ok in verdicts)


HOLD_NOTE = ("- llmd's TTFT and ITL p95 above llmd-nofilters' are the output filters' hold-back on this workload: "
             "greedy continuations of random tokens are mostly long runs with no space (\"assistassistassist...\"), "
             "each of which could be an e-mail address's local part until 64 characters have passed (RFC 5321's "
             "bound), so such a stream's first text waits ~15-30 tokens; in prose only the last word waits "
             "(section Filters on the real engine).")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="vllm,llmd,llmd-nofilters",
                   help="comma list of: vllm, llmd (config.toml as shipped), llmd-nofilters (the same without "
                        "filters, a bench-only variant reported beside it)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per server (plus one warm-up)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--num-warmups", type=int, default=4, help="bench serve warm-up requests each round")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let generation stop at EOS (output lengths then differ between servers)")
    p.add_argument("--name", default="smollm2", help="served model name")
    p.add_argument("--source", default="smollm2", help="weight-store model name")
    p.add_argument("--model-dir", help="model folder (default: the weight store's)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--docs", default=str(report.DOC))
    p.add_argument("--no-docs", action="store_true", help="do not write the docs section")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, JSON results)")
    args = p.parse_args()
    args.chosen = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.chosen or any(s not in ("vllm", "llmd", "llmd-nofilters") for s in args.chosen):
        p.error("--servers takes a comma list of vllm, llmd, llmd-nofilters")
    return args


def run_rounds(args: argparse.Namespace, model: Path, scratch: Path) -> tuple[dict[str, list[dict]],
                                                                            list[tuple[str, str, dict]]]:
    """A discarded warm-up round, then --rounds measured ones, server order alternating (ABBA)."""
    specs = servers(args, model)
    results: dict[str, list[dict]] = {n: [] for n in args.chosen}
    rows: list[tuple[str, str, dict]] = []
    for rnd in range(args.rounds + 1):
        tag = "warmup" if rnd == 0 else f"r{rnd}"
        order = args.chosen if rnd % 2 == 0 else args.chosen[::-1]
        print(f"round {tag}: {', '.join(order)}", flush=True)
        for name in order:
            r = one_round(args, model, specs[name], scratch, tag)
            if rnd:
                results[name].append(r)
                rows.append((tag, name, r))
        if rnd:
            print("\n".join(table([x for x in rows if x[0] == tag])), flush=True)
    return results, rows


def main() -> int:
    args = parse_args()
    model = model_dir(args)
    scratch = Path(tempfile.mkdtemp(prefix="llmd-overhead-"))
    print(f"model {model}; scratch {scratch}")
    try:
        results, rows = run_rounds(args, model, scratch)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    sum_lines, verdict = summary(results)
    print("\nsummary\n" + "\n".join(sum_lines))
    if "vllm" in args.chosen and "llmd" in args.chosen and not args.no_docs:
        body = [SECTION, "", report.stamp(), "",
                (f"Settings: model `{args.name}` ({model}), dtype float32, eager, max_model_len 2048, "
                 "max_num_seqs 64, max_num_batched_tokens 2048, prefix caching on, 1 GiB KV cache; "
                 "`llmd` is config.toml as shipped (its input and output filters, its demo tenant's key, its "
                 "target_itl_ms, its degradation steps; only the port and the usage DB moved), "
                 "`llmd-nofilters` the same without filters (a bench-only variant, beside it, never instead); "
                 f"`bench serve --backend openai --dataset-name random`, input {args.input_len}, "
                 f"output {args.output_len}{' (ignore_eos)' if args.ignore_eos else ''}, "
                 f"{args.num_prompts} prompts, max concurrency {args.max_concurrency}, request rate "
                 f"{args.request_rate}, temperature {args.temperature}, {args.num_warmups} warm-up requests; "
                 f"one discarded warm-up round per server, then {args.rounds} measured rounds, "
                 "fresh server each round, order alternating (ABBA); percentiles are bench serve's (numpy's "
                 "linear interpolation, the definition of bench/lib/stats.py)."), "",
                "Per round:", "", *table(rows), "", "Summary:", "", *sum_lines]
        report.write_section(Path(args.docs), body)
        print(f"wrote section to {args.docs}")
    return 0 if verdict in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
