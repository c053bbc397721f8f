"""prompt.answers=dataset: data/ rows made from the dataset's own answers, on real tokenizers
and their real chat templates. The stages in order, without Ray: the prompts stage
(PromptBuilder: the answer rendered and tokenized, or a skip reason), the requests, the stage
in place of the engine (DatasetAnswers) and the postprocess stage every row takes. A row's
ids must be the chat template's own tokenization of the conversation with its answer, up to
the end-of-turn token the model would have generated, and its mask exactly the answer's
tokens (without the reasoning under mask.train_on: response)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from support import as_config, extract_tokenizer, job_settings
from eagle_data.errors import ConfigError
from eagle_data.job.phases.generate import PROMPT_COLUMNS, target_tokens
from eagle_data.job.stages.engines.dataset_answers import DatasetAnswers
from eagle_data.job.stages.postprocess import Postprocessor
from eagle_data.job.stages.prompts import PromptBuilder
from eagle_data.job.stages.requests import Requests, engine_sampling
from eagle_data.model_files import load_tokenizer

QUESTION = "A train travels 180 km in 2.5 hours. What is its average speed?"
ANSWER = "180 / 2.5 = 72, so 72 km/h."
THOUGHT = "Speed is distance over time."


def chat(answer: dict | None, system: str | None = None) -> dict:
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": QUESTION}]
    return {"messages": turns + ([{"role": "assistant", **answer}] if answer else [])}


def raw_batch(rows: list) -> pa.Table:
    return pa.table({"row_id": [f"r{i}" for i in range(len(rows))], "source": ["s"] * len(rows),
                     "raw": [json.dumps(r) for r in rows], "origin": [""] * len(rows), "read_error": [""] * len(rows)})


def config(tmp_path, model, **overrides):
    return as_config(job_settings(tmp_path / "out", model, prompt__answers="dataset", **{"sampling__max_tokens": 64, **overrides}))


def answered(cfg, rows: list) -> tuple[list[dict], list[dict]]:
    """(the prompts stage's rows, the data/ rows made from its usable ones) as the job makes them."""
    prompts = PromptBuilder.from_config(cfg)(raw_batch(rows))
    usable = prompts.filter(pa.compute.equal(prompts.column("reason"), ""))
    special = target_tokens(cfg, load_tokenizer(cfg.model.tokenizer_path))
    batch = usable.select(PROMPT_COLUMNS + ["answer_ids"])
    batch = (batch.append_column("conversation_id", batch.column("sample_id"))
             .append_column("turn", pa.array([0] * batch.num_rows, pa.int32())))
    requests = Requests(engine_sampling(cfg), cfg.sampling.seed, list(special.eos_ids), sampled=False)(batch)
    data = Postprocessor.from_config(cfg, special)(DatasetAnswers()(requests))
    return prompts.to_pylist(), data.to_pylist()


def template_ids(tokenizer, messages: list[dict], answer: dict) -> list[int]:
    return list(tokenizer.apply_chat_template(messages + [{"role": "assistant", **answer}], tokenize=True,
                                              return_dict=True)["input_ids"])


def check_row(tokenizer, row: dict, answer: dict, eos: int) -> tuple[int, int]:
    """The row's ids are the template's own tokens of the answered conversation up to its
    end-of-turn token (what follows it, the template's newline, is no generated token);
    its prompt is the template's generation prompt. (prompt tokens, answer tokens)."""
    whole = template_ids(tokenizer, row["messages"], answer)
    ids, n = row["input_ids"], row["num_prompt_tokens"]
    assert ids == whole[:len(ids)] and ids[-1] == eos, (tokenizer.decode(ids), tokenizer.decode(whole))
    assert tokenizer.decode(whole[len(ids):]).strip() == ""
    assert ids[:n] == list(tokenizer.apply_chat_template(row["messages"], tokenize=True, add_generation_prompt=True,
                                                         return_dict=True)["input_ids"])
    assert row["answered_by"] == "dataset" and row["sampling"] is None and row["finish_reason"] == "stop"
    return n, len(ids) - n


@pytest.mark.parametrize("train_on", ["generated", "response"])
def test_qwen3_reasoning_template_ids_are_the_templates_and_the_mask_is_the_answer(
        tmp_path, qwen3_tokenizer_dir, train_on):
    """Qwen3's template renders a last answer with its reasoning in <think>...</think>,
    and an empty one when the answer has none, as Qwen3 generates it. The reasoning from a
    `reasoning_content` field, a `reasoning` field, or inline <think>...</think> (the
    model's markers) is the same row."""
    cfg = config(tmp_path, qwen3_tokenizer_dir, mask__train_on=train_on)
    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [chat({"content": ANSWER}, system="Be brief."),
            chat({"content": ANSWER, "reasoning_content": THOUGHT}),
            {"conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": ANSWER,
                                                                     "reasoning": THOUGHT}], "source": "x"},
            chat({"content": f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"})]
    prompts, data = answered(cfg, rows)
    assert [p["reason"] for p in prompts] == ["", "", "", ""], [p["detail"] for p in prompts]
    assert len(data) == 4
    for row, reasoning in zip(data, ["", THOUGHT, THOUGHT, THOUGHT]):
        n, generated = check_row(tokenizer, row, {"content": ANSWER, "reasoning_content": reasoning}, eos)
        assert (row["reasoning"], row["response"]) == (reasoning, ANSWER)
        answer_ids = row["input_ids"][n:]
        think_end = answer_ids.index(tokenizer.convert_tokens_to_ids("</think>")) + 1
        assert row["num_reasoning_tokens"] == think_end  # <think> ... </think>, empty or not
        trained = [0] * think_end + [1] * (generated - think_end) if train_on == "response" else [1] * generated
        assert row["loss_mask"] == [0] * n + trained
    assert data[1]["input_ids"] == data[2]["input_ids"] == data[3]["input_ids"]


def test_a_template_without_reasoning_ids_are_the_templates_and_the_mask_is_the_answer(tmp_path):
    """Qwen2.5's template has no reasoning: it renders the answer's text only (the dataset's
    reasoning, like the target's, is none) and its default system message."""
    tokenizer_dir = extract_tokenizer("qwen-2.5", tmp_path / "qwen2.5")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for train_on in ("generated", "response"):
        cfg = config(tmp_path, tokenizer_dir, mask__train_on=train_on)
        _, [plain, thought] = answered(cfg, [chat({"content": ANSWER}), chat({"content": ANSWER, "reasoning": THOUGHT},
                                                                          system="Think first.")])
        for row in (plain, thought):
            n, generated = check_row(tokenizer, row, {"content": ANSWER}, eos)
            assert row["messages"][0]["role"] in ("user", "system")
            assert (row["reasoning"], row["response"], row["num_reasoning_tokens"]) == ("", ANSWER, 0)
            assert row["loss_mask"] == [0] * n + [1] * generated
            assert tokenizer.decode(row["input_ids"][n:]) == ANSWER + "<|im_end|>"


# Reasoning markers anywhere but a leading <think>...</think> block: each once cut the text
# before the first </think> off the answer, and a target without reasoning tokens trained on
# what followed it, without a word.
MISPLACED = [(f"Sure. <think>{THOUGHT}</think> {ANSWER}", "'<think>' at character 6"),
             (f"Sure. {THOUGHT}</think> {ANSWER}", "'</think>' at character 34"),
             (f"<think>{THOUGHT} {ANSWER}", "'<think>' at character 0"),
             (f"<think>{THOUGHT}</think> {ANSWER} <think>More.</think>", "'<think>' at character 72"),
             (f"<think>{THOUGHT}<think>again</think> {ANSWER}", "'<think>' at character 35")]


@pytest.mark.parametrize("target", ["qwen-2.5", "qwen-3"])
def test_inline_reasoning_is_read_only_at_the_start_and_a_marker_elsewhere_skips_the_row(tmp_path, request, target):
    """docs/formats.md: inline reasoning is a <think>...</think> block at the start of the
    answer's text. Qwen2.5 has no reasoning tokens (like SmolLM2: the markers are plain text
    to it, and its template drops the reasoning); Qwen3 has them. On both, a marker anywhere
    else skips the row naming the marker and where it is, never cuts the text before it; a
    leading block (after whitespace) is the reasoning, and the row trains on the rest."""
    tokenizer_dir = request.getfixturevalue("qwen3_tokenizer_dir") if target == "qwen-3" else \
        extract_tokenizer(target, tmp_path / target)
    cfg = config(tmp_path, tokenizer_dir)
    rows = [chat({"content": text}) for text, _ in MISPLACED]
    rows += [chat({"content": f"<think>{THOUGHT}</think> {ANSWER}", "reasoning_content": THOUGHT}),
             chat({"content": f"\n <think>\n{THOUGHT}\n</think>\n\n{ANSWER}"})]
    prompts, data = answered(cfg, rows)
    assert [(p["reason"], p["detail"]) for p in prompts[:-1]] == [
        ("misplaced_reasoning", f"the answer (messages[1]) has {where}: inline reasoning is read only from a "
                                "'<think>'...'</think>' block at the start of its text")
        for _, where in MISPLACED] + [
        ("misplaced_reasoning", "the answer (messages[1]) has '<think>' at character 0: its reasoning is the turn's "
                                "reasoning field, and its text holds no reasoning markers")]
    assert prompts[-1]["reason"] == "", prompts[-1]["detail"]
    [row] = data
    assert row["response"] == ANSWER and row["reasoning"] == ("" if target == "qwen-2.5" else THOUGHT)


def test_an_answer_longer_than_max_tokens_is_cut_there_as_the_engine_cuts(tmp_path, qwen3_tokenizer_dir):
    long = " ".join(["word"] * 40)
    cfg = config(tmp_path, qwen3_tokenizer_dir, sampling__max_tokens=10)
    _, [row] = answered(cfg, [chat({"content": long})])
    assert row["finish_reason"] == "length" and row["num_reasoning_tokens"] + row["num_response_tokens"] == 10
    assert row["loss_mask"] == [0] * row["num_prompt_tokens"] + [1] * 10


def test_rows_without_an_answer_to_use_are_skipped_with_a_reason(tmp_path, qwen3_tokenizer_dir):
    cfg = config(tmp_path, qwen3_tokenizer_dir)
    rows = [chat(None),
            {"conversations": [{"from": "human", "value": QUESTION}, {"from": "human", "value": "Hello?"},
                               {"from": "gpt", "value": ANSWER}]},
            {"conversations": [{"from": "human", "value": QUESTION}, {"from": "function_call", "value": "{}"}]},
            chat({"content": "  "}),
            chat({"content": "72 km/h<|im_end|><|im_start|>user"}),
            chat({"content": ANSWER, "reasoning_content": 7})]
    prompts, data = answered(cfg, rows)
    assert [(p["reason"], p["detail"]) for p in prompts] == [
        ("no_answer", "no assistant turn right after the first user turn (the row ends there)"),
        ("no_answer", "no assistant turn right after the first user turn (conversations[1] is 'human')"),
        ("no_answer", "no assistant turn right after the first user turn (conversations[1] is 'function_call')"),
        ("no_answer", "the answer (messages[1]) is empty"),
        ("special_token_in_content", "assistant text contains control token '<|im_end|>'"),
        ("bad_schema", "messages[1]'s reasoning is a int, not a string")]
    assert data == []
    # The target's answers ask nothing of the dataset's: the same rows are prompts then.
    target = as_config(job_settings(tmp_path / "out", qwen3_tokenizer_dir))
    assert [r["reason"] for r in PromptBuilder.from_config(target)(raw_batch(rows[:4])).to_pylist()] == [""] * 4


def test_a_template_that_renders_answers_unlike_its_prompt_is_a_recorded_reason(tmp_path, deepseek_r1_tokenizer_dir):
    """DeepSeek-R1's generation prompt opens <think>, and its rendering of an answer drops
    the reasoning: the answered conversation does not start with the prompt's tokens, so
    no row could be the one the target would have made. Recorded, never a drift."""
    cfg = config(tmp_path, deepseek_r1_tokenizer_dir)
    prompts, data = answered(cfg, [chat({"content": ANSWER, "reasoning_content": THOUGHT})])
    assert prompts[0]["reason"] == "answer_template_mismatch" and data == []
    assert prompts[0]["detail"].startswith("the chat template renders the conversation with its answer as other "
                                           "tokens than the prompt's from token"), prompts[0]["detail"]


def test_what_the_dataset_answers_cannot_give_is_a_config_error(tmp_path, qwen3_tokenizer_dir):
    for overrides, named in [({"prompt__turns": "all"}, "prompt.turns: all"),
                             ({"sampling__answers_per_prompt": 2}, "sampling.answers_per_prompt > 1"),
                             ({"sampling__variants": [{"name": "a"}]}, "sampling.variants"),
                             ({"sampling__logprobs": 2}, "sampling.logprobs")]:
        with pytest.raises(ConfigError, match=f"prompt.answers=dataset does not take {named}"):
            config(tmp_path, qwen3_tokenizer_dir, **overrides)


def test_a_stop_token_the_answer_lacks_is_an_error_row_not_a_guess():
    """prompts/ made under other stop ids than the run's (a changed model.path): the row
    fails, as an engine error would, instead of ending anywhere."""
    batch = pa.table({"sample_id": ["a", "b"], "tokenized_prompt": [[1, 2], [1, 2]],
                      "sampling_params": [{"max_tokens": 8, "stop_token_ids": [9]}] * 2,
                      "answer_ids": [[5, 6, 9, 7], [5, 6, 7]]})
    out = DatasetAnswers()(batch).to_pylist()
    assert (out[0]["generated_tokens"], out[0]["__inference_error__"]) == ([5, 6, 9], "")
    assert out[1]["__inference_error__"] == "the dataset's answer (prompts/ answer_ids) has no stop token of this " \
                                            "run's model (eos ids [9])"
    assert "tokenized_prompt" not in out[0] and "answer_ids" not in out[0] and out[0]["prompt_token_ids"] == [1, 2]
