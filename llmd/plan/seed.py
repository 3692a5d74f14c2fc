"""The seed's envelope, as its inputs and its stated figures.

The seed says: 280 req/s × 300 output tokens = 84 k tok/s ÷ 2,000 tok/s per replica = 42 decode
replicas; 280 k prompt tok/s ÷ 10 k = 28 prefill replicas; ~80 in all; 320 KB of KV per token,
~500 sequences per replica; $16/h per replica → $2.2 per million tokens at full use, ~$6 at 40 %.

It states its targets: TTFT p95 < 500 ms and ITL p95 < 40 ms; a cold start of 70 GB ÷ 2 GB/s
= 35 s; a utilisation goal above 70 % beside its cost at 40 % use; and it counts its ~80 replicas
as "GPUs". What it leaves unsaid and the planner must assume, each the reading that reproduces
its figures: a Llama-3-70B-shaped model (80 layers, 8 KV heads, head_dim 128, bf16 KV:
320 KiB/token), served in fp8 on 4 × H100-SXM ($4/GPU-h = $16/h; fp8 weights are what leave room
for ~500 sequences), 1,000 prompt tokens a request (280 k / 280), and the engine's start after
its weights load (the planner's 60 s assumption).
"""

from __future__ import annotations

from llmd.plan.gpus import GPUS
from llmd.plan.inputs import Deployment, Plan, Workload
from llmd.plan.model import ModelSpec, from_config

LLAMA3_70B_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

# The seed's own words for each line it states, shown next to the planner's figure.
SEED_CLAIMS: dict[str, str] = {
    "output_tps": "84 k tok/s", "prompt_tps": "280 k tok/s", "decode_replicas": "42",
    "prefill_replicas": "28", "fleet_replicas": "~80", "kv_per_token": "320 KB",
    "max_seqs_kv": "~500 sequences per replica", "price_per_replica": "$16/h per replica",
    "seed_cost_full": "$2.2 per million tokens at full use", "seed_cost_at_util": "~$6 at 40 %",
    "ttft_target": "TTFT p95 < 500 ms", "itl_target": "ITL p95 < 40 ms", "util_goal": "> 70 % utilisation",
    "weight_load_s": "cold start 70 GB ÷ 2 GB/s = 35 s", "fleet_gpus": '~80 "GPUs"',
}


def seed_model() -> ModelSpec:
    return from_config(dict(LLAMA3_70B_CONFIG), "Llama-3-70B-like (the seed's model)", "seed")


def seed_plan() -> Plan:
    """Exactly the seed's numbers, plus the stated assumptions above."""
    workload = Workload(rate=280, prompt_tokens=1000, output_tokens=300, itl_ms=40, ttft_ms=500)
    deploy = Deployment(gpu=GPUS["H100-SXM"], tp=4, weight_dtype="fp8", kv_dtype="bfloat16",
                        decode_tps=2000, prefill_tps=10000, price_per_hour=16.0, avg_util=0.4,
                        storage_gbps=2.0, util_goal=0.7)
    return Plan(seed_model(), workload, deploy, seed=True)
