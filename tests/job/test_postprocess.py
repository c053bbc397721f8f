"""Reasoning split, masks and exact tokens on sequences built with the real Qwen3 and
DeepSeek-R1 tokenizers and their chat templates."""

from __future__ import annotations

import pyarrow as pa
import pytest

from eagle_data.model_files import load_tokenizer, special_tokens
from eagle_data.job.stages.postprocess import OUT_SCHEMA, Postprocessor
from support import answered

QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def postprocess(tokenizer_dir, rows, train_on="generated"):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    special = special_tokens(tokenizer, "<think>", "</think>")
    post = Postprocessor(str(tokenizer_dir), False, special.eos_ids, special.reasoning_start_id,
                         special.reasoning_end_id, train_on)
    batch = pa.Table.from_pylist([
        {"sample_id": f"s{i}", "conversation_id": f"s{i}", "turn": 0, "source": "t", **answered(f"s{i}"),
         "messages": QUESTION,
         "prompt_token_ids": prompt, "generated_tokens": gen, "__inference_error__": err}
        for i, (prompt, gen, err) in enumerate(rows)
    ])
    return post(batch).to_pylist()


def encode(tokenizer_dir, text, eos=False):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + ([tokenizer.eos_token_id] if eos else [])


def prompt_ids(tokenizer_dir, **kwargs):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **kwargs)


def check_exact(row, prompt, gen):
    assert row["input_ids"] == prompt + gen
    assert row["num_prompt_tokens"] == len(prompt)
    assert row["num_reasoning_tokens"] + row["num_response_tokens"] == len(gen)
    assert len(row["loss_mask"]) == len(row["input_ids"])


@pytest.mark.parametrize("train_on", ["generated", "response"])
def test_qwen3_model_emits_think(qwen3_tokenizer_dir, train_on):
    d = qwen3_tokenizer_dir
    prompt = prompt_ids(d)  # Qwen3 thinking mode: the model opens <think> itself
    gen = encode(d, "<think>\nTwo plus two.\n</think>\n\nThe answer is 4.", eos=True)
    [row] = postprocess(d, [(prompt, gen, "")], train_on)
    check_exact(row, prompt, gen)
    end = gen.index(load_tokenizer(str(d)).convert_tokens_to_ids("</think>"))
    assert row["num_reasoning_tokens"] == end + 1
    assert row["reasoning"] == "Two plus two."
    assert row["response"] == "The answer is 4."
    assert row["finish_reason"] == "stop"
    mask = row["loss_mask"]
    assert mask[:len(prompt)] == [0] * len(prompt)
    if train_on == "generated":
        assert mask[len(prompt):] == [1] * len(gen)
    else:
        assert mask[len(prompt):] == [0] * (end + 1) + [1] * (len(gen) - end - 1)


def test_qwen3_thinking_off_has_no_reasoning(qwen3_tokenizer_dir):
    d = qwen3_tokenizer_dir
    prompt = prompt_ids(d, enable_thinking=False)  # prompt holds an empty, closed think block
    gen = encode(d, "The answer is 4.", eos=True)
    [row] = postprocess(d, [(prompt, gen, "")], "response")
    check_exact(row, prompt, gen)
    assert (row["reasoning"], row["response"]) == ("", "The answer is 4.")
    assert row["num_reasoning_tokens"] == 0
    assert row["loss_mask"][len(prompt):] == [1] * len(gen)


def test_qwen3_reasoning_cut_off_by_max_tokens(qwen3_tokenizer_dir):
    d = qwen3_tokenizer_dir
    prompt = prompt_ids(d)
    gen = encode(d, "<think>\nLet me count: one, two, three")
    [row] = postprocess(d, [(prompt, gen, "")], "response")
    check_exact(row, prompt, gen)
    assert row["finish_reason"] == "length"
    assert row["reasoning"] == "Let me count: one, two, three"
    assert row["response"] == "" and row["num_response_tokens"] == 0
    assert row["loss_mask"] == [0] * (len(prompt) + len(gen))


def test_deepseek_r1_template_opens_think(deepseek_r1_tokenizer_dir):
    d = deepseek_r1_tokenizer_dir
    prompt = prompt_ids(d)
    assert load_tokenizer(str(d)).decode(prompt).endswith("<think>\n")
    gen = encode(d, "Okay, 2+2 is 4.\n</think>\n\nIt is 4.", eos=True)
    cut = encode(d, "Okay, so the user asks")
    unclosed = encode(d, "Hmm, I give up", eos=True)
    rows = postprocess(d, [(prompt, gen, ""), (prompt, cut, ""), (prompt, unclosed, "")], "response")
    done, cut_row, unclosed_row = rows
    check_exact(done, prompt, gen)
    assert (done["reasoning"], done["response"]) == ("Okay, 2+2 is 4.", "It is 4.")
    assert done["finish_reason"] == "stop"
    assert sum(done["loss_mask"]) == done["num_response_tokens"] == len(encode(d, "\n\nIt is 4.")) + 1
    check_exact(cut_row, prompt, cut)
    assert (cut_row["reasoning"], cut_row["response"], cut_row["finish_reason"]) == \
        ("Okay, so the user asks", "", "length")
    # Stopped without closing the reasoning: all of it is reasoning, no response.
    check_exact(unclosed_row, prompt, unclosed)
    assert (unclosed_row["reasoning"], unclosed_row["response"], unclosed_row["finish_reason"]) == \
        ("Hmm, I give up", "", "stop")


def test_no_reasoning_tokens_in_vocab_means_all_response(qwen3_tokenizer_dir):
    """A tokenizer without the end marker as one token: everything generated is response."""
    d = qwen3_tokenizer_dir
    tokenizer = load_tokenizer(str(d))
    special = special_tokens(tokenizer, "<reason>", "</reason>")
    assert special.reasoning_end_id is None
    post = Postprocessor(str(d), False, special.eos_ids, None, None, "response")
    gen = encode(d, "<think>\nx\n</think>\n\ny", eos=True)
    [row] = post(pa.Table.from_pylist([{"sample_id": "a", "conversation_id": "a", "turn": 0,
                                        "source": "t", **answered("a"), "messages": QUESTION,
                                        "prompt_token_ids": [1, 2], "generated_tokens": gen,
                                        "__inference_error__": ""}])).to_pylist()
    assert row["num_reasoning_tokens"] == 0 and row["loss_mask"] == [0, 0] + [1] * len(gen)


def test_error_rows_and_batches_mixing_lengths(qwen3_tokenizer_dir):
    d = qwen3_tokenizer_dir
    prompt = prompt_ids(d)
    gens = [encode(d, "<think>\na\n</think>\n\nb", eos=True), encode(d, "Short.", eos=True),
            encode(d, "<think>\n" + "long " * 50)]
    rows = postprocess(d, [(prompt, gens[0], ""), (None, [], "ValueError: boom"),
                           (prompt[:3], gens[1], ""), (prompt, gens[2], "")])
    assert [r["error"] for r in rows].count("ValueError: boom") == 1
    ok = [r for r in rows if not r["error"]]
    failed = [r for r in rows if r["error"]]
    assert [r["sample_id"] for r in ok] == ["s0", "s2", "s3"] and failed[0]["sample_id"] == "s1"
    assert failed[0]["input_ids"] is None
    for r, p, g in zip(ok, [prompt, prompt[:3], prompt], gens):
        check_exact(r, p, g)
    assert set(rows[0]) == set(OUT_SCHEMA.names)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_logprob_columns_become_fixed_size_lists_per_generated_token(qwen3_tokenizer_dir, dtype):
    """The engine's per-row array bytes -> data/'s list<fixed_size_list<., k>> columns, one
    entry per generated token, in a batch mixing lengths and an error row."""
    import numpy as np

    from eagle_data.job.stages.engines.logprobs import logprob_values
    from eagle_data.storage.contract import data_schema

    d, k = qwen3_tokenizer_dir, 3
    tokenizer = load_tokenizer(str(d))
    special = special_tokens(tokenizer, "<think>", "</think>")
    post = Postprocessor(str(d), False, special.eos_ids, special.reasoning_start_id, special.reasoning_end_id,
                         "generated", logprobs=k, logprobs_dtype=dtype)
    rng = np.random.default_rng(0)
    gens = [encode(d, "<think>\na\n</think>\n\nb", eos=True), encode(d, "Short.", eos=True)]
    arrays = [(rng.integers(0, 1000, (len(g), k)), -rng.random((len(g), k)) * 30, -rng.random(len(g)) * 30)
              for g in gens]
    ok = [{"prompt_token_ids": prompt_ids(d), "generated_tokens": g, "__inference_error__": "", **logprob_values(*a)}
          for g, a in zip(gens, arrays)]
    failed = {"prompt_token_ids": None, "generated_tokens": [], "__inference_error__": "ValueError: boom",
              **dict.fromkeys(logprob_values(*arrays[0]))}
    batch = pa.Table.from_pylist([{"sample_id": f"s{i}", "conversation_id": f"s{i}", "turn": 0, "source": "t", **answered(f"s{i}"),
                                   "messages": QUESTION, **r} for i, r in enumerate([ok[0], failed, ok[1]])])
    table = post(batch)
    assert table.schema == post.schema and data_schema(k, dtype).names == table.schema.names[:-1]
    rows = table.to_pylist()
    assert [r["sample_id"] for r in rows if not r["error"]] == ["s0", "s2"]
    for r, (ids, values, own) in zip([rows[0], rows[1]], arrays):
        generated = r["num_reasoning_tokens"] + r["num_response_tokens"]
        assert len(r["top_logprob_ids"]) == len(r["token_logprobs"]) == generated
        assert r["top_logprob_ids"] == ids.tolist()
        assert r["top_logprobs"] == values.astype(np.float32).astype(dtype).astype(np.float64).tolist()
        assert r["token_logprobs"] == own.astype(np.float32).astype(np.float64).tolist()
    failed_row = next(r for r in rows if r["error"])
    assert failed_row["top_logprob_ids"] is None and failed_row["token_logprobs"] is None
    # An engine row whose bytes do not fit its generated tokens is a wiring bug, named.
    short = batch.slice(0, 1).set_column(batch.schema.get_field_index("token_logprobs"), "token_logprobs",
                                         pa.array([b"\0\0\0\0"]))
    with pytest.raises(ValueError, match="token_logprobs of sample s0: 4 bytes"):
        post(short)
