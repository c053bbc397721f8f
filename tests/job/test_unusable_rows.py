"""Rows the job cannot use cost what the turn policy uses of them and what the limit they
break allows, not the row: the prompts stage (PromptBuilder) on real tokenizers."""

from __future__ import annotations

import json
import re

import pyarrow as pa

from support import as_config, job_settings
from eagle_data.job.stages.prompts import PromptBuilder

TOOL_ROW = {"conversations": [
    {"from": "system", "value": "You can call tools."},
    {"from": "human", "value": "What is the weather in Paris?"},
    {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
    {"from": "observation", "value": '{"temp": 21}'},
    {"from": "gpt", "value": "It is 21 degrees."},
    {"from": "human", "value": "And tomorrow?"},
    {"from": "tool", "value": "{}"},
]}


def raw_batch(rows: list) -> pa.Table:
    return pa.table({"row_id": [f"r{i}" for i in range(len(rows))], "source": ["s"] * len(rows),
                     "raw": [json.dumps(r) if not isinstance(r, str) else r for r in rows],
                     "origin": [""] * len(rows), "read_error": [""] * len(rows)})


def build(tmp_path, tokenizer_dir, rows, **overrides) -> list[dict]:
    cfg = as_config(job_settings(tmp_path / "out", tokenizer_dir, **overrides))
    return PromptBuilder.from_config(cfg)(raw_batch(rows)).to_pylist()


def test_turns_first_user_never_reads_the_turns_after_the_first_user_turn(tmp_path, qwen3_tokenizer_dir):
    """ShareGPT-style tool turns (`function_call`, `observation`, `tool`) after the first
    user turn were a bad_schema skip of the whole row, though first_user never uses them."""
    (row,) = build(tmp_path, qwen3_tokenizer_dir, [TOOL_ROW])
    assert row["reason"] == "", row["detail"]
    assert [(m["role"], m["content"]) for m in row["messages"]] == [
        ("system", "You can call tools."), ("user", "What is the weather in Paris?")]
    # What the policy does read still costs the row: a turn of unknown role before the first
    # user turn (it could be the one), a first user turn that is not a string.
    before = {"conversations": [{"from": "narrator", "value": "Once"}, {"from": "human", "value": "Hi"}]}
    # A turn that is not well formed is broken data wherever it is (docs/formats.md).
    broken = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "tool", "value": 7}]}
    rows = build(tmp_path, qwen3_tokenizer_dir, [before, broken])
    assert [(r["reason"], r["detail"]) for r in rows] == [
        ("bad_schema", "conversations[0].from is an unknown role 'narrator'"),
        ("bad_schema", "conversations[1].value is a int, not a string")]


def test_turns_all_cuts_the_conversation_before_its_first_tool_turn(tmp_path, qwen3_tokenizer_dir):
    """Under `all` the target answers each user turn with its own answers: a tool turn
    replies to a tool call the target never made, so the conversation ends before it."""
    (row,) = build(tmp_path, qwen3_tokenizer_dir, [TOOL_ROW], prompt__turns="all")
    assert row["reason"] == "", row["detail"]
    assert row["user_turns"] == ["What is the weather in Paris?"]
    later = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "How are you?"}, {"role": "tool", "content": "{}"},
                          {"role": "user", "content": "And now?"}]}
    (row,) = build(tmp_path, qwen3_tokenizer_dir, [later], prompt__turns="all")
    assert row["reason"] == "" and row["user_turns"] == ["Hi", "How are you?"]


class CountingTokenizer:
    """The real tokenizer, recording the length of every text it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, texts, **kwargs):
        self.lengths += [len(t) for t in texts]
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_huge_row_is_skipped_without_being_tokenized(tmp_path, qwen3_tokenizer_dir, monkeypatch):
    """A 50 MB row once took 7.5 GB: it was tokenized whole (12.7M tokens) only to be
    skipped as prompt_too_long. Above what max_model_len can hold at the tokenizer's
    longest token it is skipped on its length alone."""
    import eagle_data.job.stages.prompts as prompts
    from eagle_data.model_files import load_tokenizer

    counting = CountingTokenizer(load_tokenizer(str(qwen3_tokenizer_dir)))
    monkeypatch.setattr(prompts, "load_tokenizer", lambda *a, **k: counting)
    huge = {"messages": [{"role": "user", "content": "word " * 400_000}]}  # 2 MB
    small = {"messages": [{"role": "user", "content": "Hi?"}]}
    near = {"messages": [{"role": "user", "content": "word " * 300}]}  # under the bound: tokenized, too long
    rows = build(tmp_path, qwen3_tokenizer_dir, [huge, small, near],
                 engine__max_model_len=256, sampling__max_tokens=16)
    assert [r["reason"] for r in rows] == ["prompt_too_long", "", "prompt_too_long"]
    assert "not tokenized" in rows[0]["detail"] and "240" in rows[0]["detail"]
    assert re.match(r"\d+ prompt tokens > 240 ", rows[2]["detail"])
    assert max(counting.lengths) < 10_000  # the small and near rows only


def test_the_length_bound_never_skips_a_prompt_that_fits(tmp_path, qwen3_tokenizer_dir):
    """The bound is above what the limit can hold: a prompt of the tokenizer's longest
    tokens, as many as fit, is still a prompt."""
    from eagle_data.job.stages.prompts import longest_token_chars
    from eagle_data.model_files import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    longest = max((t for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t), key=len)
    assert longest_token_chars(str(qwen3_tokenizer_dir), False) == len(longest)
    text = "Hi" + tokenizer.convert_tokens_to_string([longest]) * 200
    rows = build(tmp_path, qwen3_tokenizer_dir, [{"messages": [{"role": "user", "content": text}]}],
                 engine__max_model_len=256, sampling__max_tokens=16)
    assert rows[0]["reason"] == "" and len(rows[0]["tokenized_prompt"]) <= 240
