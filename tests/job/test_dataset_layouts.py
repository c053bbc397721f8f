"""Reading the dataset: every supported layout read correctly, anything else refused at start
naming the file, and no row (bad bytes, odd JSON) able to crash the job."""

from __future__ import annotations

import gzip
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from support import attached, job_cli, job_config, job_settings, read, sharegpt, write_jsonl
from eagle_data.errors import EagleDataError, EmptyResult, MissingInput, UnsupportedDataset
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


# --- every file once, whatever the spelling (locate, before Ray starts) ----------------------

def located(dataset, out=None, **source):
    from eagle_data.config import SourceConfig
    from eagle_data.job.stages.source import locate

    cfg = SourceConfig(dataset=str(dataset), **source)
    return locate(cfg) if out is None else locate(cfg, str(out))


def dataset_tree(tmp_path):
    """data/a.jsonl, data/sub/b.jsonl, a symlinked folder data/linked -> ../elsewhere
    (c.jsonl), a link back up the tree (data/sub/up -> ..) and a file reached twice
    (data/again.jsonl -> a.jsonl)."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    for path in (data / "a.jsonl", data / "sub" / "b.jsonl", tmp_path / "elsewhere" / "c.jsonl"):
        write_jsonl(path, good_rows(2, path.stem))
    (data / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (data / "sub" / "up").symlink_to("..", target_is_directory=True)
    (data / "again.jsonl").symlink_to("a.jsonl")
    return data


def test_every_spelling_of_a_folder_reads_each_file_once(tmp_path):
    data = dataset_tree(tmp_path)
    want = sorted(str(p.resolve()) for p in (data / "a.jsonl", data / "sub" / "b.jsonl",
                                             tmp_path / "elsewhere" / "c.jsonl"))
    for spelling in (data, f"{data}/**", f"{data}/**/", f"{data}/*", f"{data}/**/*.jsonl", f"{tmp_path}/*/**"):
        layout = located(spelling)
        assert sorted(os.path.realpath(p) for p in layout.paths) == want, spelling
        assert len(layout.paths) == len(want), spelling


def test_a_file_name_with_glob_characters_is_that_file(tmp_path):
    write_jsonl(tmp_path / "train[1].jsonl", good_rows(1))
    write_jsonl(tmp_path / "train1.jsonl", good_rows(2))
    assert located(tmp_path / "train[1].jsonl").paths == (str(tmp_path / "train[1].jsonl"),)
    (tmp_path / "train1.jsonl").unlink()
    assert located(tmp_path / "train[1].jsonl").paths == (str(tmp_path / "train[1].jsonl"),)
    (tmp_path / "run[7]").mkdir()  # a folder too
    write_jsonl(tmp_path / "run[7]" / "rows.jsonl", good_rows(1))
    assert located(tmp_path / "run[7]").paths == (str(tmp_path / "run[7]" / "rows.jsonl"),)


def test_dangling_links_and_special_files_are_refused_at_start_naming_them(tmp_path, qwen3_tokenizer_dir):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "ok.jsonl", good_rows(2))
    (folder / "gone.jsonl").symlink_to(tmp_path / "deleted.jsonl")
    with pytest.raises(MissingInput, match=r"data/gone\.jsonl is a dangling symlink \(to '.*deleted\.jsonl'\)"):
        located(folder)
    (folder / "gone.jsonl").unlink()
    os.mkfifo(folder / "pipe.jsonl")
    with pytest.raises(UnsupportedDataset, match=r"data/pipe\.jsonl is a FIFO \(named pipe\), not a regular file"):
        located(folder)
    with pytest.raises(UnsupportedDataset, match=r"pipe\.jsonl is a FIFO"):
        located(f"{folder}/*.jsonl")
    # Through the job: refused before the manifest records a run (and before Ray starts).
    out = tmp_path / "out"
    with pytest.raises(UnsupportedDataset, match=r"pipe\.jsonl is a FIFO"):
        run(job_config(out, qwen3_tokenizer_dir, folder, preset=PROMPTS), phase="prompts")
    assert not (out / "manifest.json").exists()


def test_an_unreadable_parquet_file_is_refused_at_start_naming_it(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(good_rows(3)), folder / "a.parquet")
    (folder / "b.parquet").write_bytes((folder / "a.parquet").read_bytes()[:-20])  # footer cut off
    with pytest.raises(UnsupportedDataset, match=r"data/b\.parquet cannot be read: "):
        located(folder)


def test_out_and_a_dataset_folder_may_not_contain_each_other(tmp_path, qwen3_tokenizer_dir):
    data = dataset_tree(tmp_path)
    # Through the job: refused on the first run already, and OUT is not created.
    with pytest.raises(EagleDataError, match=r"output.path .*data/out is inside the dataset folder .*data "):
        run(job_config(data / "out", qwen3_tokenizer_dir, data, preset=PROMPTS), phase="prompts")
    assert not (data / "out").exists()
    for out in (data / "out", data / "sub" / "up" / "out"):  # inside it, also through a link
        for spelling in (data, f"{data}/**"):
            with pytest.raises(EagleDataError, match=r"output.path .*/out is inside the dataset folder .*data"):
                located(spelling, out)
    with pytest.raises(EagleDataError, match=r"output.path .* is inside the dataset folder .*elsewhere"):
        located(data, tmp_path / "elsewhere" / "out")  # inside a folder a symlink leads to
    with pytest.raises(EagleDataError, match=r"source.dataset .*a\.jsonl is inside output.path .*data"):
        located(data / "a.jsonl", data)  # the dataset inside OUT
    with pytest.raises(EagleDataError, match=r"is inside output.path"):
        located(data, tmp_path)
    assert located(data / "a.jsonl", data.parent / "out").paths  # a file beside OUT is fine
    assert located(f"{data}/*.jsonl", data / "out").paths  # so is OUT beside the files a glob names


def test_a_missing_local_path_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ folder here
    for missing in ("data/train.jsonl", "train.jsonl", "./data", "~/no-such-eagle-data", "rows.parquet",
                    "org/rows.jsonl.gz", "a/b/c"):
        with pytest.raises(MissingInput, match=r"does not exist \(no such file or folder\)"):
            located(missing)
    for hub_id in ("mlabonne/open-perfectblend", "teknium/OpenHermes-2.5", "squad"):
        assert located(hub_id).kind == "hub"


# --- a damaged file: the rows before the damage, and one bad_file row naming it -------------

def rows_text(n):
    """n distinct jsonl lines that compress poorly (so a cut file still holds whole lines)."""
    rng = random.Random(3)
    return [json.dumps(sharegpt(f"q{i} " + "".join(rng.choice("abcdefghij ") for _ in range(300)), "gz"))
            for i in range(n)]


def test_a_truncated_or_corrupt_gzip_keeps_every_line_before_the_damage(tmp_path):
    from eagle_data.job.stages.source import file_rows

    lines = rows_text(40)
    whole = gzip.compress("\n".join(lines).encode() + b"\n")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    *kept, broken = file_rows(str(cut))
    assert 5 < len(kept) < 40 and [r[2] for r in kept] == lines[:len(kept)]  # complete lines, in order
    assert broken[3] == f"{cut}:{len(kept) + 1}"  # origin: the line the cut went through
    assert broken[4].startswith(f"bad_file: truncated gzip file: the compressed stream ends after {len(whole) // 2} "
                                f"bytes, before its end marker; the {len(kept)} rows before line {len(kept) + 1} are kept")
    assert lines[len(kept)].startswith(broken[2])  # the cut line's beginning, as its raw text

    corrupt = tmp_path / "corrupt.jsonl.gz"
    damaged = bytearray(whole)
    damaged[len(whole) // 2:len(whole) // 2 + 64] = bytes(64)  # zeroed bytes inside a deflate block
    corrupt.write_bytes(bytes(damaged))
    *kept, broken = file_rows(str(corrupt))
    assert [r[2] for r in kept] == lines[:len(kept)] and broken[4].startswith("bad_file: ")
    assert broken[3] == f"{corrupt}:{len(kept) + 1}"

    # Two gzip members one after the other (cat a.gz b.gz) are one file, nothing broken.
    members = tmp_path / "members.jsonl.gz"
    members.write_bytes(gzip.compress("\n".join(lines[:3]).encode() + b"\n") + gzip.compress(lines[3].encode()))
    assert [r[2] for r in file_rows(str(members))] == lines[:4]


def test_a_damaged_parquet_row_group_is_one_bad_file_row_the_others_are_read(tmp_path):
    from eagle_data.job.stages.source import file_rows

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(good_rows(15)), path, row_group_size=5, compression="none")
    chunk = pq.read_metadata(path).row_group(1).column(0)
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset:chunk.data_page_offset + 16] = b"\xff" * 16  # the page header
    path.write_bytes(bytes(data))
    before, [broken], after = (file_rows(str(path), group) for group in range(3))
    assert len(before) == len(after) == 5 and all(r[4] == "" for r in before + after)
    assert broken[3] == str(path)
    assert broken[4].startswith("bad_file: row group 1 cannot be read (") and broken[4].endswith(
        "the file's other row groups are read")


def test_parquet_files_with_different_string_types_are_read_each_on_its_own(ray_local, tmp_path):
    from support import read_layout
    from eagle_data.config import SourceConfig

    folder = tmp_path / "pq"
    folder.mkdir()
    rows = good_rows(6)
    plain = pa.Table.from_pylist(rows)
    source = plain.schema.get_field_index("source")
    for name, kind in (("a", pa.string()), ("b", pa.dictionary(pa.int32(), pa.string())), ("c", pa.large_string())):
        table = plain.set_column(source, "source", plain.column("source").cast(kind))
        pq.write_table(table, folder / f"{name}.parquet")
    assert pq.read_schema(folder / "b.parquet").field("source").type != pa.string()  # (not unified on write)
    read = read_layout(SourceConfig(), str(folder), None).take_all()
    assert len(read) == 18 and all(r["read_error"] == "" for r in read)
    assert sorted(r["source"] for r in read) == sorted([r["source"] for r in rows] * 3)


@pytest.mark.slow
def test_a_truncated_gzip_in_the_job_keeps_the_rows_before_the_cut_and_names_the_file(
        ray_local, tmp_path, qwen3_tokenizer_dir):
    lines = rows_text(40)
    whole = gzip.compress("\n".join(lines).encode() + b"\n")
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(whole[:len(whole) // 2])
    counts, prompts, [s] = prompts_run(tmp_path, qwen3_tokenizer_dir, path)
    assert counts["prompts"] == len(prompts) > 5 and counts["skipped_by_reason"] == {"bad_file": 1}
    assert s["detail"].startswith(f"{path}:{len(prompts) + 1}: truncated gzip file"), s["detail"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["phases"]["prompts"]["status"] == "complete"


def test_a_damaged_save_to_disk_folder_is_an_error_naming_it(tmp_path):
    import datasets

    from eagle_data.config import SourceConfig
    from eagle_data.job.stages.source import read_source

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(good_rows(40)).save_to_disk(str(saved))
    [arrow] = saved.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    with pytest.raises(UnsupportedDataset, match=r"the datasets.save_to_disk folder .*saved cannot be read \(OSError: "):
        read_source(SourceConfig(dataset=str(saved)))


def test_a_subfolder_that_cannot_be_listed_is_an_error_naming_it(tmp_path, monkeypatch):
    """os.walk drops a folder it cannot list (permission denied) without a word: its files
    were silently not read. The tests run as root, who can list any folder, so the refusal
    is provoked by making os.scandir fail for that one folder."""
    data = dataset_tree(tmp_path)
    real_scandir = os.scandir

    def scandir(path="."):
        if os.path.realpath(path) == str((data / "sub").resolve()):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(MissingInput, match=r"sub cannot be listed \(Permission denied\)"):
        located(data)
