"""The generate phase end to end on a real local Ray: tiny random-weight Qwen3 with the real
Qwen3 tokenizer, transformers backend, real Parquet shards."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMOutputData

from support import job_config, read
from eagle_data.job.stages.engines.transformers_backend import TransformersEngine
from eagle_data.model_files import load_tokenizer
from eagle_data.job.phases.run import run


SMALL = dict(engine__batch_size=4, sampling__max_tokens=12, output__rows_per_shard=10)


def test_data_rows_are_the_exact_engine_tokens(ray_local, tmp_path, tiny_qwen3):
    """Greedy, `mask.train_on: response`. The `generated` mask on sampled answers is checked
    row by row in tests/whole_job/test_multiturn.py (temperature 1.0 and 0.7 variants)."""
    cfg = job_config(tmp_path / "out", tiny_qwen3, preset=SMALL, mask__train_on="response", source__sample=24,
                     sampling__temperature=0)
    result = run(cfg)
    out = tmp_path / "out"
    prompts = {p["sample_id"]: p for p in read(out, "prompts")}
    data, failed = read(out, "data"), read(out, "failed")
    assert len(data) + len(failed) == len(prompts) == result["prompts"]["prompts"] > 0
    assert failed == []
    assert result["generate"]["ok"] == len(data)
    assert len({d["sample_id"] for d in data}) == len(data)
    # Shards of output.rows_per_shard rows (the last may be short).
    sizes = [pq.read_metadata(f).num_rows for f in sorted((out / "data").glob("*.parquet"))]
    assert max(sizes) == 10 and sum(sizes) == len(data)

    eos = set(json.loads((out / "manifest.json").read_text())["phases"]["generate"]["tokenizer"]["eos_ids"])
    tokenizer = load_tokenizer(str(tiny_qwen3))
    for d in data:
        p = prompts[d["sample_id"]]
        n = d["num_prompt_tokens"]
        assert d["input_ids"][:n] == p["tokenized_prompt"]
        generated = d["input_ids"][n:]
        assert 0 < len(generated) <= 12
        assert d["num_reasoning_tokens"] + d["num_response_tokens"] == len(generated)
        assert len(d["loss_mask"]) == len(d["input_ids"])
        assert d["loss_mask"][:n] == [0] * n
        r = d["num_reasoning_tokens"]
        assert d["loss_mask"][n:] == [0] * r + [1] * (len(generated) - r)
        assert d["finish_reason"] == ("stop" if generated[-1] in eos else "length")
        assert (d["finish_reason"] == "length") == (len(generated) == 12 and generated[-1] not in eos)
        assert d["messages"] == p["messages"] and d["source"] == p["source"]
        text = tokenizer.decode([t for t in generated if t not in eos])
        assert d["response"] in text

    # Rerunning the same command finds nothing left to do and writes nothing.
    files = sorted(p.name for p in (out / "data").iterdir())
    again = run(cfg)
    assert again["generate"]["ok"] == len(data)
    assert sorted(p.name for p in (out / "data").iterdir()) == files
    runs = json.loads((out / "manifest.json").read_text())["phases"]["generate"]["runs"]
    assert [r["todo"] for r in runs] == [len(prompts), 0]


def test_transformers_engine_emits_the_vllm_stage_columns(tiny_qwen3):
    """Same contract as Ray's vLLM stage: vLLMOutputData's fields + __inference_error__,
    with the engine's inputs consumed and every other column carried."""
    tokenizer = load_tokenizer(str(tiny_qwen3))
    engine = TransformersEngine(str(tiny_qwen3), False, {}, pad_id=tokenizer.pad_token_id)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    params = {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 0,
              "stop_token_ids": [tokenizer.eos_token_id], "detokenize": False}
    batch = pa.Table.from_pylist([
        {"sample_id": "a", "source": "x", "tokenized_prompt": prompt, "sampling_params": params},
        {"sample_id": "b", "source": "y", "tokenized_prompt": prompt[:4], "sampling_params": params},
        {"sample_id": "c", "source": "z", "tokenized_prompt": [10**7], "sampling_params": params},
    ])
    out = engine(batch)
    expected = set(vLLMOutputData.model_fields) | {"__inference_error__", "sample_id", "source"}
    assert set(out.column_names) == expected
    rows = out.to_pylist()
    assert [r["sample_id"] for r in rows] == ["a", "b", "c"]
    for r, p in zip(rows[:2], [prompt, prompt[:4]]):
        assert r["__inference_error__"] == ""
        assert r["prompt_token_ids"] == p and r["num_input_tokens"] == len(p)
        assert 0 < r["num_generated_tokens"] == len(r["generated_tokens"]) <= 5
        # Each ok row validates as Ray's own output model.
        vLLMOutputData(**{k: r[k] for k in vLLMOutputData.model_fields})
    assert rows[2]["__inference_error__"] and rows[2]["generated_tokens"] == []
    # Greedy decoding is deterministic, whatever else is in the batch.
    alone = engine(batch.slice(0, 1)).to_pylist()[0]
    assert alone["generated_tokens"] == rows[0]["generated_tokens"]


def test_transformers_engine_logprobs_are_the_models_own(tiny_qwen3):
    """sampling `logprobs` = k: per generated token, the top k of log_softmax(the model's
    logits) and the sampled token's own, as a plain forward pass over prompt + generated
    gives them (rows of different lengths, so left padding is in play), sampled at
    temperature 1 (the values are the raw logits', whatever the temperature); an error row
    has none."""
    import numpy as np
    import torch

    from eagle_data.storage.contract import LOGPROB_COLUMNS

    tokenizer = load_tokenizer(str(tiny_qwen3))
    engine = TransformersEngine(str(tiny_qwen3), False, {}, pad_id=tokenizer.pad_token_id)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    k = 4
    params = {"max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 1, "logprobs": k,
              "stop_token_ids": [tokenizer.eos_token_id], "detokenize": False}
    batch = pa.Table.from_pylist([
        {"sample_id": "a", "tokenized_prompt": prompt, "sampling_params": params},
        {"sample_id": "b", "tokenized_prompt": prompt[:5], "sampling_params": params},
        {"sample_id": "bad", "tokenized_prompt": [10**7], "sampling_params": params},
    ])
    bad, a = engine(batch.take([2, 0])).to_pylist()  # an error row first: the columns are still there
    assert bad["__inference_error__"] and all(bad[c] is None for c in LOGPROB_COLUMNS)
    assert all(isinstance(a[c], bytes) for c in LOGPROB_COLUMNS)
    rows = engine(batch.slice(0, 2)).to_pylist()  # generated together, left-padded
    for r in rows:
        gen, n = r["generated_tokens"], len(r["prompt_token_ids"])
        ids = np.frombuffer(r["top_logprob_ids"], "<i4").reshape(len(gen), k)
        values = np.frombuffer(r["top_logprobs"], "<f4").reshape(len(gen), k)
        own = np.frombuffer(r["token_logprobs"], "<f4")
        with torch.no_grad():
            logits = engine.model(torch.tensor([r["prompt_token_ids"] + gen])).logits[0, n - 1:-1]
        expected = logits.log_softmax(-1, dtype=torch.float32)
        top = torch.topk(expected, k, dim=-1)
        assert ids.tolist() == top.indices.tolist(), r["sample_id"]
        np.testing.assert_allclose(values, top.values.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(own, expected[torch.arange(len(gen)), gen].numpy(), rtol=0, atol=1e-5)
        assert (values[:, :-1] >= values[:, 1:]).all() and (own <= values[:, 0] + 1e-6).all()
