"""source.fields: rows that are not chats, read by the fields that hold their turns, in the
layouts of ../shared/data's prompt sets (a few rows written here in the same shape: the sets
themselves stay outside the repository). GSM8K: `question` and its worked `answer`; MT-bench:
`question_id`, `category`, `turns` (two user messages, no answers)."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support import as_config, job_cli, job_settings, write_jsonl
from eagle_data.errors import ConfigError
from eagle_data.job.stages.prompts import PromptBuilder
from eagle_data.job.stages.source import check_fields, file_rows, first_rows_fields, read_source

GSM8K = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                      "May. How many clips did Natalia sell altogether in April and May?",
          "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                    "altogether in April and May.\n#### 72"},
         {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                      "How much did she earn?",
          "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
                    "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"}]
MT_BENCH = [{"question_id": 81, "category": "writing",
             "turns": ["Compose an engaging travel blog post about a recent trip to Hawaii.",
                       "Rewrite your previous response. Start every sentence with the letter A."]},
            {"question_id": 111, "category": "math",
             "turns": ["The vertices of a triangle are at points (0, 0), (-1, 1), and (3, 3). What is its area?",
                       "What's area of the circle circumscribing the triangle?"]}]


def build(tmp_path, tokenizer_dir, path, **overrides) -> list[dict]:
    cfg = as_config(job_settings(tmp_path / "out", tokenizer_dir, dataset=path, **overrides))
    rows = file_rows(str(path), 0, cfg.source.fields.source if cfg.source.fields else "source")
    batch = pa.table({name: [r[i] for r in rows] for i, name in
                      enumerate(("row_id", "source", "raw", "origin", "read_error"))})
    return PromptBuilder.from_config(cfg)(batch).to_pylist()


def test_gsm8k_rows_question_and_answer(tmp_path, qwen3_tokenizer_dir):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    fields = {"user": "question", "assistant": "answer"}
    target = build(tmp_path, qwen3_tokenizer_dir, path, source__fields=fields)
    assert [(r["reason"], r["source"], r["messages"]) for r in target] == [
        ("", "", [{"role": "user", "content": row["question"], "reasoning_content": None}]) for row in GSM8K]
    assert [r["answer_ids"] for r in target] == [None, None]
    dataset = build(tmp_path, qwen3_tokenizer_dir, path, source__fields=fields, prompt__answers="dataset",
                    sampling__max_tokens=128)
    assert [r["reason"] for r in dataset] == ["", ""]
    assert [r["tokenized_prompt"] for r in dataset] == [r["tokenized_prompt"] for r in target]  # the same prompts
    from eagle_data.model_files import load_tokenizer

    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    assert [tokenizer.decode(r["answer_ids"]) for r in dataset] == [
        f"<think>\n\n</think>\n\n{row['answer']}<|im_end|>" for row in GSM8K]


def test_mt_bench_rows_user_turns_without_answers(tmp_path, qwen3_tokenizer_dir):
    path = write_jsonl(tmp_path / "question.jsonl", MT_BENCH)
    fields = {"user": "turns", "source": "category"}
    first = build(tmp_path, qwen3_tokenizer_dir, path, source__fields=fields)
    assert [(r["reason"], r["source"], r["user_turns"]) for r in first] == [
        ("", row["category"], row["turns"][:1]) for row in MT_BENCH]
    every = build(tmp_path, qwen3_tokenizer_dir, path, source__fields=fields, prompt__turns="all")
    assert [r["user_turns"] for r in every] == [row["turns"] for row in MT_BENCH]
    # No answers to use: each row a recorded reason (the prompts phase then has 0 prompts: exit 3).
    dataset = build(tmp_path, qwen3_tokenizer_dir, path, source__fields=fields, prompt__answers="dataset")
    assert [(r["reason"], r["detail"]) for r in dataset] == [
        ("no_answer", f"{path}:{i + 1}: no assistant turn right after the first user turn (turns[1] is 'user')")
        for i in range(2)]


def test_rows_without_the_named_fields_are_skipped_naming_them(tmp_path, qwen3_tokenizer_dir):
    rows = [{"query": "What is 2+2?"}, {"question": ["What is 2+2?", 7]}, {"question": "Hi", "answer": 4},
            {"question": "Hi", "answer": None}, {"conversations": [{"from": "human", "value": "Hi"}]}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    got = build(tmp_path, qwen3_tokenizer_dir, path, source__fields={"user": "question", "assistant": "answer"})
    assert [(r["reason"], r["detail"].removeprefix(f"{path}:{i + 1}: ")) for i, r in enumerate(got)] == [
        ("bad_schema", "no 'question' (source.fields.user names it)"),
        ("bad_schema", "question[1] is a int, not a string"),
        ("bad_schema", "answer is a int, not a string"),
        ("", ""),  # no answer: asked of the target
        ("bad_schema", "no 'question' (source.fields.user names it)")]
    # With the dataset's answers, a row without its answer is skipped naming the field.
    got = build(tmp_path, qwen3_tokenizer_dir, path, source__fields={"user": "question", "assistant": "answer"},
                prompt__answers="dataset")
    assert (got[3]["reason"], got[3]["detail"]) == (
        "no_answer", f"{path}:4: no answer to question in the row's 'answer' (source.fields.assistant)")


# Each field of source.fields misspelled on GSM8K's rows: each was a skip on every row
# (`no_answer` never naming the field, `bad_schema`), or silently nothing (no system
# message, every source ""); the rows have `question` and `answer`.
MISSPELLED = [({"user": "questoin", "assistant": "answer"}, "source.fields.user 'questoin'"),
              ({"user": "question", "assistant": "answr"}, "source.fields.assistant 'answr'"),
              ({"user": "question", "system": "sytem"}, "source.fields.system 'sytem'"),
              ({"user": "question", "source": "levl"}, "source.fields.source 'levl'"),
              ({"user": "qestion", "assistant": "answr"}, "source.fields.user 'qestion' and source.fields.assistant "
                                                          "'answr'")]


def refusal(named: str, dataset, rows: int) -> str:
    many = " and " in named
    return (f"{named}: none of the first {rows} rows of source.dataset {str(dataset)!r} has "
            f"{'those fields' if many else 'that field'} (the rows' fields: answer, question); "
            f"set source.fields to the fields that hold the turns")


def test_a_field_that_no_row_has_is_refused_at_start_naming_it_and_the_rows_fields(tmp_path, qwen3_tokenizer_dir):
    """The job as a user runs it, on GSM8K's rows: `answr` is refused in one line, exit 2,
    before Ray starts or OUT is made; each other misspelling is refused by the same read."""
    import yaml

    from eagle_data.config import SourceConfig

    path = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    config = tmp_path / "job.yaml"
    settings = job_settings(tmp_path / "out", qwen3_tokenizer_dir, path, source__fields=MISSPELLED[1][0],
                            prompt__answers="dataset", sampling__max_tokens=128)
    config.write_text(yaml.safe_dump(settings))
    result = job_cli(config, "--phase", "prompts")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: " + refusal(MISSPELLED[1][1], path, len(GSM8K))
    assert not (tmp_path / "out").exists()
    for fields, named in MISSPELLED:
        with pytest.raises(ConfigError) as e:
            read_source(SourceConfig(dataset=str(path), fields=fields))
        assert str(e.value) == refusal(named, path, len(GSM8K))


def test_every_layout_is_checked_on_its_first_rows_and_a_field_some_rows_have_is_not_refused(tmp_path):
    """jsonl (plain, gzip), a JSON array, parquet, a datasets.save_to_disk folder: the same
    line. A field of only some rows (here only the last) is no misspelling: those rows are
    per-row skips, as before."""
    import datasets

    from eagle_data.config import SourceConfig

    rows = GSM8K * 3
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for dataset in ("rows.jsonl.gz", "rows.json", "rows.parquet", "saved"):
        source = SourceConfig(dataset=str(tmp_path / dataset), fields={"user": "question", "assistant": "answr"})
        with pytest.raises(ConfigError) as e:
            read_source(source)
        assert str(e.value) == refusal("source.fields.assistant 'answr'", tmp_path / dataset, len(rows))
    mixed = write_jsonl(tmp_path / "mixed.jsonl", ["", "not JSON", json.dumps([1]), *map(json.dumps, [
        {"question": "Hi"}, {"question": "Hi", "hint": "Be brief."}])])
    assert first_rows_fields((str(mixed),)) == (2, {"question", "hint"})
    check_fields(SourceConfig(dataset=str(mixed), fields={"user": "question", "system": "hint"}),
                 *first_rows_fields((str(mixed),)))
