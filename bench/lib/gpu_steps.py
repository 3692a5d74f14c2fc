"""Engine-like step times of Llama-shaped decoders on a GPU, for `bench/plan_gpu.py`.

vLLM cannot be installed on the GPU machine the device tool lends (no package registry there, and
at most 64 MiB travels with the tree), so `llmd plan calibrate` cannot run on it. What can run is
PyTorch: this module builds a decoder of a real model's shape with random weights (timing does
not depend on their values) and times the steps an engine runs, as vLLM runs them: tokens
flattened into one batch (B decoding sequences over their KV caches, plus a prefill chunk), the
GEMMs over all rows at once, QKV and gate/up as one GEMM each, logits for each sequence's last
token; the whole step captured once in a CUDA graph and replayed. Rotary embedding and the
sampler are left out (elementwise), and the kernels are PyTorch's (SDPA, cuBLAS), not vLLM's
fused ones: a stand-in for the engine, not the engine.

Standalone on purpose (torch and the standard library only): the GPU machine has no llmd
dependencies. A dry run on CPU with `--config tiny` checks it here.

    python bench/lib/gpu_steps.py --config llama-3-8b --out steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

CONFIGS: dict[str, dict[str, Any]] = {  # the config.json fields of each shape (Meta's published configs)
    "llama-3-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
                   "tie_word_embeddings": False},
    "llama-3.2-1b": {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "qwen2.5-14b": {"num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 13824, "vocab_size": 152064,
                    "tie_word_embeddings": False},
    "tiny": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 1000,
             "tie_word_embeddings": False},
}
# (decoding sequences, their context, prefill chunk): decode-only, prefill-only (from position 0)
# and mixed steps, as vLLM's chunked prefill runs them; a range like `llmd plan calibrate`'s on a GPU
GRID = (*((b, ctx, 0) for b, ctx in ((1, 512), (1, 4096), (8, 512), (8, 4096), (32, 512), (32, 2048), (64, 512),
                                     (64, 2048), (128, 512), (128, 1024), (256, 256), (256, 512))),
        *((0, 0, c) for c in (64, 128, 512, 1024, 2048, 4096, 8192)),
        (8, 1024, 512), (32, 1024, 256), (32, 1024, 2048), (128, 512, 1024))
TINY = ((1, 64, 0), (4, 64, 0), (4, 256, 0), (0, 0, 32), (0, 0, 128), (4, 64, 32))


class Decoder:
    """Weights of one model shape; `decode` and `prefill` run one engine step."""

    def __init__(self, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
        self.h, self.nh, self.kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd, self.inter, self.vocab = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
        self.device, self.dtype = device, dtype

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        qkv = (self.nh + 2 * self.kvh) * self.hd
        self.layers = [{"n1": torch.ones(self.h, device=device, dtype=dtype), "qkv": w(self.h, qkv),
                        "o": w(self.nh * self.hd, self.h), "n2": torch.ones(self.h, device=device, dtype=dtype),
                        "gu": w(self.h, 2 * self.inter), "down": w(self.inter, self.h)}
                       for _ in range(cfg["num_hidden_layers"])]
        self.embed, self.head = w(self.vocab, self.h), w(self.h, self.vocab)
        self.norm = torch.ones(self.h, device=device, dtype=dtype)

    def _attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """B sequences' one token each over caches (B, kv_heads, context, head_dim), GQA as a decode
        kernel does it: each KV head's query heads attend as a group of queries."""
        b, kc, vc = q.shape[0], cache[0], cache[1]
        kc[:, :, -1:].copy_(k.view(b, 1, self.kvh, self.hd).transpose(1, 2))  # the new token's K and V
        vc[:, :, -1:].copy_(v.view(b, 1, self.kvh, self.hd).transpose(1, 2))
        q = q.reshape(b, self.kvh, self.nh // self.kvh, self.hd)
        return F.scaled_dot_product_attention(q, kc, vc).reshape(b, self.nh * self.hd)

    def _attend_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One sequence's chunk from position 0, causal."""
        t, g = q.shape[0], self.nh // self.kvh
        q = q.reshape(1, t, self.nh, self.hd).transpose(1, 2)
        k = k.reshape(1, t, self.kvh, self.hd).transpose(1, 2).repeat_interleave(g, dim=1)
        v = v.reshape(1, t, self.kvh, self.hd).transpose(1, 2).repeat_interleave(g, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(t, self.nh * self.hd)

    def step(self, dec: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
             chunk: torch.Tensor) -> torch.Tensor:
        """One engine step over flattened tokens, as vLLM batches them: `dec` (B ids, one token per
        decoding sequence, over `caches`) then `chunk` (one sequence's prefill ids); the GEMMs run
        on all rows at once, attention per part. The next token of each decoder and of the chunk."""
        b = dec.shape[0]
        x = self.embed[torch.cat([dec, chunk])]
        sizes = [self.nh * self.hd, self.kvh * self.hd, self.kvh * self.hd]
        for i, layer in enumerate(self.layers):
            q, k, v = (F.rms_norm(x, (self.h,), layer["n1"]) @ layer["qkv"]).split(sizes, dim=-1)
            parts = []
            if b:
                parts.append(self._attend_decode(q[:b], k[:b], v[:b], caches[i]))
            if chunk.shape[0]:
                parts.append(self._attend_prefill(q[b:], k[b:], v[b:]))
            x = x + torch.cat(parts) @ layer["o"]
            gate, up = (F.rms_norm(x, (self.h,), layer["n2"]) @ layer["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        last = x[:b] if not chunk.shape[0] else torch.cat([x[:b], x[-1:]])  # logits: the last token of each
        return (F.rms_norm(last, (self.h,), self.norm) @ self.head).argmax(-1)


def _timed(fn: Any, n: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(n):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def time_step(model: Decoder, b: int, ctx: int, chunk: int, steps: int) -> list[float]:
    """Median-ready times of one step shape: B decoders at `ctx` plus a chunk of `chunk` prompt
    tokens. On a GPU the step is captured once in a CUDA graph and replayed, as vLLM replays its
    captured steps (which leaves Python's launch cost out, as vLLM's graphs do)."""
    dev, cuda = model.device, model.device.type == "cuda"
    caches = [(torch.randn(b, model.kvh, ctx, model.hd, device=dev, dtype=model.dtype),
               torch.randn(b, model.kvh, ctx, model.hd, device=dev, dtype=model.dtype))
              for _ in model.layers] if b else []
    dec = torch.randint(0, model.vocab, (b,), device=dev)
    ids = torch.randint(0, model.vocab, (chunk,), device=dev)
    if not cuda:
        return _timed(lambda: model.step(dec, caches, ids), steps, cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture asks
        for _ in range(3):
            model.step(dec, caches, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.step(dec, caches, ids)
    _timed(graph.replay, 3, cuda)
    return _timed(graph.replay, steps, cuda)  # the caller frees the graph's pool and the caches


def peaks(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """What this device reaches: a large bf16 GEMM's FLOP/s and a copy's bytes/s (read + write)."""
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    cuda = device.type == "cuda"
    _timed(lambda: a @ b, 3, cuda)
    gemm = statistics.median(_timed(lambda: a @ b, 10, cuda))
    src = torch.empty(2 << 30 if cuda else 1 << 24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _timed(lambda: dst.copy_(src), 3, cuda)
    copy = statistics.median(_timed(lambda: dst.copy_(src), 10, cuda))
    return {"gemm_flops": 2 * n**3 / gemm, "copy_bytes_per_s": 2 * src.numel() / copy}


def row(b: int, ctx: int, chunk: int) -> list[Any]:
    """A point's name and shape as llmd.plan.fit.samples_json writes a row (seconds, scale and the
    longest context follow): decode seqs, prefill tokens, prefill seqs, context tokens, prefill
    attention (chunk x (tokens before it + chunk / 2))."""
    name = " + ".join(([f"decode B={b} ctx={ctx}"] if b else []) + ([f"prefill chunk={chunk}"] if chunk else []))
    return [name, b, chunk, 1 if chunk else 0, b * ctx, chunk * chunk / 2]


def measure(name: str, device: torch.device, steps: int) -> dict[str, Any]:
    cfg = CONFIGS[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Decoder(cfg, device, dtype)
    rows: list[list[Any]] = []
    errors: list[str] = []
    for b, ctx, chunk in GRID if name != "tiny" else TINY:
        head = row(b, ctx, chunk)
        try:  # one point failing (memory, a kernel) must not lose the others
            secs = time_step(model, b, ctx, chunk, steps)
        except Exception as e:  # reported with the results
            errors.append(f"{head[0]}: {type(e).__name__}: {e}")
            print(errors[-1], flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.extend([*head, sec, 1.0, ctx] for sec in secs)
        print(f"{name} {head[0]}: {statistics.median(secs) * 1e3:.3f} ms", flush=True)
    del model
    return {"config": {**cfg, "torch_dtype": str(dtype).removeprefix("torch.")}, "samples": rows, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per decode point")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "command": "python3 bench/lib/gpu_steps.py " + " ".join(sys.argv[1:]),
                           "torch": torch.__version__, "cuda": torch.version.cuda or "",
                           "peaks": peaks(device, torch.bfloat16 if device.type == "cuda" else torch.float32),
                           "models": {}}
    print(out["device"], out["peaks"], flush=True)
    for name in a.config:
        out["models"][name] = measure(name, device, a.steps)
        out["took_s"] = time.monotonic() - t0
        with open(a.out, "w") as f:  # after each model: a later one failing keeps the earlier
            json.dump(out, f)
    print(f"took {out['took_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
