"""The reader with hidden_states=True on a real OUT made by the job (8-layer tiny Qwen3,
transformers engine, float32 states at layer ids [2, 4, 5, 8], 3 samples per shard): each
item's states are its own tensor, aligned with input_ids position by position, truncated
like the tokens, sharded like the tokens, padded by collate, and read by byte range."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import fsspec.implementations.local
import pytest
import torch
from torch.utils.data import DataLoader

from support import data_rows, hidden_features
from eagle_data.errors import MissingInput
from eagle_data.reader import OutReader, OutDataset, OutIterableDataset, Samples, collate
from eagle_data.storage.files import filesystem
from eagle_data.storage.hidden_states import Index

# Every test reads `hidden_out`, an OUT the whole job makes (about a minute): not in `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def out(hidden_out) -> Path:
    return hidden_out


@pytest.fixture(scope="module")
def rows(out) -> dict[str, dict]:
    return data_rows(out)


@pytest.fixture(scope="module")
def reference(out) -> dict[str, torch.Tensor]:
    """Every sample's tensor, read with the storage module (the phase's own reader)."""
    return hidden_features(out)


def test_items_carry_their_own_states_aligned_with_input_ids(out, rows, reference):
    ds = OutDataset(str(out), shuffle=False, hidden_states=True, columns=["sample_id"])
    assert len(ds) == len(rows) == len(reference) and ds.missing_hidden_states == 0
    assert ds.hidden_layer_ids == [2, 4, 5, 8] and ds.hidden_dtype == "float32"
    for i in range(len(ds)):
        item = ds[i]
        sid = item["sample_id"]
        assert item["input_ids"].tolist() == rows[sid]["input_ids"]
        assert item["hidden_states"].shape == (len(rows[sid]["input_ids"]), 4, 64)
        assert item["hidden_states"].dtype == torch.float32
        assert torch.equal(item["hidden_states"], reference[sid])


def test_position_t_holds_the_states_computed_at_token_t(out, deep_qwen3):
    """HF's hidden_states[k][t] (k < L) is the residual stream after k layers at token t:
    the item's row t, layer slot of id k, for the sample's own input_ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(deep_qwen3, dtype=torch.float32).eval()
    item = OutDataset(str(out), shuffle=False, hidden_states=True)[0]
    with torch.no_grad():
        hf = model(input_ids=item["input_ids"][None], output_hidden_states=True).hidden_states
    for slot, k in enumerate([2, 4, 5]):
        torch.testing.assert_close(item["hidden_states"][:, slot], hf[k][0], rtol=1e-4, atol=1e-4)


def test_truncate_cuts_the_states_with_the_tokens(out, rows, reference):
    full = {s["sample_id"]: s for s in OutDataset(str(out), shuffle=False, hidden_states=True, columns=["sample_id"])}
    cut = 20
    assert any(len(r["input_ids"]) > cut for r in rows.values())
    ds = OutDataset(str(out), shuffle=False, hidden_states=True, max_len=cut, overflow="truncate",
                    columns=["sample_id"])
    assert len(ds) + ds.dropped_no_loss == len(rows)
    for item in ds:
        sid = item["sample_id"]
        n = min(cut, len(rows[sid]["input_ids"]))
        assert item["input_ids"].tolist() == rows[sid]["input_ids"][:n]
        assert torch.equal(item["hidden_states"], reference[sid][:n])
        assert torch.equal(item["hidden_states"], full[sid]["hidden_states"][:n])


def test_ranks_partition_samples_with_their_states(out, reference):
    seen = []
    for rank in range(2):
        ds = OutDataset(str(out), rank=rank, world_size=2, seed=5, hidden_states=True, columns=["sample_id"])
        for item in ds:
            assert torch.equal(item["hidden_states"], reference[item["sample_id"]])
            seen.append(item["sample_id"])
    assert sorted(seen) == sorted(reference)


def test_dataloader_workers_and_collate_pad_the_states_with_zeros(out, rows, reference):
    pad_id = OutReader(str(out)).pad_id
    ds = OutIterableDataset(str(out), seed=1, hidden_states=True, columns=["sample_id"])
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=functools.partial(collate, pad_id=pad_id))
    got = []
    for batch in loader:
        hs, ids = batch["hidden_states"], batch["input_ids"]
        assert hs.shape[:2] == ids.shape and hs.shape[2:] == (4, 64) and hs.dtype == torch.float32
        for b, sid in enumerate(batch["sample_id"]):
            n = len(rows[sid]["input_ids"])
            assert torch.equal(hs[b, :n], reference[sid])
            assert not hs[b, n:].any()  # padding: zeros
            assert batch["attention_mask"][b].sum() == n
        got += batch["sample_id"]
    assert sorted(got) == sorted(reference)


def test_collate_pads_to_a_multiple():
    a = {"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([0, 1, 1]),
         "attention_mask": torch.ones(3, dtype=torch.long), "hidden_states": torch.ones(3, 2, 4, dtype=torch.bfloat16)}
    b = {"input_ids": torch.tensor([4]), "loss_mask": torch.tensor([1]),
         "attention_mask": torch.ones(1, dtype=torch.long), "hidden_states": torch.full((1, 2, 4), 2.0, dtype=torch.bfloat16)}
    out = collate([a, b], pad_id=0, pad_to_multiple_of=4)
    assert out["hidden_states"].shape == (2, 4, 2, 4) and out["hidden_states"].dtype == torch.bfloat16
    assert out["hidden_states"][0, :3].eq(1).all() and not out["hidden_states"][0, 3:].any()
    assert out["hidden_states"][1, :1].eq(2).all() and not out["hidden_states"][1, 1:].any()


class CountingFS(fsspec.implementations.local.LocalFileSystem):
    """A local filesystem that records every read: (file name, offset, bytes)."""

    reads: list[tuple[str, int, int]] = []

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "r" not in mode:
            return f
        read = f.read

        def counted(n=-1):
            at = f.tell()
            data = read(n)
            CountingFS.reads.append((Path(path).name, at, len(data)))
            return data

        f.read = counted
        return f


def test_an_item_reads_only_its_own_byte_range(out, rows, reference):
    fs, root = filesystem(str(out))
    entries = Index.read(fs, f"{root}/hidden_states").entries
    CountingFS.reads = []
    ds = OutDataset(str(out), shuffle=False, hidden_states=True, columns=["sample_id"],
                    filesystem=CountingFS(skip_instance_cache=True))
    # Construction read the shards' headers only: the 8-byte length and the JSON after it.
    for name, at, n in [r for r in CountingFS.reads if r[0].endswith(".safetensors")]:
        entry = next(e for e in entries.values() if Path(e.shard).name == name)
        first_tensor = min(e.start for e in entries.values() if e.shard == entry.shard)
        assert at + n <= first_tensor
    for i in (0, 4, len(ds) - 1):
        CountingFS.reads = []
        item = ds[i]
        entry = entries[item["sample_id"]]
        tensor_reads = [r for r in CountingFS.reads if r[0].endswith(".safetensors")]
        assert tensor_reads == [(Path(entry.shard).name, entry.start, entry.end - entry.start)]
        assert torch.equal(item["hidden_states"], reference[item["sample_id"]])
    # Under truncate the whole tensor is read (its crc32 is checked), then cut to the kept rows.
    cut = min(r["num_prompt_tokens"] for r in rows.values()) + 2
    ds = OutDataset(str(out), shuffle=False, hidden_states=True, columns=["sample_id"], max_len=cut,
                    overflow="truncate", filesystem=CountingFS(skip_instance_cache=True))
    CountingFS.reads = []
    item = ds[0]
    entry = entries[item["sample_id"]]
    assert len(item["input_ids"]) == cut < entry.tokens
    assert [r for r in CountingFS.reads if r[0].endswith(".safetensors")] == [
        (Path(entry.shard).name, entry.start, entry.end - entry.start)]
    assert item["hidden_states"].shape[0] == cut


def test_samples_without_states_are_left_out_and_counted(out, tmp_path, rows):
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shards = sorted((copy / "hidden_states").glob("*.safetensors"))
    gone = json.loads(json.loads(shards[0].read_bytes()[8:8 + int.from_bytes(shards[0].read_bytes()[:8], "little")])
                      ["__metadata__"]["crc32"])
    shards[0].unlink()
    ds = Samples(str(copy), shuffle=False, hidden_states=True, columns=["sample_id"])
    assert gone and ds.missing_hidden_states == len(gone)
    assert len(ds) == len(rows) - 3 and not {s["sample_id"] for s in ds} & set(gone)
    # Left out before the rank split: the 9 left over 4 ranks are 3 each (padded), all of them.
    parts = [[s["sample_id"] for s in Samples(str(copy), rank=r, world_size=4, hidden_states=True,
                                              columns=["sample_id"])] for r in range(4)]
    assert len(ds) % 4 and [len(p) for p in parts] == [-(-len(ds) // 4)] * 4
    assert {i for p in parts for i in p} == {s["sample_id"] for s in ds}
    # Without hidden_states every row is there.
    assert len(Samples(str(copy))) == len(rows)
    for shard in shards[1:]:
        shard.unlink()
    with pytest.raises(MissingInput, match="no hidden states"):
        Samples(str(copy), hidden_states=True)
