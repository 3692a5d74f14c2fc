"""Do widely used clients that nobody here wrote work against llmd? guidellm's benchmark and
lm-evaluation-harness, unchanged, against `llmd serve` on the shipped config.toml.

The clients are heavy packages with their own pins (torch, transformers, datasets), so they live
in their own virtual environment, `.venv-clients` (git-ignored), made on first use: torch first,
from the local CPU wheel when PIP_FIND_LINKS holds one (else pip would pull a CUDA build of
several GB), then the pinned clients. The project's .venv is never touched.

`llmd serve` runs config.toml as shipped (its tenant and key, limits and filters; only the port
and a scratch SQLite file differ), then `vllm serve` on the same model directory with the same
engine settings: one server at a time, each with both cores. Against each:

  1. guidellm: its sweep (synchronous, throughput, then constant rates in between) on synthetic
     prompts of 256 tokens with 128 output tokens; each benchmark bounded by --guidellm-seconds,
     at most --guidellm-concurrency requests in flight. It streams chat completions and asks for
     `stream_options.continuous_usage_stats`.
  2. lm-evaluation-harness: model `local-completions` with its default tokenized requests and
     batch_size 8 (several token-id prompts per request, echo, logprobs, max_tokens 1), on a
     multiple-choice task from a JSONL this script writes (nothing is downloaded).

Both accuracies, the per-question agreement and the wall times go to docs/benchmarks.md
("## Clients"), with guidellm's per-benchmark figures and every error it counted.

    python bench/clients.py               # ~8 min on a 2-core CPU (the first run adds ~1 min for the venv)
    python bench/clients.py --no-write --guidellm-seconds 10
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report, stats
from bench.lib.engines import other_engines
from bench.lib.servers import free_port, running, tail, tool
from llmd.auth import hash_key
from llmd.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Clients"
DEMO_KEY = "sk-llmd-demo-change-me"  # config.toml's demo tenant
TORCH = "torch==2.13.0"  # the CPU build: this machine keeps its wheel in PIP_FIND_LINKS
CLIENTS = ["guidellm==0.8.1", "lm-eval[api]==0.4.13"]  # lm-eval's tokenizer is transformers, which guidellm pins
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TASK = "llmd_mc"


# -- the clients' own environment -------------------------------------------------
def ensure_venv(venv: Path, torch: str) -> Path:
    """`venv` with the pinned clients (made, or completed, when its stamp is missing); its bin folder."""
    stamp = venv / (".installed-" + "-".join(p.replace("[api]", "") for p in [TORCH, *CLIENTS]))
    if stamp.exists():
        return venv / "bin"
    print(f"making {venv} (torch, then {', '.join(CLIENTS)}) ...", flush=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for what in ([torch], CLIENTS):  # torch first: else the clients' `torch` requirement pulls a CUDA build
        done = subprocess.run([*pip, *what], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"pip install {' '.join(what)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    stamp.touch()
    return venv / "bin"


def versions(bin_dir: Path) -> str:
    code = ("import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
            "['guidellm', 'lm_eval', 'transformers', 'torch']))")
    return subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def client_env(scratch: Path, **extra: str) -> dict[str, str]:
    """The clients run offline, with their caches in the scratch folder and none of our PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | OFFLINE | {"HF_HOME": str(scratch / "hf")} | extra


# -- the multiple-choice task -----------------------------------------------------
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
            ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"),
            ("Thailand", "Bangkok")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"), ("happy", "sad"),
             ("open", "closed"), ("early", "late"), ("light", "dark"), ("full", "empty"), ("old", "young"),
             ("wet", "dry"), ("hard", "soft"), ("rich", "poor"), ("loud", "quiet"), ("win", "lose"),
             ("push", "pull"), ("buy", "sell"), ("first", "last"), ("inside", "outside")]


def _question(rng: random.Random, text: str, right: str, wrong: list[str]) -> dict[str, Any]:
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {"question": text, "choices": choices, "answer": choices.index(right)}


def questions(n_sums: int, seed: int = 0) -> list[dict[str, Any]]:
    """Sums of small numbers, capitals and opposites, four choices each (the same every run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sums):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        wrong: set[int] = set()
        while len(wrong) < 3:
            wrong.add(a + b + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
        out.append(_question(rng, f"What is {a} plus {b}?", str(a + b), [str(w) for w in sorted(wrong)]))
    for country, city in CAPITALS:
        others = rng.sample([c for _, c in CAPITALS if c != city], 3)
        out.append(_question(rng, f"What is the capital of {country}?", city, others))
    for word, opposite in OPPOSITES:
        others = rng.sample([o for _, o in OPPOSITES if o != opposite], 3)
        out.append(_question(rng, f"What is the opposite of '{word}'?", opposite, others))
    return out


def write_task(folder: Path, qs: list[dict[str, Any]]) -> Path:
    """The questions as JSONL and an lm-eval task that reads them through the `json` dataset builder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in qs), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""", encoding="utf-8")
    return folder


# -- servers ------------------------------------------------------------------------
def shipped_config(cfg_path: Path, scratch: Path) -> Path:
    """config.toml as it is, but its usage ledger in the scratch folder (the port comes from --port)."""
    text = cfg_path.read_text(encoding="utf-8")
    if "\n[server]\n" not in "\n" + text:
        sys.exit(f"{cfg_path} has no [server] table")
    out = scratch / "config.toml"
    out.write_text(("\n" + text).replace("\n[server]\n", f'\n[server]\ndb_path = "{scratch / "llmd.db"}"\n', 1)[1:],
                   encoding="utf-8")
    return out


@contextmanager
def llmd_server(cfg: Path, scratch: Path, timeout: float) -> Iterator[tuple[str, Path]]:
    port, log = free_port(), scratch / "llmd-server.log"
    argv = [sys.executable, "-m", "llmd", "serve", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    t0 = time.monotonic()
    with running(argv, f"http://127.0.0.1:{port}/ready", log, timeout, {"HF_HUB_OFFLINE": "1"}):
        print(f"  llmd ready on :{port} after {time.monotonic() - t0:.0f}s", flush=True)
        yield f"http://127.0.0.1:{port}", log


@contextmanager
def vllm_server(c: Config, model: Path, scratch: Path, timeout: float) -> Iterator[tuple[str, Path]]:
    """`vllm serve` with the engine settings of config.toml's model."""
    e, name = c.models[0].engine, c.models[0].name
    port, log = free_port(), scratch / "vllm-server.log"
    argv = [tool("llmd-vllm"), "serve", str(model), "--served-model-name", name, "--dtype", e.dtype,
            "--max-model-len", str(e.max_model_len), "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens),
            "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
            *(["--enforce-eager"] if e.enforce_eager else []), "--host", "127.0.0.1", "--port", str(port)]
    t0 = time.monotonic()
    with running(argv, f"http://127.0.0.1:{port}/health", log, timeout,
                 {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(e.kv_cache_gib)}):
        print(f"  vllm serve ready on :{port} after {time.monotonic() - t0:.0f}s", flush=True)
        yield f"http://127.0.0.1:{port}", log


def note_box(r: dict[str, Any]) -> None:
    """The box is shared: note other vLLM engines and the load when a server starts (both go in the report)."""
    busy, load = other_engines(), os.getloadavg()[0]
    r.setdefault("load1", []).append(load)
    r["other_engines"] = max(r.get("other_engines", 0), busy)
    if busy:
        print(f"  WARNING: {busy} other vLLM engine process(es) running on this machine; timings will be skewed",
              flush=True)


def llmd_records(log: Path, endpoint: str) -> list[dict[str, Any]]:
    """llmd's per-request log lines for one endpoint."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "request"' in line:
            rec = json.loads(line)
            if rec.get("endpoint") == endpoint:
                out.append(rec)
    return out


def outcomes(recs: list[dict[str, Any]]) -> str:
    """llmd's records counted by HTTP status and error code: "200 ok 80, 499 client_disconnected 12"."""
    c = Counter(f"{r['http_status']} {r['error_code'] or 'ok'}" + (f" ({r['filter']})" if r.get("filter") else "")
                for r in recs)
    return ", ".join(f"{k}: {v}" for k, v in c.most_common()) or "none"


# -- guidellm -----------------------------------------------------------------------
def run_guidellm(a: argparse.Namespace, bin_dir: Path, url: str, key: str | None, name: str, model: Path,
                 out: Path) -> float:
    """guidellm's sweep against `url` (results in `out`, a .json file); its wall time."""
    backend = f"kind=openai_http,target={url},model={name}" + (f",api_key={key}" if key else "")
    argv = [str(bin_dir / "guidellm"), "run", "--backend", backend,
            "--profile", f"kind=sweep,sweep_size={a.guidellm_sweep},max_concurrency={a.guidellm_concurrency}",
            "--constraint", f"kind=max_duration,seconds={a.guidellm_seconds}",
            "--tokenizer", f"kind=huggingface_auto,model={model}",
            "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
            "--output", f"kind=json,path={out}", "--disable-progress"]
    return _client(argv, out.with_suffix(".log"), out.parent, client_env(out.parent))


def _client(argv: list[str], log: Path, cwd: Path, env: dict[str, str]) -> float:
    """Run a client to the end (its output to `log`); its wall time. A failed client stops the bench."""
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed (rc {rc}); log {log}:\n{tail(log, 40)}")
    return time.monotonic() - t0


def guidellm_rows(path: Path) -> tuple[list[list[str]], list[str]]:
    """Per benchmark: strategy, requests by outcome, rates, TTFT and ITL of the successful ones
    (this file's percentile definition); and the errors guidellm recorded."""
    rows, errors = [], []
    for b in json.loads(path.read_text())["benchmarks"]:
        s, reqs, dur = b["config"]["strategy"], b["requests"], b["duration"]
        label = s["type_"] + {"constant": f"@{s.get('rate', 0):.2f}/s", "throughput": f"@{s['max_concurrency']}"
                              }.get(s["type_"], "")
        ok = reqs["successful"] or []
        errors += [str(r["info"].get("error")) for r in reqs["errored"] or []]
        ttft = [r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None]
        itl = [r["inter_token_latency_ms"] for r in ok if r.get("inter_token_latency_ms") is not None]
        rows.append([label, len(ok), len(reqs["errored"] or []), len(reqs["incomplete"] or []),
                     report.num(len(ok) / dur, 2), report.num(sum(r["output_tokens"] or 0 for r in ok) / dur),
                     report.num(stats.pct(ttft, 50)), report.num(stats.pct(ttft, 95)), report.num(stats.pct(itl, 50))])
    return rows, errors


# -- lm-evaluation-harness ----------------------------------------------------------
def run_lm_eval(a: argparse.Namespace, bin_dir: Path, url: str, key: str | None, name: str, model: Path,
                task: Path, out: Path) -> dict[str, Any]:
    """`local-completions` (tokenized requests, the default) on the task; accuracy, per-question
    log-likelihoods and timings. The tokenizer is the model's own, from its folder (what lm-eval's
    `auto` resolves to when the server has no /tokenizer_info, as neither llmd nor vllm serve has)."""
    args = f"base_url={url}/v1/completions,model={name},tokenizer={model},tokenizer_backend=huggingface"
    argv = [str(bin_dir / "lm_eval"), "--model", "local-completions", "--model_args", args,
            "--tasks", TASK, "--include_path", str(task), "--batch_size", str(a.batch_size),
            "--output_path", str(out), "--log_samples"]
    log = out.with_suffix(".log")
    wall = _client(argv, log, task, client_env(task, OPENAI_API_KEY=key or "unused"))
    results = json.loads(Path(glob.glob(f"{out}/*/results_*.json")[0]).read_text())
    samples_file = Path(glob.glob(f"{out}/*/samples_{TASK}_*.jsonl")[0])
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    res = results["results"][TASK]
    return {"acc": res["acc,none"], "stderr": res["acc_stderr,none"], "wall_s": wall,
            "eval_s": float(results.get("total_evaluation_time_seconds", "nan")),
            "retries": log.read_text(errors="replace").count("API request failed"),
            "resps": {s["doc_id"]: s["filtered_resps"] for s in samples}}  # per choice: [log-likelihood, is_greedy]


def agreement(x: dict[str, Any], y: dict[str, Any]) -> tuple[int, int, int, float]:
    """Questions where both picked the same choice, where every (log-likelihood, is_greedy) was
    identical, questions, and the largest log-likelihood difference."""
    same, identical, gap = 0, 0, 0.0
    for doc, rx in x["resps"].items():
        ry = y["resps"][doc]
        lx, ly = [float(r[0]) for r in rx], [float(r[0]) for r in ry]
        same += lx.index(max(lx)) == ly.index(max(ly))
        identical += rx == ry
        gap = max(gap, *(abs(p - q) for p, q in zip(lx, ly, strict=True)))
    return same, identical, len(x["resps"]), gap


def vllm_requests(log: Path) -> str:
    """vllm serve's access log for /v1/completions, counted by status."""
    c = Counter(line.rsplit('HTTP/1.1"', 1)[1].split()[0] for line in log.read_text(errors="replace").splitlines()
                if '"POST /v1/completions HTTP/1.1"' in line)
    return ", ".join(f"{k}: {v}" for k, v in c.most_common()) or "none"


# -- the run and its report ---------------------------------------------------------
def run(a: argparse.Namespace, bin_dir: Path, c: Config, model: Path, scratch: Path) -> dict[str, Any]:
    name, cfg = c.models[0].name, shipped_config(Path(a.config), scratch)
    task = write_task(scratch / "task", questions(a.sums))
    r: dict[str, Any] = {"n_questions": len(questions(a.sums))}
    note_box(r)
    with llmd_server(cfg, scratch, a.ready_timeout) as (url, log):
        print("  guidellm -> llmd ...", flush=True)
        r["g_llmd_s"] = run_guidellm(a, bin_dir, url, a.key, name, model, scratch / "guidellm-llmd.json")
        print("  lm_eval -> llmd ...", flush=True)
        r["lm_llmd"] = run_lm_eval(a, bin_dir, url, a.key, name, model, task, scratch / "lm-llmd")
    r["llmd_chat"] = outcomes(llmd_records(log, "/v1/chat/completions"))
    r["llmd_completions"] = outcomes(llmd_records(log, "/v1/completions"))
    note_box(r)
    with vllm_server(c, model, scratch, a.ready_timeout) as (url, log):
        if a.guidellm_baseline:
            print("  guidellm -> vllm serve ...", flush=True)
            r["g_vllm_s"] = run_guidellm(a, bin_dir, url, None, name, model, scratch / "guidellm-vllm.json")
        print("  lm_eval -> vllm serve ...", flush=True)
        r["lm_vllm"] = run_lm_eval(a, bin_dir, url, None, name, model, task, scratch / "lm-vllm")
    r["vllm_completions"] = vllm_requests(log)
    return r


def guidellm_lines(a: argparse.Namespace, r: dict[str, Any], scratch: Path, holdback: int) -> tuple[list[str], int]:
    head = ["server", "benchmark", "ok", "errored", "incomplete", "ok req/s", "out tok/s", "TTFT p50 ms",
            "TTFT p95 ms", "ITL p50 ms"]
    rows, errs = guidellm_rows(scratch / "guidellm-llmd.json")
    table = [["llmd", *row] for row in rows]
    lines = [f"- guidellm against llmd took {r['g_llmd_s']:.0f} s; llmd's request log for its chat completions: "
             f"{r['llmd_chat']} (499: guidellm cancels what is still running when a benchmark's time is up; "
             "it counts those as incomplete, not as errors)."]
    if a.guidellm_baseline:
        vrows, verrs = guidellm_rows(scratch / "guidellm-vllm.json")
        table += [["vllm serve", *row] for row in vrows]
        lines.append(f"- guidellm against vllm serve took {r['g_vllm_s']:.0f} s; errors it counted: {len(verrs)}.")
    by_msg = Counter(errs)
    lines.append("- errors guidellm counted against llmd: " + (
        "none." if not errs else "; ".join(f"{n} x `{m}`" for m, n in by_msg.most_common()) + "."))
    if any("content filter" in e for e in errs):
        lines.append("- a content-filter error is a stream that config.toml's output filters stopped (the names are in "
                     "llmd's log above): llmd ends it with `finish_reason: content_filter`, then a terminal error "
                     "event, which guidellm counts as an error.")
    lines.append(f"- llmd's TTFT includes the output filters' hold-back: the first text goes out once {holdback} more "
                 f"tokens exist (about {holdback} x ITL; section Filters); vllm serve runs no filters.")
    return [*report.table(head, table), "", *lines], len(errs)


def lm_eval_lines(r: dict[str, Any]) -> tuple[list[str], bool]:
    x, y = r["lm_llmd"], r["lm_vllm"]
    same, identical, n, gap = agreement(x, y)
    head = ["server", "acc", "stderr", "HTTP requests (by status)", "lm_eval wall s", "lm_eval evaluation s",
            "retried requests"]
    rows = [["llmd", f"{x['acc']:.4f}", f"{x['stderr']:.4f}", r["llmd_completions"], f"{x['wall_s']:.1f}",
             f"{x['eval_s']:.1f}", x["retries"]],
            ["vllm serve", f"{y['acc']:.4f}", f"{y['stderr']:.4f}", r["vllm_completions"], f"{y['wall_s']:.1f}",
             f"{y['eval_s']:.1f}", y["retries"]]]
    lines = [f"- the same choice on {same} of {n} questions; every choice's log-likelihood and is_greedy identical "
             f"on {identical} of {n}; largest difference in a log-likelihood {gap:.2e} (float32 on a CPU: a batch of "
             "another shape could round the last digits differently)."]
    return [*report.table(head, rows), "", *lines], x["acc"] == y["acc"]


def section(a: argparse.Namespace, r: dict[str, Any], scratch: Path, took: float, vers: str,
            c: Config) -> tuple[list[str], bool]:
    e, t = c.models[0].engine, c.tenants[0]
    g_lines, g_errors = guidellm_lines(a, r, scratch, c.models[0].filters.holdback_tokens)
    lm_lines, equal = lm_eval_lines(r)
    verdicts = [(f"guidellm errors against llmd on the shipped config: {g_errors} (target 0)", g_errors == 0),
                (f"lm-eval accuracy through llmd {r['lm_llmd']['acc']:.4f} equals vllm serve's "
                 f"{r['lm_vllm']['acc']:.4f}", equal)]
    return [SECTION, "", report.stamp(took), "",
            (f"Settings: llmd serves config.toml as shipped (tenant `{t.name}` with its demo key, max_concurrent "
             f"{t.max_concurrent}, tokens_per_minute {t.tokens_per_minute}; input filters "
             f"{c.models[0].filters.input}, output filters {c.models[0].filters.output}, hold-back "
             f"{c.models[0].filters.holdback_tokens} tokens), changed only in its port and a scratch SQLite file; "
             f"`vllm serve` on the same model folder with the same engine settings (dtype {e.dtype}, eager, "
             f"max_model_len {e.max_model_len}, max_num_seqs {e.max_num_seqs}, max_num_batched_tokens "
             f"{e.max_num_batched_tokens}, prefix caching {'on' if e.enable_prefix_caching else 'off'}, "
             f"{e.kv_cache_gib} GiB KV cache). One server at a time, each with both cores (load1 when each "
             f"started: {', '.join(f'{x:.2f}' for x in r['load1'])}; other vLLM engines on the box: "
             f"{r['other_engines']}); clients in .venv-clients ({vers}), offline."), "",
            (f"**guidellm** `run --profile kind=sweep,sweep_size={a.guidellm_sweep},max_concurrency="
             f"{a.guidellm_concurrency} --constraint kind=max_duration,seconds={a.guidellm_seconds} --data "
             f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}` with the model's "
             "own tokenizer folder: streamed chat completions with `stream_options` {include_usage, "
             "continuous_usage_stats}, `max_completion_tokens` and `ignore_eos`. max_concurrency is the client's "
             f"(its default, 512, is over the demo tenant's {t.max_concurrent}: llmd answers those with 429). "
             "TTFT and ITL (guidellm's per-request mean) of the successful requests, percentiles by "
             "bench/lib/stats.py:"), "", *g_lines, "",
            (f"**lm-evaluation-harness** `--model local-completions` (tokenized requests, its default), "
             f"`--batch_size {a.batch_size}`, on {r['n_questions']} four-choice questions this script writes "
             "(sums of small numbers, capitals, opposites) as a JSONL read by a task YAML with `dataset_path: json`: "
             "each request carries several token-id prompts with `echo`, `logprobs: 1`, `max_tokens: 1`."), "",
            *lm_lines, "", *report.verdict_lines(verdicts)], all(ok for _, ok in verdicts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "config.toml"), help="the llmd config to serve, as it is")
    ap.add_argument("--key", default=DEMO_KEY, help="an API key of the config's first tenant")
    ap.add_argument("--venv", default=str(ROOT / ".venv-clients"), help="the clients' virtual environment")
    ap.add_argument("--torch", default=TORCH, help="what pip installs first: a CPU torch (a wheel path, say)")
    ap.add_argument("--guidellm-sweep", type=int, default=4, help="benchmarks in guidellm's sweep (>= 2)")
    ap.add_argument("--guidellm-seconds", type=float, default=30.0, help="each benchmark's duration")
    ap.add_argument("--guidellm-concurrency", type=int, default=16, help="guidellm's max requests in flight")
    ap.add_argument("--no-guidellm-baseline", dest="guidellm_baseline", action="store_false",
                    help="skip guidellm against vllm serve")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--sums", type=int, default=40, help="arithmetic questions (besides 20 capitals, 20 opposites)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    c = load_config(a.config)
    if not c.tenants or hash_key(a.key) not in c.tenants[0].keys:
        sys.exit(f"--key is not a key of {a.config}'s first tenant")
    from llmd.store import WeightStore

    model = WeightStore().resolve(c.models[0].source).path
    bin_dir = ensure_venv(Path(a.venv), a.torch)
    scratch = Path(tempfile.mkdtemp(prefix="llmd-clients-"))
    print(f"scratch {scratch}", flush=True)
    t0 = time.monotonic()
    r = run(a, bin_dir, c, model, scratch)
    lines, ok = section(a, r, scratch, time.monotonic() - t0, versions(bin_dir), c)
    print("\n".join(lines))
    if not a.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
