"""`export` to the peers' formats, read back the way the peers read them: both load local
JSONL with `datasets.load_dataset("json", ...)` (SpecForge's build_eagle3_dataset input,
speculators' load_raw_dataset), then use the fields checked here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import pytest

from support import SMALL_OUT_LOGPROBS, data_rows, synthetic_row, write_out
from eagle_data.__main__ import main
from eagle_data.tools.export import FORMATS, add_cli, export, run_cli
from eagle_data.storage.contract import data_schema


@pytest.fixture(scope="module")
def out(small_out) -> Path:
    return small_out


@pytest.fixture(scope="module")
def rows(out) -> dict[str, dict]:
    return data_rows(out)


@pytest.fixture
def mixed_out(tmp_path) -> tuple[Path, list[dict]]:
    """Rows with and without reasoning, finished and cut off, from two sources."""
    rows = [synthetic_row(i, 4, 3 if i % 2 else 0, 2, "stop" if i % 3 else "length",
                          "a" if i < 4 else "b") for i in range(8)]
    rows[1]["messages"] = [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "question 1"}]
    return write_out(tmp_path / "mixed", rows, rows_per_shard=3), rows


def load_json(path: Path) -> datasets.Dataset:
    return datasets.load_dataset("json", data_files=str(path), split="train")


def check_specforge_conversation(conv: list[dict]) -> None:
    """SpecForge's conversation rules: optional leading system turn, then user/assistant
    alternating from a user turn, ending with the assistant turn to train on."""
    roles = [m["role"] for m in conv]
    if roles[0] == "system":
        roles = roles[1:]
    assert roles and roles[-1] == "assistant"
    assert roles == ["user", "assistant"] * (len(roles) // 2)
    for m in conv:
        assert isinstance(m["role"], str) and isinstance(m["content"], str)


def test_speculators_rows_are_pretokenized_input_ids_and_loss_mask(out, rows, tmp_path):
    dest = tmp_path / "spec" / "train.jsonl"
    assert export(str(out), str(dest), "speculators")["rows"] == len(rows)
    hf = load_json(dest)
    # speculators treats a dataset whose columns include input_ids and loss_mask as already
    # masked (src/speculators/data_generation/preprocessing.py); lists of ints, same length.
    assert set(hf.column_names) == {"input_ids", "loss_mask"}
    assert hf.features["input_ids"].feature.dtype == "int64"
    assert hf.features["loss_mask"].feature.dtype == "int64"
    exported = {tuple(r["input_ids"]): r["loss_mask"] for r in hf}
    assert exported == {tuple(r["input_ids"]): r["loss_mask"] for r in rows.values()}
    for r in hf:
        assert len(r["input_ids"]) == len(r["loss_mask"]) and sum(r["loss_mask"]) > 0
        assert set(r["loss_mask"]) <= {0, 1}


def test_specforge_rows_are_id_and_conversations_with_reasoning_content(mixed_out, tmp_path,
                                                                         qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    src, rows = mixed_out
    dest = tmp_path / "sf.jsonl"
    counts = export(str(src), str(dest), "specforge")
    finished = [r for r in rows if r["finish_reason"] == "stop"]
    assert counts["rows"] == len(finished) < len(rows)  # cut-off answers left out by default
    hf = load_json(dest)
    assert set(hf.column_names) == {"id", "conversations"}
    by_id = {r["sample_id"]: r for r in finished}
    assert sorted(hf["id"]) == sorted(by_id)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    with open(dest) as f:
        raw = [json.loads(line) for line in f]  # the file itself, before HF unifies keys
    for line in raw:
        r = by_id[line["id"]]
        conv = line["conversations"]
        check_specforge_conversation(conv)
        # Fields a message does not have (reasoning_content of a user turn) are left out.
        assert conv[:-1] == [{k: v for k, v in m.items() if v is not None} for m in r["messages"]]
        assert conv[-1]["content"] == r["response"]
        if r["reasoning"]:
            assert conv[-1]["reasoning_content"] == r["reasoning"]
            # SpecForge's ThinkingParser hands the messages to the tokenizer's chat template,
            # which is where reasoning_content becomes the think block.
            text = tokenizer.apply_chat_template(conv, tokenize=False)
            assert f"<think>\n{r['reasoning']}\n</think>\n\n{r['response']}<|im_end|>" in text
        else:
            assert "reasoning_content" not in conv[-1]
    assert any(by_id[line["id"]]["reasoning"] for line in raw)
    assert any(not by_id[line["id"]]["reasoning"] for line in raw)

    # Explicit filters override the default.
    every = export(str(src), str(tmp_path / "all.jsonl"), "specforge", finish_reason=["stop", "length"],
                   source=["a"])
    assert every["rows"] == sum(r["source"] == "a" for r in rows)


def test_specforge_on_a_real_out(out, rows, tmp_path):
    dest = tmp_path / "sf.jsonl"
    export(str(out), str(dest), "specforge", finish_reason=["stop", "length"])
    hf = load_json(dest)
    assert hf.num_rows == len(rows)
    for r in hf:
        check_specforge_conversation(r["conversations"])
        prompt = [{"role": m["role"], "content": m["content"]} for m in r["conversations"][:-1]]
        assert prompt == [{"role": m["role"], "content": m["content"]} for m in rows[r["id"]]["messages"]]
        assert r["conversations"][-1]["content"] == rows[r["id"]]["response"]


def test_jsonl_has_every_data_column(out, rows, tmp_path):
    dest = tmp_path / "all.jsonl"
    export(str(out), str(dest), "jsonl")
    with open(dest) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == len(rows)
    for line in lines:
        assert list(line) == data_schema(SMALL_OUT_LOGPROBS).names  # the log-probabilities too
        assert line == rows[line["sample_id"]]


def test_cli_hook(out, rows, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    for fmt in FORMATS:
        dest = tmp_path / f"{fmt}.jsonl"
        args = parser.parse_args(["export", str(out), str(dest), "--format", fmt,
                                  "--finish-reason", "stop", "length"])
        assert run_cli(args) == 0
        assert json.loads(capsys.readouterr().out)["rows"] == len(rows)
        assert sum(1 for _ in open(dest)) == len(rows)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    # A user error goes through the one CLI wrapper: `error: ...`, exit 2.
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "x.jsonl"), "--format", "jsonl"]) == 2
    assert "error: not an eagle-data OUT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["export", str(out), "x.jsonl", "--format", "parquet"])


def test_export_never_destroys_an_existing_dest(tmp_path, capsys):
    """Every row cut off (`length`): SpecForge's default `stop` filter leaves nothing."""
    rows = [synthetic_row(i, 4, 0, 2, "length", "a") for i in range(20)]
    src = write_out(tmp_path / "cut", rows, rows_per_shard=7)
    dest = tmp_path / "train.jsonl"
    dest.write_text("the user's file\n")

    def cli(*argv):
        return main(["export", str(src), *map(str, argv)])

    assert cli(dest, "--format", "specforge") == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert cli(dest, "--format", "specforge", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "no rows left after the filters (finish_reason in ['stop'] removed 20 rows)" in err
    assert dest.read_text() == "the user's file\n"  # untouched by both refusals
    assert cli(dest, "--format", "specforge", "--overwrite", "--allow-empty") == 0
    assert dest.read_text() == "" and "finish_reason in ['stop'] removed 20 rows" in capsys.readouterr().err
    assert cli(dest, "--format", "speculators", "--overwrite") == 0
    assert sum(1 for _ in open(dest)) == 20

    assert cli(tmp_path, "--format", "jsonl") == 2
    assert "is a folder; give a file name" in capsys.readouterr().err
    assert cli(dest / "x.jsonl", "--format", "jsonl") == 2
    assert "is a file, so" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_export_writes_only_regular_files_even_with_overwrite(tmp_path, capsys):
    """The issue: `mknod x c 1 3; export OUT x --format jsonl` exited 0 with x a regular file
    (as root, `export OUT /dev/null --overwrite` replaced /dev/null). A FIFO, a symlink, a
    device is refused and named, with or without --overwrite, and stays what it was."""
    import os
    import stat

    src = write_out(tmp_path / "out", [synthetic_row(i, 4, 0, 2, "stop", "a") for i in range(3)], rows_per_shard=2)
    (tmp_path / "target.jsonl").write_text("the user's file\n")
    things = {"FIFO": tmp_path / "fifo", "symlink": tmp_path / "link.jsonl"}
    os.mkfifo(things["FIFO"])
    things["symlink"].symlink_to(tmp_path / "target.jsonl")
    if os.geteuid() == 0:
        things["character device"] = tmp_path / "null"
        os.mknod(things["character device"], 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    for kind, path in things.items():
        before = os.lstat(path)
        for overwrite in ([], ["--overwrite"]):
            assert main(["export", str(src), str(path), "--format", "jsonl", *overwrite]) == 2, kind
            err = capsys.readouterr().err
            assert f"{path} is a {kind}" in err and "refusing to replace it" in err, err
            after = os.lstat(path)
            assert (after.st_mode, after.st_rdev, after.st_ino) == (before.st_mode, before.st_rdev, before.st_ino)
    assert (tmp_path / "target.jsonl").read_text() == "the user's file\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_an_offline_dest_is_only_ever_a_folder_this_tool_wrote(tmp_path):
    """The offline formats' DEST folder: a FIFO, a device, a symlink or another's folder is
    named and refused at once, not first sent to --overwrite (which would refuse it next)."""
    import os
    import stat

    from eagle_data.errors import EagleDataError
    from eagle_data.tools.export import MARKER, check_offline_dest

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / MARKER).write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "ours", target_is_directory=True)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "file").write_text("mine")
    refused = {"fifo": "is a FIFO", "link": "is a symlink to", "theirs": "a folder this tool did not write",
               "file": "not a folder"}
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        refused["null"] = "is a character device"
    for name, why in refused.items():
        for overwrite in (False, True):
            with pytest.raises(EagleDataError, match=why):
                check_offline_dest(str(tmp_path / name), name, overwrite)
    with pytest.raises(EagleDataError, match="exists; pass --overwrite"):
        check_offline_dest(str(tmp_path / "ours"), "ours", False)
    check_offline_dest(str(tmp_path / "ours"), "ours", True)
    check_offline_dest(str(tmp_path / "new" / "dest"), "new/dest", False)


def test_a_dest_inside_the_out_it_reads_is_refused(tmp_path, capsys):
    """`export OUT OUT/data/x.jsonl` (or an offline folder in OUT, or `vocab --dest` in OUT)
    wrote a file that is not the OUT's own: the next job run refused the OUT."""
    import json as json_

    src = write_out(tmp_path / "out", [synthetic_row(i, 4, 2, 3, "stop", "a") for i in range(4)], rows_per_shard=2)
    manifest = json_.loads((src / "manifest.json").read_text())
    manifest["phases"]["generate"]["tokenizer"]["model_vocab_size"] = 1000
    (src / "manifest.json").write_text(json_.dumps(manifest))
    (tmp_path / "link").symlink_to(src)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for argv in (["export", src, src / "data" / "x.jsonl", "--format", "jsonl"],
                 ["export", src, src / "x.jsonl", "--format", "specforge"],
                 ["export", src, tmp_path / "link" / "x.jsonl", "--format", "jsonl"],
                 ["export", src, src / "exp", "--format", "modelopt-offline"],
                 ["vocab", src, "--draft-vocab-size", "10", "--dest", src / "data"],
                 ["vocab", src, "--draft-vocab-size", "10", "--dest", tmp_path / "link"]):
        assert main(list(map(str, argv))) == 2, argv
        assert f"is inside the OUT it reads ({src})" in capsys.readouterr().err, argv
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
    assert main(["vocab", str(src), "--draft-vocab-size", "10", "--dest", str(src / "vocab")]) == 0  # its own place
    assert main(["export", str(src), str(tmp_path / "x.jsonl"), "--format", "jsonl"]) == 0


def test_jsonl_of_an_out_made_before_answered_by_has_the_columns_it_has(tmp_path):
    """data/'s `answered_by` is additive (manifest schema_version 4): an OUT whose shards
    were written without it still exports, each row with the columns its shards hold."""
    import pyarrow.parquet as pq

    rows = [synthetic_row(i, 4, 0, 2, "stop", "a") for i in range(3)]
    src = write_out(tmp_path / "older", rows, rows_per_shard=2)
    for shard in sorted((src / "data").glob("*.parquet")):
        table = pq.read_table(shard)
        pq.write_table(table.drop_columns(["answered_by"]).replace_schema_metadata(table.schema.metadata), shard)
    export(str(src), str(tmp_path / "older.jsonl"), "jsonl")
    lines = [json.loads(line) for line in (tmp_path / "older.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and list(lines[0]) == [c for c in data_schema().names if c != "answered_by"]
