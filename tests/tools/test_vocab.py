"""`vocab`: the draft vocabulary (d2t/t2d) chosen from an OUT's masked target tokens.

Each format is loaded back the way its peer loads it and checked with the peer's own
consistency rule; the selection is compared with a plain-Python reference written from the
rule (count desc, id asc, lowest unused ids as padding); counts on a real OUT made by the
job are compared with a plain count over its rows."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

from eagle_data.__main__ import main
from eagle_data.errors import NotAnOut, VocabError
from eagle_data.tools.token_counts import count_tokens
from eagle_data.tools.vocab import FORMATS, build_vocab, coverage, coverage_curve, mappings, select_ids
from eagle_data.storage.contract import MANIFEST_VERSION

ROW_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("conversation_id", pa.string()), ("turn", pa.int32()),
    ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())), ("finish_reason", pa.string()),
])


# ---------------------------------------------------------------- references, fixtures

def reference_counts(rows, finish_reason=None, source=None) -> Counter:
    """Masked ids of the rows passing the filters, counted one by one."""
    c = Counter()
    for r in rows:
        if finish_reason is not None and r["finish_reason"] not in finish_reason:
            continue
        if source is not None and r["source"] not in source:
            continue
        c.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m == 1)
    return c


def reference_ids(counts: Counter, draft: int, vocab: int) -> list[int]:
    """The rule as written: (count desc, id asc), top D, padded with the lowest unused ids,
    sorted ascending."""
    seen = sorted(counts, key=lambda t: (-counts[t], t))[:draft]
    unused = (t for t in range(vocab) if t not in set(seen))
    while len(seen) < draft:
        seen.append(next(unused))
    return sorted(seen)


def write_rows(root: Path, rows: list[dict], rows_per_shard: int = 4, manifest: dict | None = None,
              row_group_size: int | None = 2) -> Path:
    """A synthetic OUT: data/ shards of several row groups each, and a manifest."""
    (root / "data").mkdir(parents=True)
    for i in range(0, max(len(rows), 1), rows_per_shard):
        table = pa.Table.from_pylist(rows[i:i + rows_per_shard], schema=ROW_SCHEMA)
        pq.write_table(table, root / "data" / f"part-{i // rows_per_shard:05d}.parquet",
                       row_group_size=row_group_size)
    (root / "manifest.json").write_text(json.dumps(manifest or {"schema_version": MANIFEST_VERSION, "phases": {"generate": {}}}))
    return root


def random_rows(seed: int, n: int, vocab: int, sources=("a", "b"), zipf: float = 1.3) -> list[dict]:
    """Rows of prompt ids (mask 0) then generated ids (mask 1, Zipf-like, many ties)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(0, vocab, rng.integers(1, 6)).tolist()
        gen = (np.minimum(rng.zipf(zipf, rng.integers(1, 30)), vocab) - 1).tolist()
        rows.append(row(f"s{i}", prompt, gen, "stop" if i % 3 else "length", sources[i % len(sources)]))
    return rows


def row(sample_id, prompt, gen, finish="stop", source="a", conversation_id=None, turn=0) -> dict:
    return {"sample_id": sample_id, "conversation_id": conversation_id or sample_id, "turn": turn,
            "source": source, "input_ids": [*prompt, *gen],
            "loss_mask": [0] * len(prompt) + [1] * len(gen), "finish_reason": finish}


def multi_turn_rows(conversations: int, vocab: int) -> list[dict]:
    """turns: all rows: turn k's prompt holds the earlier turns' answers with mask 0, so a
    count of unmasked tokens would see them twice. Prompt-only ids are >= vocab // 2."""
    rng = np.random.default_rng(7)
    rows = []
    for c in range(conversations):
        history: list[int] = []
        for turn in range(3):
            user = rng.integers(vocab // 2, vocab, 3).tolist()
            answer = rng.integers(0, vocab // 4, rng.integers(2, 8)).tolist()
            prompt = [*history, *user]
            rows.append(row(f"c{c}t{turn}", prompt, answer, source="mt",
                            conversation_id=f"c{c}", turn=turn))
            history = [*prompt, *answer]
    return rows


@pytest.fixture(scope="module")
def real_out(small_out, tiny_qwen3) -> tuple[Path, int, Path]:
    """An OUT made by the job (tiny Qwen3, real tokenizer), the model's config vocab_size, the model."""
    return small_out, json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"], tiny_qwen3


def read_rows(out: Path) -> list[dict]:
    return pads.dataset(sorted((out / "data").glob("*.parquet"))).to_table().to_pylist()


# ---------------------------------------------------------------------------- real OUT

def test_counts_on_a_real_out_equal_a_plain_count(real_out, tmp_path):
    out, vocab, tiny_qwen3 = real_out
    rows = read_rows(out)
    assert len(rows) >= 3 and len(list((out / "data").glob("*.parquet"))) > 1
    counted = count_tokens(str(out), vocab)
    expected = reference_counts(rows)
    assert {int(t): int(counted.counts[t]) for t in np.flatnonzero(counted.counts)} == dict(expected)
    assert counted.rows == counted.kept == len(rows) and counted.tokens == sum(expected.values())

    # The generate phase records the model's vocab size: config.json's, not len(tokenizer).
    tokenizer = json.loads((out / "manifest.json").read_text())["phases"]["generate"]["tokenizer"]
    assert tokenizer["model_vocab_size"] == vocab
    assert tokenizer["model_vocab_size_from"] == f"{tiny_qwen3}/config.json vocab_size"

    summary = build_vocab(str(out), 64, vocab, str(tmp_path / "v"))
    ids = torch.load(tmp_path / "v" / "d2t.pt", weights_only=True) + torch.arange(64)
    assert ids.tolist() == reference_ids(expected, 64, vocab)
    assert summary["tokens"] == sum(expected.values())


# ------------------------------------------------------------------- peers' formats

@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[int], Counter, int, int]:
    """A synthetic OUT's vocabulary in every format, and what it must hold."""
    root = tmp_path_factory.mktemp("formats")
    rows, draft, vocab = random_rows(1, 60, 300), 40, 300
    out = write_rows(root / "out", rows)
    build_vocab(str(out), draft, vocab, str(root / "dest"), FORMATS)
    counts = reference_counts(rows)
    return root / "dest", reference_ids(counts, draft, vocab), counts, draft, vocab


def test_specforge_vocab_mapping_loads_into_the_drafts_buffers(written):
    dest, ids, _, draft, vocab = written
    # specforge/modeling/draft/base.py load_vocab_mapping: torch.load, then copy_ each key
    # into the buffers llama3_eagle.py registers (t2d bool [V], d2t int64 [D]).
    mapping = torch.load(dest / "vocab_mapping.pt", weights_only=True)
    assert set(mapping) == {"d2t", "t2d"}
    assert mapping["d2t"].dtype == torch.int64 and tuple(mapping["d2t"].shape) == (draft,)
    assert mapping["t2d"].dtype == torch.bool and tuple(mapping["t2d"].shape) == (vocab,)
    t2d, d2t = torch.ones(vocab, dtype=torch.bool), torch.zeros(draft, dtype=torch.int64)
    t2d.copy_(mapping["t2d"])
    d2t.copy_(mapping["d2t"])
    assert torch.equal(torch.nonzero(t2d).flatten(), d2t + torch.arange(draft))
    assert (d2t + torch.arange(draft)).tolist() == ids


def test_speculators_npy_files_and_token_freq(written):
    dest, ids, counts, draft, vocab = written
    # speculators 0.9.0 (`python -m speculators.train --data-path DEST --draft-vocab-size D`):
    # speculators/train/cli.py parse_vocab_mappings looks for DEST/d2t-<D>.npy and
    # DEST/t2d-<D>.npy, and _load_mappings reads them with torch.from_numpy(np.load(...));
    # model.py load_vocab_mappings checks t2d length == verifier vocab, t2d.sum() == D, len(d2t) == D.
    d2t = torch.from_numpy(np.load(dest / f"d2t-{draft}.npy"))
    t2d = torch.from_numpy(np.load(dest / f"t2d-{draft}.npy"))
    assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (draft,)
    assert t2d.dtype == torch.bool and tuple(t2d.shape) == (vocab,)
    assert int(t2d.sum(dtype=torch.long)) == draft
    assert (d2t + torch.arange(draft)).tolist() == ids == torch.nonzero(t2d).flatten().tolist()
    freq = torch.load(dest / "token_freq.pt", weights_only=True)
    assert type(freq) is dict and all(type(k) is int and type(v) is int for k, v in freq.items())
    assert freq == dict(counts)


def test_modelopt_d2t_matches_its_buffer(written):
    dest, ids, _, draft, _ = written
    # hf_eagle.py load_draft_vocab_cache: weights_only load, same shape and dtype as the
    # int64 [D] buffer; target ids = arange(D) + d2t.
    loaded = torch.load(dest / "d2t.pt", weights_only=True)
    buffer = torch.zeros(draft, dtype=torch.int64)
    assert loaded.shape == buffer.shape and loaded.dtype == buffer.dtype
    assert (torch.arange(draft) + loaded).tolist() == ids


def test_token_freq_parquet_and_summary(written):
    dest, _, counts, draft, vocab = written
    table = pq.read_table(dest / "token_freq.parquet")
    assert table.schema.names == ["token_id", "count"]
    assert all(t == pa.int64() for t in table.schema.types)
    assert dict(zip(table["token_id"].to_pylist(), table["count"].to_pylist())) == dict(counts)
    summary = json.loads((dest / "vocab.json").read_text())
    assert summary["draft_vocab_size"] == draft and summary["vocab_size"] == vocab
    assert sorted(p.name for p in dest.iterdir()) == sorted(summary["files"])  # no temp files left
    assert set(summary["files"]) == {"vocab_mapping.pt", f"d2t-{draft}.npy", f"t2d-{draft}.npy", "token_freq.pt",
                                     "d2t.pt", "token_freq.parquet", "vocab.json"}


# ------------------------------------------------------------------------- selection

@pytest.mark.parametrize("case", ["zipf", "ties", "few_distinct", "filters", "multi_turn"])
def test_selection_agrees_with_the_reference(tmp_path, case):
    vocab, draft, filt = 500, 50, {}
    rows = random_rows(2, 80, vocab)
    if case == "ties":  # every id seen exactly twice: the order is by id alone
        rows = [row(f"s{i}", [499], [(7 * i) % 97, (7 * i + 3) % 97]) for i in range(97)]
    elif case == "few_distinct":  # 5 ids seen, 45 fill-ins
        rows = [row(f"s{i}", [1], [100 + i % 5] * (i + 1)) for i in range(20)]
    elif case == "filters":
        filt = {"finish_reason": ["stop"], "source": ["b"]}
    elif case == "multi_turn":
        rows = multi_turn_rows(12, vocab)
    out = write_rows(tmp_path / "out", rows)
    counted = count_tokens(str(out), vocab, **filt)
    expected = reference_counts(rows, **filt)
    assert {int(t): int(counted.counts[t]) for t in np.flatnonzero(counted.counts)} == dict(expected)
    ids = select_ids(counted.counts, draft)
    assert ids.tolist() == reference_ids(expected, draft, vocab)
    d2t, t2d = mappings(ids, vocab)
    assert d2t.dtype == np.int64 and t2d.dtype == bool and int(t2d.sum()) == draft
    if case == "few_distinct":
        assert ids.tolist() == [*range(45), *range(100, 105)]
    if case == "filters":
        keep = [r for r in rows if r["finish_reason"] == "stop" and r["source"] == "b"]
        assert counted.kept == len(keep) < counted.rows == len(rows)
        assert counted.removed == {"finish_reason": sum(r["finish_reason"] != "stop" for r in rows),
                                   "source": sum(r["source"] != "b" for r in rows)}
    if case == "multi_turn":
        assert len({r["conversation_id"] for r in rows}) == 12 and {r["turn"] for r in rows} == {0, 1, 2}
        assert not counted.counts[vocab // 2:].any()  # earlier answers in prompts are not counted again


def test_ties_break_by_lower_id():
    counts = np.array([0, 5, 3, 5, 3, 3, 0, 1])
    assert select_ids(counts, 3).tolist() == [1, 2, 3]
    assert select_ids(counts, 5).tolist() == [1, 2, 3, 4, 5]
    assert select_ids(counts, 7).tolist() == [0, 1, 2, 3, 4, 5, 7]


def test_coverage_and_curve():
    rng = np.random.default_rng(0)
    vocab = 70_000
    counts = np.bincount(np.minimum(rng.zipf(1.2, 200_000), vocab) - 1, minlength=vocab)
    got = coverage(counts, [12_345])
    assert list(got) == [8_000, 12_345, 16_000, 32_000, 64_000]  # 64k < V: kept
    ordered = sorted(counts.tolist(), reverse=True)
    for d, share in got.items():
        assert share == pytest.approx(sum(ordered[:d]) / sum(ordered))
    assert list(coverage(counts[:20_000], [])) == [8_000, 16_000]  # sizes >= V are skipped
    curve = coverage_curve(counts)
    sizes, shares = curve["draft_vocab_size"], curve["coverage"]
    assert 20 <= len(sizes) <= 40 and sizes[0] == 1 and sizes[-1] == vocab
    assert sizes == sorted(set(sizes)) and shares == sorted(shares) and shares[-1] == 1.0


# ---------------------------------------------------------------------------- errors

def test_errors_say_what_to_do(tmp_path):
    rows = random_rows(3, 12, 100)
    out = write_rows(tmp_path / "out", rows)
    with pytest.raises(VocabError, match="--draft-vocab-size 100 must be in"):
        build_vocab(str(out), 100, 100)
    with pytest.raises(VocabError, match="records no .*model_vocab_size .*make it again"):
        build_vocab(str(out), 10)
    with pytest.raises(VocabError, match="outside \\[0, 50\\).*not that model's"):
        count_tokens(str(out), 50)
    with pytest.raises(VocabError) as e:
        count_tokens(str(out), 100, finish_reason=["length"], source=["zzz"])
    removed_by_finish = sum(r["finish_reason"] != "length" for r in rows)
    assert f"--finish-reason length removed {removed_by_finish} of 12 rows" in str(e.value)
    assert "--source zzz removed 12 of 12 rows" in str(e.value)

    (tmp_path / "empty" / "data").mkdir(parents=True)
    with pytest.raises(NotAnOut):
        build_vocab(str(tmp_path / "empty"), 10, 100)
    (tmp_path / "empty" / "manifest.json").write_text(json.dumps({"schema_version": MANIFEST_VERSION, "phases": {}}))
    with pytest.raises(VocabError, match="has no shards: run the generate phase"):
        build_vocab(str(tmp_path / "empty"), 10, 100)
    with pytest.raises(VocabError, match="has no rows"):
        build_vocab(str(write_rows(tmp_path / "zero", [])), 10, 100)
    unmasked = [row("s0", [1, 2, 3], [])]
    with pytest.raises(VocabError, match="no token with loss_mask 1"):
        build_vocab(str(write_rows(tmp_path / "unmasked", unmasked)), 10, 100)
    assert not (tmp_path / "out" / "vocab").exists()  # nothing written on an error


def test_only_mask_ones_count_and_malformed_rows_are_refused(tmp_path):
    """The numpy path counts exactly `loss_mask == 1` (not every non-zero, not a null entry)
    and refuses what would misalign ids and mask."""
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])

    def out_of(name, ids, mask):
        (tmp_path / name / "data").mkdir(parents=True)
        pq.write_table(pa.table({"input_ids": ids, "loss_mask": mask}, schema=schema),
                       tmp_path / name / "data" / "part-00000.parquet")
        (tmp_path / name / "manifest.json").write_text(json.dumps({"schema_version": MANIFEST_VERSION, "phases": {}}))
        return str(tmp_path / name)

    odd = out_of("odd", [[1, 2, 3, 4], [5, 6]], [[0, 2, 1, None], [1, -1]])
    assert np.flatnonzero(count_tokens(odd, 10).counts).tolist() == [3, 5]
    with pytest.raises(VocabError, match="differ in length"):
        count_tokens(out_of("short", [[1, 2, 3]], [[1, 1]]), 10)
    with pytest.raises(VocabError, match="null input_ids or loss_mask"):
        count_tokens(out_of("null_list", [[1, 2], [3]], [[1, 1], None]), 10)
    with pytest.raises(VocabError, match="null token id"):
        count_tokens(out_of("null_id", [[1, None]], [[1, 1]]), 10)


def cli(argv: list[str]) -> int:
    return main(["vocab", *argv])


def test_cli_reads_the_manifest_vocab_size_and_writes_one_format(tmp_path, capsys):
    rows = random_rows(4, 30, 100)
    manifest = {"schema_version": MANIFEST_VERSION, "phases": {"generate": {"tokenizer": {"model_vocab_size": 200, "source": "test"}}}}
    out = write_rows(tmp_path / "out", rows, manifest=manifest)
    assert cli([str(out), "--draft-vocab-size", "20", "--format", "speculators",
                "--finish-reason", "stop"]) == 0
    printed = capsys.readouterr().out.splitlines()
    summary = json.loads(printed[0])
    assert summary["vocab_size"] == 200 and summary["rows_counted"] < summary["rows"] == 30
    assert set(summary["coverage"]) == {"20"}  # every standard size is >= V here
    assert "top     20 ids cover" in printed[1]
    assert sorted(p.name for p in (out / "vocab").iterdir()) == [
        "d2t-20.npy", "t2d-20.npy", "token_freq.parquet", "token_freq.pt", "vocab.json"]
    d2t = np.load(out / "vocab" / "d2t-20.npy")
    expected = reference_ids(reference_counts(rows, ["stop"]), 20, 200)
    assert (d2t + np.arange(20)).tolist() == expected

    assert np.load(out / "vocab" / "t2d-20.npy").shape == (200,)  # the manifest's vocabulary size
    assert cli([str(out), "--draft-vocab-size", "500"]) == 2
    assert "error: --draft-vocab-size 500 must be in [1, 200)" in capsys.readouterr().err


def test_vocab_writes_only_regular_files_in_a_folder(tmp_path, capsys):
    """--dest that is a FIFO or a file is named (was a FileExistsError traceback); a symlink or
    a FIFO at one of the files' names is refused before any file is replaced, so the set is
    never half old, half new."""
    import os

    manifest = {"schema_version": MANIFEST_VERSION, "phases": {"generate": {"tokenizer": {"model_vocab_size": 200}}}}
    out = write_rows(tmp_path / "out", random_rows(4, 30, 100), manifest=manifest)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("mine")
    for name, kind in (("fifo", "a FIFO (named pipe)"), ("file", "a regular file")):
        assert cli([str(out), "--draft-vocab-size", "20", "--dest", str(tmp_path / name)]) == 2
        assert f"{tmp_path / name} is {kind}, not a folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "d2t-20.npy").write_text("old")
    (tmp_path / "elsewhere").write_text("the user's file")
    (dest / "t2d-20.npy").symlink_to(tmp_path / "elsewhere")
    assert cli([str(out), "--draft-vocab-size", "20", "--dest", str(dest), "--format", "speculators"]) == 2
    assert f"{dest}/t2d-20.npy is a symlink to {tmp_path / 'elsewhere'}" in capsys.readouterr().err
    assert sorted(p.name for p in dest.iterdir()) == ["d2t-20.npy", "t2d-20.npy"]
    assert (dest / "d2t-20.npy").read_text() == "old" and (dest / "t2d-20.npy").is_symlink()
    assert (tmp_path / "elsewhere").read_text() == "the user's file"


def test_a_report_error_after_the_vocabulary_is_a_warning(tmp_path, capsys, monkeypatch):
    """The vocabulary is complete before the report is rewritten: any error there (here the
    ValueError a `$\\x$` source raised in matplotlib) is a warning naming it, exit 0."""
    import eagle_data.tools.vocab as vocab

    def failing(out):
        raise ValueError("\\notacommand")

    monkeypatch.setattr(vocab, "write_report", failing)
    manifest = {"schema_version": MANIFEST_VERSION, "phases": {"generate": {"tokenizer": {"model_vocab_size": 200}}}}
    out = write_rows(tmp_path / "out", random_rows(4, 30, 100), manifest=manifest)
    assert cli([str(out), "--draft-vocab-size", "20", "--format", "modelopt"]) == 0
    err = capsys.readouterr().err
    assert "the files are written, but the report could not be rewritten (ValueError: \\notacommand)" in err
    assert (out / "vocab" / "d2t.pt").is_file()


def test_no_option_overrides_the_recorded_vocab_size(tmp_path, capsys):
    """The issue: `vocab --vocab-size` silently replaced the size the OUT records (a t2d of the
    wrong length, which breaks trainers; a huge value was OOM-killed). The CLI has no such
    option, and build_vocab refuses a size other than the recorded one, naming both, before
    anything is counted or allocated."""
    manifest = {"schema_version": MANIFEST_VERSION, "phases": {"generate": {"tokenizer": {"model_vocab_size": 200}}}}
    out = write_rows(tmp_path / "out", random_rows(4, 30, 100), manifest=manifest)
    for size in (300, 10**15):
        with pytest.raises(VocabError, match=f"vocab size {size} differs from the {200} {out}/manifest.json records"):
            build_vocab(str(out), 20, size)
    with pytest.raises(SystemExit) as e:
        cli([str(out), "--vocab-size", "300"])
    assert e.value.code == 2 and "unrecognized arguments: --vocab-size" in capsys.readouterr().err
    assert not (out / "vocab").exists()
    assert build_vocab(str(out), 20, 200, str(tmp_path / "v"))["vocab_size"] == 200  # the same size is no override


def test_vocab_records_its_data_and_the_report_shows_it_only_while_data_is_unchanged(tmp_path):
    import shutil

    from support import synthetic_row, write_out

    out = write_out(tmp_path / "out", [synthetic_row(i, 3, 1, 4, "stop", "s") for i in range(6)], rows_per_shard=3)
    summary = build_vocab(str(out), 8, 1000)  # OUT/vocab/, and the report rewritten
    made_from = json.loads((out / "vocab" / "vocab.json").read_text())["made_from"]
    assert made_from == summary["made_from"] and made_from["out_id"] == "synthetic" and made_from["data_shards"] == 2
    report = json.loads((out / "report.json").read_text())
    assert report["made_from"] == made_from and report["vocab"]["draft_vocab_size"] == 8 and not report["vocab_stale"]
    assert (out / "report" / "vocab_coverage.png").is_file()

    shutil.copy(out / "data" / "part-00001.parquet", out / "data" / "part-00002.parquet")  # rows added since
    assert main(["report", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["vocab"] is None and "vocab/ was made from other data" in report["vocab_stale"]
    assert f"python -m eagle_data vocab {out}" in report["vocab_stale"]
    assert not (out / "report" / "vocab_coverage.png").exists()  # no figure of other rows
    assert "vocab/ was made from other data" in (out / "report.html").read_text()


def test_the_tools_mapping_is_speculators_own_for_any_counts():
    """`vocab` builds d2t/t2d with select_ids; the draft trainer with speculators' own
    build_vocab_mappings_from_distribution. They must be one mapping: on counts with ties,
    with fewer ids seen than the draft's size, and with every id seen."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eagle_data.tools.vocab import mappings, select_ids

    rng = np.random.default_rng(0)
    for vocab, draft, seen in ((50, 10, 30), (50, 10, 4), (1000, 300, 120), (40, 39, 40), (40, 39, 12)):
        counts = np.zeros(vocab, dtype=np.int64)
        ids = rng.choice(vocab, size=seen, replace=False)
        counts[ids] = rng.integers(1, 4, size=seen)  # few values: many ties
        d2t, t2d = mappings(select_ids(counts, draft), vocab)
        theirs = build_vocab_mappings_from_distribution({int(i): int(counts[i]) for i in ids}, draft, vocab)
        assert d2t.tolist() == theirs[0].tolist() and t2d.tolist() == theirs[1].tolist(), (vocab, draft, seen)
