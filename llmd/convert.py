"""GGUF -> Hugging Face safetensors, so vLLM can load a model that ships as GGUF.

vLLM cannot load the embedded SmolLM2 GGUF directly; transformers can dequantize
it. The quantizer must be dropped before `save_pretrained`, which otherwise
refuses GGUF-quantized models.
"""

from __future__ import annotations

import os
from pathlib import Path


def gguf_to_hf(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    src, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch_dtype)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
