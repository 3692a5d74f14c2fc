"""How much does llmd cost over vLLM's own server? Measured with vLLM's own benchmark.

Both servers run the same model with the same engine settings; `llmd-vllm bench serve`
(random prompts, OpenAI completions endpoint) drives each in turn. Every round starts a
fresh server on a free port, waits until it is ready, benchmarks it, and stops it by PID.
The first round of each server is a discarded warm-up; measured rounds alternate the
server order (ABBA) so slow drift on a shared machine does not favour one side.

    .venv/bin/python bench/overhead.py                      # both sides, 3 rounds
    .venv/bin/python bench/overhead.py --servers vllm --rounds 1 --num-prompts 16

The summary (medians over rounds of the per-round llmd/vLLM ratios) is checked against
the targets and written to docs/benchmarks.md, section "## Overhead: llmd vs vllm serve".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common import free_port, model_dir, stop, tail, tool, wait_ready  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SECTION = "## Overhead: llmd vs vllm serve"
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

    def llmd(port: int, scratch: Path) -> list[str]:
        cfg = scratch / f"llmd-{port}.toml"
        cfg.write_text(f"""[server]
host = "127.0.0.1"
port = {port}

[[models]]
name = "{args.name}"
source = "{args.source}"
backend = "vllm"
max_output_tokens = 1024

[models.engine]
max_model_len = 2048
kv_cache_gib = 1
max_num_seqs = 64
max_num_batched_tokens = 2048
enable_prefix_caching = true
enforce_eager = true
dtype = "float32"
""")
        return [tool("llmd"), "serve", "--config", str(cfg)]

    return {"vllm": Server("vllm", "/health", vllm), "llmd": Server("llmd", "/ready", llmd)}


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
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
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
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return f"HTTP {r.status}: {r.read(300).decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read(500).decode(errors='replace')}"


def one_round(args: argparse.Namespace, model: Path, srv: Server, scratch: Path, tag: str) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    log = scratch / f"{tag}-{srv.name}-server.log"
    with log.open("w") as f:
        proc = subprocess.Popen(srv.command(port, scratch), stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)
    try:
        t0 = time.monotonic()
        wait_ready(proc, f"http://127.0.0.1:{port}{srv.ready_path}", args.ready_timeout, log)
        print(f"  {srv.name} ready on :{port} after {time.monotonic() - t0:.0f}s (pid {proc.pid})", flush=True)
        load1 = os.getloadavg()[0]  # the machine is shared: record how busy it was
        result = bench(args, model, port, scratch / f"{tag}-{srv.name}.json", env)
        result["load1_before"] = load1
        if result.get("failed"):
            print(f"WARNING: {srv.name}: {result['failed']} of {args.num_prompts} requests failed; "
                  f"a probe request gets {probe(args, port)}", flush=True)
        if not result.get("completed"):
            raise RuntimeError(f"{srv.name}: no request completed")
        return result
    finally:
        stop(proc)


def fmt_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(rows: list[tuple[str, str, dict]]) -> list[str]:
    head = ["round", "server"] + [m[0] for m in METRICS] + ["ok/failed", "load1 before"]
    lines = [fmt_row(head), fmt_row(["---"] * len(head))]
    for rnd, name, r in rows:
        vals = [f"{r.get(k, float('nan')):.1f}" for _, k in METRICS]
        lines.append(fmt_row([rnd, name] + vals + [f"{r.get('completed')}/{r.get('failed')}", f"{r['load1_before']:.2f}"]))
    return lines


def summary(results: dict[str, list[dict]]) -> tuple[list[str], bool | None]:
    names = [n for n in ("vllm", "llmd") if results.get(n)]
    lines = [fmt_row(["figure"] + [f"{n} (median)" for n in names] + (["llmd/vllm (median of rounds)"] if len(names) == 2 else [])),
             fmt_row(["---"] * (len(names) + 1 + (len(names) == 2)))]
    ratios: dict[str, float] = {}
    for label, key in METRICS:
        cells = [label] + [f"{statistics.median(r[key] for r in results[n]):.1f}" for n in names]
        if len(names) == 2:
            ratios[key] = statistics.median(l[key] / v[key] for l, v in zip(results["llmd"], results["vllm"]))
            cells.append(f"{ratios[key]:.3f}")
        lines.append(fmt_row(cells))
    if len(names) < 2:
        return lines, None
    tp, ttft = ratios["output_throughput"], ratios["p50_ttft_ms"]
    ok_tp, ok_ttft = tp >= TARGET_THROUGHPUT, ttft <= TARGET_TTFT
    lines += ["", f"- output throughput ratio {tp:.3f} (target >= {TARGET_THROUGHPUT}): {'PASS' if ok_tp else 'MISS'}",
              f"- median TTFT ratio {ttft:.3f} (target <= {TARGET_TTFT}): {'PASS' if ok_ttft else 'MISS'}"]
    return lines, ok_tp and ok_ttft


def write_docs(path: Path, body: list[str]) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == SECTION), None)
    if start is None:
        new = lines + [""] + body
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = lines[:start] + body + ([""] if end < len(lines) else []) + lines[end:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(new).rstrip("\n") + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="vllm,llmd", help="comma list of: vllm, llmd")
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
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-docs", action="store_true", help="do not write the docs section")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, JSON results)")
    args = p.parse_args()

    model = model_dir(args)
    specs = servers(args, model)
    chosen = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not chosen or any(s not in specs for s in chosen):
        p.error(f"--servers takes a comma list of {', '.join(specs)}")
    scratch = Path(tempfile.mkdtemp(prefix="llmd-overhead-"))
    print(f"model {model}; scratch {scratch}")
    results: dict[str, list[dict]] = {n: [] for n in chosen}
    rows: list[tuple[str, str, dict]] = []
    try:
        for rnd in range(args.rounds + 1):
            tag = "warmup" if rnd == 0 else f"r{rnd}"
            order = chosen if rnd % 2 == 0 else chosen[::-1]
            print(f"round {tag}: {', '.join(order)}", flush=True)
            for name in order:
                r = one_round(args, model, specs[name], scratch, tag)
                if rnd:
                    results[name].append(r)
                    rows.append((tag, name, r))
            if rnd:
                print("\n".join(table([x for x in rows if x[0] == tag])), flush=True)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    sum_lines, verdict = summary(results)
    print("\nsummary\n" + "\n".join(sum_lines))
    if len(chosen) == 2 and not args.no_docs:
        cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
        body = [SECTION, "", f"Date: {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}", "",
                f"Command: `{cmd}`", "",
                f"Settings: model `{args.name}` ({model}), dtype float32, eager, max_model_len 2048, "
                "max_num_seqs 64, max_num_batched_tokens 2048, prefix caching on, 1 GiB KV cache; "
                f"`bench serve --backend openai --dataset-name random`, input {args.input_len}, "
                f"output {args.output_len}{' (ignore_eos)' if args.ignore_eos else ''}, "
                f"{args.num_prompts} prompts, max concurrency {args.max_concurrency}, request rate "
                f"{args.request_rate}, temperature {args.temperature}, {args.num_warmups} warm-up requests; "
                f"one discarded warm-up round per server, then {args.rounds} measured rounds, "
                "fresh server each round, order alternating (ABBA).", "",
                "Per round:", ""] + table(rows) + ["", "Summary:", ""] + sum_lines
        write_docs(Path(args.docs), body)
        print(f"wrote section to {args.docs}")
    return 0 if verdict in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
