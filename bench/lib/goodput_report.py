"""Figures and verdicts of bench/goodput.py: one row per (server, load), the targets of issue N."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from bench.lib import report, stats
from bench.lib.goodput_client import Outcome

SECTION = "## Goodput under overload: llmd vs vllm serve vs LiteLLM"
TENANTS = ("chat", "rag", "bulk")


def summarise(outs: list[Outcome], seconds: float, slo: tuple[float, float]) -> dict[str, Any]:
    """Goodput (good requests per second of the arrival window) overall and per tenant, latency
    percentiles of the completed interactive requests, refusals, retries and the error codes."""
    good = [o for o in outs if o.good(*slo)]
    row: dict[str, Any] = {"sent": len(outs), "good": len(good), "goodput": len(good) / seconds}
    for t in TENANTS:
        mine = [o for o in outs if o.req.tenant == t]
        row[t] = {"sent": len(mine), "good": sum(o.good(*slo) for o in mine),
                  "completed": sum(o.completed for o in mine),
                  "ttft": [o.ttft for o in mine if o.completed and o.ttft is not None],
                  "itl": [o.itl_p95 for o in mine if o.completed and len(o.last.chunks if o.last else []) > 1],
                  "tokens": sum(o.tokens for o in mine)}
    row["refusals"] = sum(o.refusals for o in outs)
    row["retries"] = sum(o.attempts - 1 for o in outs)
    row["codes"] = dict(Counter(c for o in outs for c in o.codes).most_common(6))
    return row


def _p(values: list[float], q: float) -> str:
    return report.num(stats.pct(values, q), 2) if values else "-"


def one_line(r: dict[str, Any]) -> str:
    per = ", ".join(f"{t} {r[t]['good']}/{r[t]['sent']}" for t in TENANTS if r[t]["sent"])
    return (f"good {r['good']}/{r['sent']} ({r['goodput']:.3f}/s; {per}); chat TTFT p95 {_p(r['chat']['ttft'], 95)} s; "
            f"refusals {r['refusals']}, retries {r['retries']}; {r['codes'] or ''}")


def _table(res: dict[str, Any]) -> list[str]:
    head = ["load", "server", "goodput /s", "good/sent", "chat good", "rag good", "bulk good", "chat TTFT p50/p95 s",
            "rag TTFT p95 s", "chat ITL p95 (median req) s", "bulk tokens", "refusals", "retries", "errors"]
    rows = []
    for key, r in res["rows"].items():
        server, load = key.split("@")
        rows.append([load, server, f"{r['goodput']:.3f}", f"{r['good']}/{r['sent']}",
                     *(f"{r[t]['good']}/{r[t]['sent']}" for t in TENANTS),
                     f"{_p(r['chat']['ttft'], 50)} / {_p(r['chat']['ttft'], 95)}", _p(r["rag"]["ttft"], 95),
                     _p(r["chat"]["itl"], 50), r["bulk"]["tokens"], r["refusals"], r["retries"],
                     ", ".join(f"{k} {v}" for k, v in r["codes"].items()) or "-"])
    return report.table(head, rows)


def verdicts(res: dict[str, Any]) -> list[tuple[str, bool]]:
    """Issue N item 1's targets, for the rows this run has."""
    rows, out = res["rows"], []
    g = {k: v["goodput"] for k, v in rows.items()}
    for load in res["loads"]:
        mine = g.get(f"llmd@{load:g}")
        if mine is None:
            continue
        for peer in ("vllm", "litellm"):
            theirs = g.get(f"{peer}@{load:g}")
            if theirs is None:
                continue
            if load >= 1.5:  # nothing good on either side is no lead
                out.append((f"{load:g}x: llmd goodput {mine:.3f}/s >= 2x {peer}'s {theirs:.3f}/s",
                            mine >= 2 * theirs and mine > 0))
            elif peer == "vllm":
                out.append((f"{load:g}x: llmd goodput {mine:.3f}/s >= 0.97x vllm serve's {theirs:.3f}/s",
                            mine >= 0.97 * theirs))
        base = g.get("llmd@1")
        if load >= 1.5 and base:
            out.append((f"{load:g}x: llmd goodput {mine:.3f}/s >= 0.8x its own at 1x ({base:.3f}/s)",
                        mine >= 0.8 * base))
    alone, flood = rows.get("llmd@alone"), rows.get("llmd@flood")
    if alone and flood:
        for t in ("chat", "rag"):
            a, f = alone[t]["good"], flood[t]["good"]
            if a:  # a tenant with nothing good alone has nothing to keep under the flood
                out.append((f"flood: llmd {t} good {f} >= 0.9x alone ({a})", f >= 0.9 * a))
    return out


def lines(res: dict[str, Any], a: argparse.Namespace) -> list[str]:
    lim = res["limits"]
    out = [
        SECTION, "",
        report.stamp(res["seconds"], res["version"]), "",
        f"Mixed trace, Poisson arrivals, seed {a.seed}, {a.seconds:g} s of arrivals per run, clients wait at most "
        f"{a.drain_s:g} s after the last (bench/lib/goodput_trace.py; at scale 1: chat 45 % of arrivals, 150-250-token "
        "answers; RAG 25 %, two of 12 shared documents, 1-1.5 k-token prompts, 16-48-token answers; bulk 30 %, "
        f"300-600-token answers; this run at scale {a.scale:g}, every length times that). "
        "Clients retry like the OpenAI SDK (2 retries, Retry-After honoured, within the deadline). "
        f"Good: completed with TTFT <= {res['slo'][0]:g} s and the request's own p95 inter-chunk gap <= "
        f"{res['slo'][1]:g} s (config.toml's [slo]). Capacity: {res['capacity']:.3f} requests/s of the mix "
        f"({'given' if a.capacity else 'measured on vllm serve, 64 streams in flight'}).",
        "",
        "LiteLLM's per-key limits (each tenant's demand at 1.0x plus 20 %): "
        + "; ".join(f"{t} {v['tpm']} TPM, {v['rpm']} RPM" for t, v in lim.items())
        + ". llmd runs config.toml as shipped with the three tenants set as its demo tenant (weight 1, "
        "200,000 TPM, 64 concurrent, class interactive): fair queueing keeps them apart "
        "(the ITL target and on-time admission, max_wait_s, are off as shipped).",
    ]
    if res.get("variants"):
        out += ["", "Bench-only variants, run beside the shipped config, never instead of it: "
                + "; ".join(f"llmd+{v}: {what}" for v, what in res["variants"].items()) + "."]
    note = res.get("litellm_note")
    if note:
        out += ["", f"LiteLLM: {note}"]
    out += ["", *_table(res), ""]
    if "llmd@flood" in res["rows"]:
        out += [f"Flood rows: chat and RAG at {a.flood_load:g}x without bulk ('alone'), then with "
                f"{a.flood_streams} bulk streams that resubmit 0.2 s after every refusal ('flood'; its requests are "
                "in the bulk columns), sent by a lean HTTP client in a process of its own (bench/lib/flood.py): "
                "on this shared box the flood's client is the bench's cost, not the server's.", ""]
    out += report.verdict_lines(verdicts(res))
    return out
