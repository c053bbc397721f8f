"""Reading the dataset: every supported layout read correctly, anything else refused at start
naming the file, and no row (bad bytes, odd JSON) able to crash the job."""

from __future__ import annotations

import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from support import attached, job_cli, job_config, job_settings, read, sharegpt, write_jsonl
from eagle_data.errors import EmptyResult, MissingInput, UnsupportedDataset
from eagle_data.job.phases.run import run

PROMPTS = dict(sampling__max_tokens=256, output__rows_per_shard=16)  # the model: a tokenizer folder


def good_rows(n, tag="good"):
    return [sharegpt(f"{tag} question {i}: what is {i} squared?", f"{tag}{i % 2}") for i in range(n)]


def openai(user, source):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A."}],
            "source": source}


def prompts_run(tmp_path, tokenizer_dir, dataset, out="out", **overrides):
    out = tmp_path / out
    counts = run(job_config(out, tokenizer_dir, dataset, preset=PROMPTS, **overrides), phase="prompts")["prompts"]
    return counts, read(out, "prompts"), read(out, "skipped")


def user_texts(prompts):
    return sorted(p["messages"][-1]["content"] for p in prompts)


# --- 2. A row must never crash the job -----------------------------------------------------

def bad_lines() -> list[tuple[bytes, str | None]]:
    """(line, the skip reason it must get, or None: any reason) - random bytes and odd JSON."""
    rng = random.Random(13)
    lines = [
        (b'{"conversations": [{"from": "human", "value": "lone \\ud800 surrogate"}]}', "bad_encoding"),
        (b'{"messages": [{"role": "user", "content": "x \\udfff"}], "source": "\\ud800"}', "bad_encoding"),
        ('{"conversations": [{"from": "human", "value": "café"}]}'.encode("latin-1"), "bad_encoding"),
        (b'\xff\xfe\x00{"a"', "bad_encoding"),
        (b"123", "bad_schema"), (b"null", "bad_schema"), (b'"just a string"', "bad_schema"),
        (b"{}", "bad_schema"), (b"[]", "bad_schema"),
        (b'{"conversations": [null, null]}', "bad_schema"),
        (b'{"conversations": [{"from": null, "value": null}]}', "bad_schema"),
        (b'{"conversations": {"from": "human", "value": "not a list"}}', "bad_schema"),
        (b'{"messages": [{"role": "user", "content": ["a", "list"]}]}', "bad_schema"),
        (b'{"messages": [{"role": 7, "content": "x"}]}', "bad_schema"),
        (b'{"conversations": [{"from": "human", "value": ' + b"9" * 5000 + b"}]}", "bad_json"),  # int too long
        (b'{"conversations": 1e400}', "bad_schema"),
        (b"[" * 5000 + b"]" * 5000, "bad_json"),  # deeper than the parser's recursion limit
        (b'{"a": ' * 3000 + b"1" + b"}" * 3000, "bad_json"),
        (b'{"conversations": [{"from": "human", "value": "nul \x00 byte"}]}', "bad_json"),
        (b'{"conversations": [{"from": "human", "value": "' + b"long " * 5000 + b'"}]}', "prompt_too_long"),
        (b'{"conversations": [{"from": "human", "value": "truncated', "bad_json"),
        (b"\x00\x00\x00", "bad_json"),
    ]
    for _ in range(12):  # random bytes (no newline: one line each)
        junk = bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randint(8, 300)))
        if junk.decode("utf-8", errors="replace").strip():
            lines.append((junk, None))
    return lines


def test_fuzz_every_good_row_comes_through_every_bad_row_is_a_skip_naming_its_line(
        ray_local, tmp_path, qwen3_tokenizer_dir):
    rng = random.Random(5)
    good = [json.dumps(r).encode() for r in good_rows(40)]
    # Good rows with odd but valid text: an escaped NUL, a literal U+2028 (a line break to
    # str.splitlines, not to jsonl), a CRLF ending, non-ASCII.
    good += [json.dumps(sharegpt("escaped nul \u0000 inside", "odd")).encode(),
             json.dumps(sharegpt("line\u2028separator inside", "odd"), ensure_ascii=False).encode(),
             json.dumps(sharegpt("crlf ending", "odd")).encode() + b"\r",
             json.dumps(sharegpt("naïve café — 日本語", "odd"), ensure_ascii=False).encode()]
    bad = bad_lines()
    lines = [(g, "ok") for g in good] + bad
    rng.shuffle(lines)
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in lines) + b"\n\n")  # a blank line is no row
    expected = {f"{path}:{i}": reason for i, (_, reason) in enumerate(lines, start=1)}

    counts, prompts, skipped = prompts_run(tmp_path, qwen3_tokenizer_dir, path)

    assert counts["selected"] == len(lines) == len(prompts) + len(skipped)
    assert len(prompts) == len(good) and len(skipped) == len(bad)
    assert user_texts(prompts) == sorted(json.loads(g)["conversations"][0]["value"] for g in good)
    known = {"bad_json", "bad_schema", "bad_encoding", "prompt_too_long"}
    for s in skipped:
        origin = s["detail"].split(": ", 1)[0]
        assert origin in expected, s["detail"]
        want = expected.pop(origin)
        assert s["reason"] == want or (want is None and s["reason"] in known), s
    assert all(reason == "ok" for reason in expected.values())
    assert counts["skipped_by_reason"]["bad_encoding"] >= 4  # and the random bytes that are not UTF-8


def test_a_bad_byte_in_a_gzipped_jsonl_skips_that_line_only(ray_local, tmp_path, qwen3_tokenizer_dir):
    lines = [json.dumps(r).encode() for r in good_rows(5)]
    lines.insert(2, json.dumps(sharegpt("Grüße", "x"), ensure_ascii=False).encode("latin-1"))
    column = lines[2].index(b"\xfc") + 1
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(lines)))
    counts, prompts, skipped = prompts_run(tmp_path, qwen3_tokenizer_dir, path)
    assert (counts["prompts"], counts["skipped"]) == (5, 1)
    [s] = skipped
    assert s["reason"] == "bad_encoding"
    assert s["detail"] == f"{path}:3: not UTF-8: byte 0xfc at column {column}", s["detail"]


def test_bad_json_names_file_and_line(ray_local, tmp_path, qwen3_tokenizer_dir):
    path = write_jsonl(tmp_path / "rows.jsonl", good_rows(3) + ["{oops"])
    _, _, [s] = prompts_run(tmp_path, qwen3_tokenizer_dir, path)
    assert s["reason"] == "bad_json" and s["detail"].startswith(f"{path}:4: line is not JSON")


# --- 3. Every supported layout, read correctly ---------------------------------------------

def test_a_pretty_printed_json_array_file(ray_local, tmp_path, qwen3_tokenizer_dir):
    rows = good_rows(3) + [openai("An OpenAI row?", "oa")]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2))
    counts, prompts, skipped = prompts_run(tmp_path, qwen3_tokenizer_dir, path)
    assert (counts["prompts"], counts["skipped"]) == (4, 0), skipped
    assert user_texts(prompts) == sorted([r["conversations"][0]["value"] for r in rows[:3]] + ["An OpenAI row?"])


def test_a_json_array_record_with_a_bad_byte_is_skipped_alone(ray_local, tmp_path, qwen3_tokenizer_dir):
    rows = good_rows(3)
    text = json.dumps(rows[:2] + [{"conversations": [{"from": "human", "value": "MARK"}]}] + rows[2:], indent=1)
    path = tmp_path / "rows.json"
    path.write_bytes(text.replace("MARK", "Grüße").encode("latin-1"))
    counts, prompts, [s] = prompts_run(tmp_path, qwen3_tokenizer_dir, path)
    assert counts["prompts"] == 3
    line = text[:text.index("MARK")].rsplit('{\n  "conversations"', 1)[0].count("\n") + 1
    assert s["reason"] == "bad_encoding" and s["detail"].startswith(f"{path}:{line}: not UTF-8: byte 0xfc")


def test_a_save_to_disk_dataset_and_dataset_dict(ray_local, tmp_path, qwen3_tokenizer_dir):
    import datasets

    train, test = good_rows(6, "train"), good_rows(4, "test")
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "saved"))
    counts, prompts, skipped = prompts_run(tmp_path, qwen3_tokenizer_dir, tmp_path / "saved")
    assert (counts["prompts"], counts["skipped"]) == (6, 0), skipped
    assert user_texts(prompts) == sorted(r["conversations"][0]["value"] for r in train)

    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "dict"))
    counts, prompts, _ = prompts_run(tmp_path, qwen3_tokenizer_dir, tmp_path / "dict", "out-dict",
                                     source__split="test")
    assert counts["prompts"] == 4 and user_texts(prompts) == sorted(r["conversations"][0]["value"] for r in test)

    with pytest.raises(MissingInput, match=r"has no split 'validation'.*\['train', 'test'\]"):
        prompts_run(tmp_path, qwen3_tokenizer_dir, tmp_path / "dict", "out-v", source__split="validation")
    # A folder holding a save_to_disk folder: refused, naming it (not read as loose files).
    (tmp_path / "parent").mkdir()
    (tmp_path / "dict").rename(tmp_path / "parent" / "dict")
    with pytest.raises(UnsupportedDataset, match=r"parent/dict is a datasets.save_to_disk folder; set source.dataset to that folder"):
        prompts_run(tmp_path, qwen3_tokenizer_dir, tmp_path / "parent", "out-p")


def test_rows_are_read_from_whichever_of_conversations_or_messages_holds_them(
        ray_local, tmp_path, qwen3_tokenizer_dir):
    sharegpt_rows = good_rows(4, "sg")
    openai_rows = [openai(f"OpenAI question {i}?", "oa") for i in range(3)]
    # One table with both columns (each row has the other null), and a folder of one file each.
    both = pa.concat_tables([pa.Table.from_pylist(sharegpt_rows), pa.Table.from_pylist(openai_rows)],
                            promote_options="default")
    assert {"conversations", "messages"} <= set(both.column_names)
    pq.write_table(both, tmp_path / "both.parquet")
    folder = tmp_path / "folder"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(sharegpt_rows), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist(openai_rows), folder / "b.parquet")
    expected = sorted([r["conversations"][0]["value"] for r in sharegpt_rows] +
                      [r["messages"][0]["content"] for r in openai_rows])
    for dataset in (tmp_path / "both.parquet", folder):
        counts, prompts, skipped = prompts_run(tmp_path, qwen3_tokenizer_dir, dataset)
        assert counts["skipped"] == 0, skipped
        assert user_texts(prompts) == expected
        (tmp_path / "out").rename(tmp_path / f"out-{dataset.name}")
    # Both null: still a bad_schema skip.
    write_jsonl(tmp_path / "nulls.jsonl", [{"conversations": None, "messages": None}] + good_rows(1))
    _, _, [s] = prompts_run(tmp_path, qwen3_tokenizer_dir, tmp_path / "nulls.jsonl")
    assert s["reason"] == "bad_schema" and s["detail"].endswith("'conversations' is null")


def test_a_folder_ignores_hidden_files_and_docs(ray_local, tmp_path, qwen3_tokenizer_dir):
    folder = tmp_path / "hub-snapshot"
    (folder / "data").mkdir(parents=True)
    (folder / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (folder / "README.md").write_text("# a dataset card\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.lock").write_text("")
    pq.write_table(pa.Table.from_pylist(good_rows(5)), folder / "data" / "train-00000.parquet")
    counts, _, _ = prompts_run(tmp_path, qwen3_tokenizer_dir, folder)
    assert (counts["prompts"], counts["skipped"]) == (5, 0)


# --- anything else: refused at start, naming the file ----------------------------------------

def test_unsupported_files_are_refused_at_start_naming_the_file(tmp_path, qwen3_tokenizer_dir):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "ok.jsonl", good_rows(2))
    (folder / "rows.csv").write_text("a,b\n1,2\n")
    only_docs = tmp_path / "docs"
    only_docs.mkdir()
    (only_docs / "README.md").write_text("# nothing\n")
    (only_docs / ".gitattributes").write_text("")
    cases = {
        folder / "rows.csv": r"source.dataset .*rows\.csv: unsupported file type '\.csv'",  # named
        tmp_path / "mixed" / "*": r"source.dataset '.*\*': .*rows\.csv: unsupported file type '\.csv'",  # glob
        folder: r"source.dataset '.*mixed': .*rows\.csv: unsupported file type '\.csv'",  # in a folder
        only_docs: r"holds no data files",
        tmp_path / "nothing-*.jsonl": r"matches no files",
    }
    for i, (dataset, message) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        with pytest.raises(MissingInput, match=message):
            run(job_config(out, qwen3_tokenizer_dir, dataset, preset=PROMPTS), phase="prompts")
        assert not (out / "manifest.json").exists()  # refused before anything was recorded
    arrow = tmp_path / "loose"
    arrow.mkdir()
    (arrow / "data-00000-of-00001.arrow").write_bytes(b"")
    with pytest.raises(UnsupportedDataset, match=r"\.arrow.*naming the folder itself"):
        run(job_config(tmp_path / "outa", qwen3_tokenizer_dir, arrow, preset=PROMPTS), phase="prompts")


# --- 0 prompts is an error unless --allow-empty ----------------------------------------------

def test_zero_prompts_is_an_error_unless_allowed(ray_local, tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(EmptyResult, match=r"0 prompts: source.dataset .*empty.jsonl' holds no rows.*--allow-empty"):
        prompts_run(tmp_path, qwen3_tokenizer_dir, tmp_path / "empty.jsonl")
    write_jsonl(tmp_path / "junk.jsonl", ["{oops", {"conversations": []}])
    with pytest.raises(EmptyResult, match=r"all 2 selected rows .* skipped \(bad_json 1, no_user_turn 1\)"):
        run(job_config(tmp_path / "out2", qwen3_tokenizer_dir, tmp_path / "junk.jsonl", preset=PROMPTS),
            phase="prompts")
    counts = run(job_config(tmp_path / "out2", qwen3_tokenizer_dir, tmp_path / "junk.jsonl", preset=PROMPTS),
                 phase="prompts", allow_empty=True)["prompts"]
    assert (counts["selected"], counts["prompts"]) == (2, 0)
    # A generate phase on that OUT is refused too (no engine started for nothing).
    with pytest.raises(EmptyResult, match="0 prompts"):
        run(job_config(tmp_path / "out2", qwen3_tokenizer_dir, tmp_path / "junk.jsonl", preset=PROMPTS),
            phase="generate")


@pytest.mark.slow
def test_the_entry_point_exits_3_on_zero_prompts(ray_local, tmp_path, qwen3_tokenizer_dir):
    write_jsonl(tmp_path / "junk.jsonl", ["{oops"])
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(tmp_path / "out", qwen3_tokenizer_dir, tmp_path / "junk.jsonl")))
    result = job_cli(config, "--phase", "prompts", env=attached(ray_local))
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: 0 prompts: all 1 selected rows")
    allowed = job_cli(config, "--phase", "prompts", "--allow-empty", env=attached(ray_local))
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "0 prompts" in allowed.stdout
