"""Sampling variants and answers per prompt (job/variants.py): the draw, the config, and the
prompts stage's conversations, on the real Qwen3 tokenizer and its thinking switch."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest

from support import as_config, job_settings
from eagle_data.errors import ConfigError
from eagle_data.job.phases.prompts import SeenPrompts, split_duplicates
from eagle_data.job.stages.prompts import PromptBuilder
from eagle_data.job.variants import Assigner, conversation_ids, variants
from eagle_data.model_files import load_tokenizer

THREE = [{"name": "greedy", "weight": 2, "temperature": 0.0},
         {"name": "hot", "temperature": 1.0, "top_k": 20},
         {"name": "no_think", "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}}]


def config(tmp_path, model, **overrides):
    return as_config(job_settings(tmp_path / "out", model, **overrides))


def test_a_variant_takes_the_sampling_sections_values_for_keys_it_leaves_out(tmp_path, qwen3_tokenizer_dir):
    cfg = config(tmp_path, qwen3_tokenizer_dir, sampling__variants=THREE, sampling__top_p=0.8,
                 prompt__chat_template_kwargs={"x": 1})
    found = variants(cfg)
    assert list(found) == ["greedy", "hot", "no_think"]
    assert found["hot"].sampling == {"max_tokens": 16, "temperature": 1.0, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
    assert found["no_think"].chat_template_kwargs == {"x": 1, "enable_thinking": False}
    assert found["no_think"].max_prompt_tokens == 1024 - 8 and found["greedy"].max_prompt_tokens == 1024 - 16
    assert found["greedy"].renders_as == found["hot"].renders_as != found["no_think"].renders_as
    [default] = variants(config(tmp_path, qwen3_tokenizer_dir)).values()
    assert default.name == "default" and default.sampling["temperature"] == 0.0


@pytest.mark.parametrize("variants_, says", [
    ([{"name": "a"}, {"name": "a"}], "names must differ"),
    ([{"name": "a b"}], "String should match pattern"),
    ([{"name": "a", "weight": 0}], "greater than 0"),
    ([{"name": "a", "temperature": float("inf")}], "finite number"),
    ([{"name": "a", "max_tokens": 2048}], "sampling.variants[a].max_tokens (2048) must be smaller"),
    ([{"name": "a", "seed": 3}], "unknown key"),
])
def test_bad_variants_are_refused_naming_the_key(tmp_path, qwen3_tokenizer_dir, variants_, says):
    with pytest.raises(ConfigError, match="sampling") as e:
        config(tmp_path, qwen3_tokenizer_dir, sampling__variants=variants_)
    assert says in str(e.value)


def test_the_draw_depends_on_the_id_and_the_seed_only_and_follows_the_weights(tmp_path, qwen3_tokenizer_dir):
    found = variants(config(tmp_path, qwen3_tokenizer_dir, sampling__variants=THREE))
    ids = [f"{i:020x}" for i in range(20_000)]
    draw = Assigner(found, seed=0)
    first = [draw(i) for i in ids]
    assert [Assigner(found, seed=0)(i) for i in reversed(ids)] == first[::-1]  # order and instance free
    shares = Counter(first)
    for name, expected in {"greedy": 0.5, "hot": 0.25, "no_think": 0.25}.items():
        assert abs(shares[name] / len(ids) - expected) < 0.015, shares  # 4 sigma at n = 20,000
    other_seed = [Assigner(found, seed=1)(i) for i in ids]
    assert 0.5 < sum(a != b for a, b in zip(first, other_seed)) / len(ids) < 0.7  # 1 - sum(p^2) = 0.625
    assert conversation_ids("abc", 1) == ["abc"] and conversation_ids("abc", 3) == ["abc.0", "abc.1", "abc.2"]


def raw_batch(rows: list) -> pa.Table:
    return pa.table({"row_id": [f"r{i}" for i in range(len(rows))], "source": ["s"] * len(rows),
                     "raw": [json.dumps(r) if not isinstance(r, str) else r for r in rows],
                     "origin": [""] * len(rows), "read_error": [""] * len(rows)})


def test_a_prompt_becomes_k_conversations_each_rendered_as_its_variant_says(tmp_path, qwen3_tokenizer_dir):
    cfg = config(tmp_path, qwen3_tokenizer_dir, sampling__variants=THREE, sampling__answers_per_prompt=3,
                 engine__max_model_len=40, sampling__max_tokens=8)
    question = {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    too_long = {"messages": [{"role": "user", "content": "tea " * 40}]}
    batch = raw_batch([question, "not json", too_long, question])
    made = PromptBuilder.from_config(cfg)(batch)
    good, bad = split_duplicates(made, SeenPrompts())
    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    rows = good.to_pylist()
    assert [r["answer"] for r in rows] == [0, 1, 2] and len({r["prompt_id"] for r in rows}) == 1
    draw = Assigner(variants(cfg), cfg.sampling.seed)
    for r in rows:
        assert r["sample_id"] == f"{r['prompt_id']}.{r['answer']}" and r["variant"] == draw(r["sample_id"])
        kwargs = {"enable_thinking": False} if r["variant"] == "no_think" else {}
        assert r["tokenized_prompt"] == tokenizer.apply_chat_template(
            question["messages"], add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    # One skipped/ row per dataset row: bad JSON, a prompt too long, the duplicate of row 0.
    assert [(b["row_id"], b["reason"], b["answer"]) for b in bad.to_pylist()] == [
        ("r1", "bad_json", 0), ("r2", "prompt_too_long", 0), ("r3", "duplicate", 0)]
    skipped = bad.to_pylist()
    assert skipped[0]["sample_id"] == "" and skipped[1]["sample_id"] == skipped[1]["prompt_id"] != ""
    assert skipped[2]["sample_id"] == rows[0]["prompt_id"]  # skipped rows are keyed by the prompt


@pytest.mark.parametrize("weights", [[1e308, 1e308], [1.7976931348623157e308] * 3, [5e-324, 5e-324],
                                     [1e308, 3e307, 5e-324]])
def test_the_draw_follows_any_finite_positive_weights(tmp_path, qwen3_tokenizer_dir, weights):
    """Weights whose sum overflows (1e308 twice) once sent every conversation to the last
    variant; the smallest subnormals must work too."""
    specs = [{"name": f"v{i}", "weight": w} for i, w in enumerate(weights)]
    found = variants(config(tmp_path, qwen3_tokenizer_dir, sampling__variants=specs))
    ids = [f"{i:020x}" for i in range(8_000)]
    shares = Counter(Assigner(found, seed=0)(i) for i in ids)
    total = sum(w / max(weights) for w in weights)
    for i, w in enumerate(weights):
        assert abs(shares[f"v{i}"] / len(ids) - w / max(weights) / total) < 0.025, shares  # > 4 sigma


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def test_chat_template_kwargs_take_any_json_like_value(tmp_path, qwen3_tokenizer_dir):
    """A list (`tools`, which Qwen3's template takes), nested dicts and nulls, in
    prompt.chat_template_kwargs and in a variant's: was `TypeError: unhashable type: 'list'`
    in the prompts stage, the prompts phase left running."""
    specs = [{"name": "tools", "chat_template_kwargs": {"tools": TOOLS, "extra": {"a": [1, None]}}},
             {"name": "plain", "chat_template_kwargs": {"enable_thinking": False}}]
    cfg = config(tmp_path, qwen3_tokenizer_dir, sampling__variants=specs, sampling__answers_per_prompt=8,
                 prompt__chat_template_kwargs={"tools": TOOLS[:0], "x": [1, 2]})
    question = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
    made = PromptBuilder.from_config(cfg)(raw_batch([question]))
    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    rows = made.to_pylist()
    assert {r["variant"] for r in rows} == {"tools", "plain"} and all(r["reason"] == "" for r in rows)
    for r in rows:
        kwargs = {"tools": TOOLS} if r["variant"] == "tools" else {"tools": [], "enable_thinking": False}
        assert r["tokenized_prompt"] == tokenizer.apply_chat_template(
            question["messages"], add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
        assert ("get_weather" in tokenizer.decode(r["tokenized_prompt"])) == (r["variant"] == "tools")
