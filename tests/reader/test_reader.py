"""The training-side reader on a real OUT (tiny random-weight Qwen3, transformers backend,
real Parquet shards) plus a small synthetic OUT where the data must hold chosen values."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
import torch
from torch.utils.data import DataLoader

from support import SMALL_OUT_LOGPROBS, data_rows, read, synthetic_row, write_out
from eagle_data.errors import MissingInput
from eagle_data.storage.contract import data_schema
from eagle_data.reader import OutReader, OutDataset, OutIterableDataset, Samples, collate


@pytest.fixture(scope="module")
def out(small_out) -> Path:
    return small_out


@pytest.fixture(scope="module")
def rows(out) -> dict[str, dict]:
    return data_rows(out)


def ids_of(ds) -> list[str]:
    return [s["sample_id"] for s in ds]


def test_samples_are_the_data_rows_as_long_tensors(out, rows):
    ds = OutDataset(str(out), shuffle=False, columns=["sample_id", "source", "num_prompt_tokens"])
    assert len(ds) == len(rows) > 8
    assert len(OutReader(str(out)).files) > 1  # the index spans several shards
    for i in range(len(ds)):
        s = ds[i]
        r = rows[s["sample_id"]]
        for name in ("input_ids", "loss_mask", "attention_mask"):
            assert s[name].dtype == torch.long and s[name].shape == (len(r["input_ids"]),)
        assert s["input_ids"].tolist() == r["input_ids"]
        assert s["loss_mask"].tolist() == r["loss_mask"]
        assert s["attention_mask"].tolist() == [1] * len(r["input_ids"])
        assert (s["source"], s["num_prompt_tokens"]) == (r["source"], r["num_prompt_tokens"])
    # Without columns= only the three tensors come back.
    assert set(OutDataset(str(out))[0]) == {"input_ids", "loss_mask", "attention_mask"}


def test_loss_mask_marks_the_generated_tokens_after_the_tokenized_prompt(out, rows):
    """The reader's input_ids start with the prompt the prompts phase tokenized (prompts/,
    read with plain pyarrow), and its loss_mask is 0 over them and 1 over every token the
    engine generated (as many as it gave log-probabilities for): the module docstring's
    shift, labels = input_ids[1:] with loss_mask[1:], then trains position t on exactly the
    generated tokens, the first from the last prompt position."""
    prompts = {r["sample_id"]: r["tokenized_prompt"] for r in read(out, "prompts")}
    ds = OutDataset(str(out), shuffle=False, columns=["sample_id", "conversation_id", "num_prompt_tokens"])
    assert len(ds) == len(rows) > 8
    for s in ds:
        prompt, generated = prompts[s["conversation_id"]], len(rows[s["sample_id"]]["token_logprobs"])
        input_ids, loss_mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        assert s["num_prompt_tokens"] == len(prompt) and generated > 0
        assert len(input_ids) == len(prompt) + generated
        assert input_ids[:len(prompt)] == prompt
        assert loss_mask == [0] * len(prompt) + [1] * generated
        trained = [t for t, m in enumerate(loss_mask[1:]) if m]  # positions whose next token is a target
        assert trained == list(range(len(prompt) - 1, len(input_ids) - 1))


def test_collate_pads_ids_with_the_manifest_pad_id_and_masks_with_zero(out):
    pad_id = OutReader(str(out)).pad_id
    assert pad_id == 151643  # Qwen3's <|endoftext|>, from phases.generate.tokenizer
    ds = OutDataset(str(out), shuffle=False)
    batch = [ds[i] for i in range(6)]
    lengths = [len(b["input_ids"]) for b in batch]
    assert len(set(lengths)) > 1
    for multiple, width in ((None, max(lengths)), (16, -(-max(lengths) // 16) * 16)):
        out_batch = collate(batch, pad_id, pad_to_multiple_of=multiple)
        for name in ("input_ids", "loss_mask", "attention_mask"):
            assert out_batch[name].shape == (6, width) and out_batch[name].dtype == torch.long
        for i, (b, n) in enumerate(zip(batch, lengths)):
            assert torch.equal(out_batch["input_ids"][i, :n], b["input_ids"])
            assert torch.equal(out_batch["loss_mask"][i, :n], b["loss_mask"])
            assert (out_batch["input_ids"][i, n:] == pad_id).all()
            assert (out_batch["loss_mask"][i, n:] == 0).all()
            assert out_batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)


@pytest.mark.parametrize("kind", [OutDataset, OutIterableDataset])
def test_ranks_share_the_samples_equally_and_shuffle_is_deterministic(out, rows, kind):
    cols = ["sample_id"]
    for world in (1, 2, 3):  # 20 samples: 3 ranks pad to 7 each (tests/reader/test_reader_ranks.py)
        for epoch in (0, 1):
            for drop_last in (False, True):
                parts = []
                for rank in range(world):
                    ds = kind(str(out), rank=rank, world_size=world, drop_last=drop_last, seed=7,
                              columns=cols, window=2)
                    ds.set_epoch(epoch)
                    parts.append(ids_of(ds))
                flat = [i for p in parts for i in p]
                per = len(rows) // world if drop_last else -(-len(rows) // world)
                assert [len(p) for p in parts] == [per] * world
                if drop_last:
                    assert len(set(flat)) == len(flat) and set(flat) <= set(rows)  # no sample twice
                else:
                    assert set(flat) == set(rows)  # union = all
                if len(rows) % world == 0:
                    assert sorted(flat) == sorted(rows)  # an even split: no padding, nothing dropped
    # Same (seed, epoch) -> same order from a fresh reader; another seed or epoch -> another.
    first = ids_of(kind(str(out), seed=7, columns=cols))
    assert ids_of(kind(str(out), seed=7, columns=cols)) == first
    assert ids_of(kind(str(out), seed=8, columns=cols)) != first
    other_epoch = kind(str(out), seed=7, columns=cols)
    other_epoch.set_epoch(1)
    assert ids_of(other_epoch) != first and sorted(ids_of(other_epoch)) == sorted(first)
    # shuffle=False: file order, then row order.
    files = sorted((out / "data").glob("*.parquet"))
    in_files = pads.dataset(files).to_table(columns=["sample_id"]).column(0).to_pylist()
    assert ids_of(kind(str(out), shuffle=False, columns=cols)) == in_files


def test_iterable_splits_a_rank_across_dataloader_workers(out, rows):
    pad_id = OutReader(str(out)).pad_id
    seen = []
    for rank in range(2):
        ds = OutIterableDataset(str(out), rank=rank, world_size=2, seed=3, columns=["sample_id"])
        loader = DataLoader(ds, batch_size=3, num_workers=2,
                            collate_fn=functools.partial(collate, pad_id=pad_id))
        got = [sid for batch in loader for sid in batch["sample_id"]]
        assert sorted(got) == sorted(ids_of(ds))
        seen += got
    assert sorted(seen) == sorted(rows)


def test_filters_on_source_and_length(out, rows):
    counts = Counter(r["source"] for r in rows.values())
    keep = sorted(counts)[:2]
    ds = OutDataset(str(out), source=keep, columns=["source"])
    assert len(ds) == counts[keep[0]] + counts[keep[1]]
    assert {s["source"] for s in ds} == set(keep)

    lengths = sorted(len(r["input_ids"]) for r in rows.values())
    lo, hi = lengths[2], lengths[-3]
    ds = OutIterableDataset(str(out), min_len=lo, max_len=hi)
    assert sorted(len(s["input_ids"]) for s in ds) == [n for n in lengths if lo <= n <= hi]

    finished = Counter(r["finish_reason"] for r in rows.values())
    for reason in ("stop", "length"):
        assert len(OutDataset(str(out), finish_reason=[reason])) == finished[reason]


def test_finish_reason_filter_on_mixed_rows(tmp_path):
    rows = [synthetic_row(i, 5, 0, 3, "stop" if i % 3 else "length", "a") for i in range(9)]
    out = write_out(tmp_path / "out", rows, rows_per_shard=4)
    ds = OutDataset(str(out), finish_reason=["stop"], columns=["sample_id", "finish_reason"])
    assert sorted(ids_of(ds)) == [r["sample_id"] for r in rows if r["finish_reason"] == "stop"]
    assert len(OutDataset(str(out), finish_reason=["stop", "length"])) == 9


def test_max_len_truncates_or_drops(out, rows):
    cut = sorted(len(r["input_ids"]) for r in rows.values())[len(rows) // 2]
    # A sample cut before its first generated token would train on nothing: dropped, counted.
    shorter = sorted(r["num_prompt_tokens"] for r in rows.values())[len(rows) // 2]
    for max_len in (cut, shorter):
        cut_ds = OutDataset(str(out), max_len=max_len, overflow="truncate", columns=["sample_id"])
        keeps_loss = {k for k, r in rows.items() if r["num_prompt_tokens"] < max_len}
        assert sorted(ids_of(cut_ds)) == sorted(keeps_loss)
        assert cut_ds.dropped_no_loss == len(rows) - len(keeps_loss)
        assert all(s["loss_mask"].sum() > 0 for s in cut_ds)
    assert 0 < len(keeps_loss) < len(rows)  # at the shorter cut some are dropped
    ds = OutDataset(str(out), max_len=cut, overflow="truncate", columns=["sample_id"])
    for s in ds:
        full = rows[s["sample_id"]]
        n = min(cut, len(full["input_ids"]))
        assert s["input_ids"].tolist() == full["input_ids"][:n]
        assert s["loss_mask"].tolist() == full["loss_mask"][:n]
        assert s["attention_mask"].tolist() == [1] * n
    dropped = OutDataset(str(out), max_len=cut, columns=["sample_id"])
    assert sorted(ids_of(dropped)) == sorted(k for k, r in rows.items() if len(r["input_ids"]) <= cut)


def test_data_reads_as_is_with_datasets_and_pyarrow(out, rows):
    import datasets

    hf = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert hf.num_rows == len(rows)
    assert hf.features["input_ids"].feature.dtype == "int32"
    assert hf.features["loss_mask"].feature.dtype == "int8"
    for r in hf:
        assert r["input_ids"] == rows[r["sample_id"]]["input_ids"]
        assert r["messages"] == rows[r["sample_id"]]["messages"]
    table = pads.dataset(str(out / "data"), format="parquet").to_table()
    assert table.schema.names == data_schema(SMALL_OUT_LOGPROBS).names and table.num_rows == len(rows)
    assert table.cast(data_schema(SMALL_OUT_LOGPROBS)).schema.equals(data_schema(SMALL_OUT_LOGPROBS))
    assert hf.features["top_logprob_ids"].feature.length == SMALL_OUT_LOGPROBS


def test_reads_through_an_fsspec_uri(out, rows):
    import fsspec

    mem = fsspec.filesystem("memory")
    for f in [out / "manifest.json", *sorted((out / "data").glob("*.parquet"))]:
        mem.pipe(f"/eagle-test/out/{f.relative_to(out)}", f.read_bytes())
    try:
        reader = OutReader("memory://eagle-test/out")
        assert reader.pad_id == OutReader(str(out)).pad_id
        ds = OutIterableDataset("memory://eagle-test/out", columns=["sample_id"])
        got = {s["sample_id"]: s["input_ids"].tolist() for s in ds}
        assert got == {k: r["input_ids"] for k, r in rows.items()}
    finally:
        mem.rm("/eagle-test", recursive=True)


# --- log-probabilities (`logprobs=True`) ------------------------------------------------

def test_logprobs_align_with_input_ids_on_a_real_out(out, rows):
    """small_out kept the top-3: row t is the distribution for input_ids[t], so the sampled
    token input_ids[t] has token_logprobs[t], which is its entry in the top 3 when it is
    among them; prompt rows are padding."""
    k = SMALL_OUT_LOGPROBS
    seen_in_top = 0
    for s in OutDataset(str(out), shuffle=False, logprobs=True, columns=["sample_id", "num_prompt_tokens"]):
        r, n, p = rows[s["sample_id"]], len(s["input_ids"]), s["num_prompt_tokens"]
        assert s["top_logprob_ids"].shape == (n, k) and s["top_logprob_ids"].dtype == torch.int32
        assert s["top_logprobs"].shape == (n, k) and s["top_logprobs"].dtype == torch.float32
        assert s["token_logprobs"].shape == (n,) and s["token_logprobs"].dtype == torch.float32
        assert (s["top_logprob_ids"][:p] == 0).all() and torch.isneginf(s["top_logprobs"][:p]).all()
        assert (s["token_logprobs"][:p] == 0).all()
        assert s["top_logprob_ids"][p:].tolist() == r["top_logprob_ids"]
        assert s["token_logprobs"][p:].tolist() == r["token_logprobs"]
        for t in range(p, n):
            top = s["top_logprob_ids"][t].tolist()
            if s["input_ids"][t] in top:
                seen_in_top += 1
                assert s["top_logprobs"][t, top.index(s["input_ids"][t])] == s["token_logprobs"][t]
            else:
                assert s["token_logprobs"][t] <= s["top_logprobs"][t, -1]
    assert seen_in_top


def hand_built_out(root: Path, k: int = 2) -> tuple[Path, list[dict]]:
    """Three samples (3 prompt + 3 generated tokens; 2 + 1; 4 + 2) whose log-probabilities
    say where they are: top id 1000 * i + 10 * t + j, value -(t + j / 10), token -(t + 0.5)
    at generated token t of sample i."""
    import pyarrow.parquet as pq

    rows = [synthetic_row(i, p, 1, g - 1, "stop", "s") for i, (p, g) in enumerate([(3, 3), (2, 1), (4, 2)])]
    for i, r in enumerate(rows):
        g = r["num_reasoning_tokens"] + r["num_response_tokens"]
        r["top_logprob_ids"] = [[1000 * i + 10 * t + j for j in range(k)] for t in range(g)]
        r["top_logprobs"] = [[-(t + j / 10) for j in range(k)] for t in range(g)]
        r["token_logprobs"] = [-(t + 0.5) for t in range(g)]
    write_out(root, rows, rows_per_shard=2)
    for i, shard in enumerate(sorted((root / "data").glob("*.parquet"))):
        pq.write_table(pa.Table.from_pylist(rows[2 * i:2 * i + 2], schema=data_schema(k)), shard)
    return root, rows


def test_logprobs_reader_pads_the_prompt_and_keeps_each_generated_tokens_row(tmp_path):
    out, rows = hand_built_out(tmp_path / "out")
    samples = Samples(str(out), shuffle=False, logprobs=True)
    assert samples.logprobs == 2
    for i, s in enumerate(samples):
        p, g = rows[i]["num_prompt_tokens"], len(rows[i]["token_logprobs"])
        assert s["top_logprob_ids"].tolist() == [[0, 0]] * p + [[1000 * i + 10 * t + j for j in range(2)]
                                                                  for t in range(g)]
        assert s["top_logprobs"].dtype == np.float32 and np.isneginf(s["top_logprobs"][:p]).all()
        np.testing.assert_array_equal(s["top_logprobs"][p:], np.float32([[-(t + j / 10) for j in range(2)]
                                                                         for t in range(g)]))
        assert s["token_logprobs"].tolist() == [0] * p + [-(t + 0.5) for t in range(g)]
    # Truncated with input_ids: sample 0 cut to 4 tokens keeps its first generated row.
    cut = Samples(str(out), shuffle=False, logprobs=True, max_len=4, overflow="truncate").sample(0)
    assert cut["top_logprob_ids"].tolist() == [[0, 0]] * 3 + [[0, 1]] and cut["token_logprobs"][-1] == -0.5
    # collate pads like the prompt: ids 0, log-probabilities -inf, token 0.
    batch = collate([OutDataset(str(out), shuffle=False, logprobs=True)[i] for i in (0, 1)], pad_id=0)
    assert batch["top_logprob_ids"].shape == (2, 6, 2) and batch["top_logprob_ids"][1, 3:].eq(0).all()
    assert torch.isneginf(batch["top_logprobs"][1, 3:]).all() and batch["token_logprobs"][1, 3:].eq(0).all()


def test_logprobs_on_an_out_without_them_says_how_to_get_them(tmp_path):
    out = write_out(tmp_path / "out", [synthetic_row(0, 2, 0, 1, "stop", "s")], rows_per_shard=1)
    with pytest.raises(MissingInput, match="sampling.logprobs"):
        Samples(str(out), logprobs=True)


def test_a_holdout_splits_the_rows_by_prompt_the_same_way_every_time(out, rows):
    """The draft trainer's validation split (data.train_data_ratio): a seeded hash of each
    row's prompt_id, so the two sides partition the rows, every answer to a prompt falls on
    one side, and the same (fraction, seed) gives the same split; another seed another."""
    from eagle_data.storage.selection import held_out

    ids = {sid: row["prompt_id"] for sid, row in rows.items()}

    def side(name: str, fraction: float, seed: int) -> set[str]:
        return {item["sample_id"] for item in Samples(str(out), holdout=(name, fraction, seed), columns=("sample_id",))}

    train, validation = side("train", 0.3, 7), side("validation", 0.3, 7)
    assert train | validation == set(rows) and not train & validation
    assert validation == {sid for sid, p in ids.items() if held_out([p], 0.3, 7)[0]}
    assert 0 < len(validation) < len(rows)  # 20 rows, 30%: some on each side
    assert side("validation", 0.3, 7) == validation and side("validation", 0.3, 8) != validation
    assert side("validation", 0.0, 7) == set() and side("train", 1.0, 7) == set()
    # The hash is the prompt's and the seed's alone: pinned, the same split in every process and version.
    assert held_out([f"p{i}" for i in range(8)], 0.5, 42) == [True, True, False, True, True, True, False, True]
    with pytest.raises(ValueError, match="holdout"):
        Samples(str(out), holdout=("test", 0.3, 7))

