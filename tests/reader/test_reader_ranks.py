"""Every rank gets the same number of samples per epoch (a DDP step with one collective per
batch otherwise blocks forever on the ranks that still have a batch): padding by repeating
the epoch order from its start (the default, as torch's DistributedSampler) or drop_last.
Synthetic OUTs written by hand (real Parquet shards); the DDP test runs real gloo ranks."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.utils.data import DataLoader

from support import synthetic_row, write_out
from eagle_data.errors import ConfigError
from eagle_data.reader import OutDataset, OutIterableDataset, Samples, collate

# 14 rows of 6 tokens (3 prompt + 3 generated) and 3 of 12 (10 prompt + 2 generated): under
# max_len=8 the long ones are dropped by overflow="drop" and, cut before their first loss
# token, by overflow="truncate" (dropped_no_loss), so both keep the same 14 samples.
KEPT, MAX_LEN = 14, 8
FILTERS = {"none": {}, "drop": {"max_len": MAX_LEN}, "truncate": {"max_len": MAX_LEN, "overflow": "truncate"}}


def mixed_rows() -> list[dict]:
    rows = [synthetic_row(i, 3, 0, 3, "stop", "a") for i in range(KEPT)]
    for at, i in ((2, 100), (9, 101), (16, 102)):  # spread over the shards
        rows.insert(at, synthetic_row(i, 10, 0, 2, "stop", "a"))
    return rows


@pytest.fixture
def mixed_out(tmp_path) -> tuple[Path, set[str]]:
    rows = mixed_rows()
    out = write_out(tmp_path / "mixed", rows, rows_per_shard=4)  # 5 shards
    return out, {r["sample_id"] for r in rows if r["num_prompt_tokens"] < MAX_LEN}


def rank_ids(out, world, epoch=0, **kwargs) -> list[list[str]]:
    parts = []
    for rank in range(world):
        s = Samples(str(out), rank=rank, world_size=world, seed=5, columns=["sample_id"], **kwargs)
        s.set_epoch(epoch)
        parts.append([item["sample_id"] for item in s])
    return parts


@pytest.mark.parametrize("filters", sorted(FILTERS))
@pytest.mark.parametrize("world", [4, 20])
def test_every_rank_gets_the_same_number_of_samples(mixed_out, filters, world):
    out, kept = mixed_out
    if filters == "none":
        kept = {f"s{i:04d}" for i in (*range(KEPT), 100, 101, 102)}
    n = len(kept)
    for epoch in (0, 1):
        whole = Samples(str(out), seed=5, columns=["sample_id"], **FILTERS[filters])
        order = [whole.sample(int(pos))["sample_id"] for pos in whole.epoch_order(epoch)]
        padded = rank_ids(out, world, epoch, **FILTERS[filters])
        per = -(-n // world)
        assert [len(p) for p in padded] == [per] * world  # 17 over 4: 5 each, 14 over 20: 1 each
        flat = [i for p in padded for i in p]
        # The union is every kept sample; the repeats are the order's first samples.
        assert set(flat) == kept and flat == (order * world)[:per * world]
        if n < world:
            continue
        dropped = rank_ids(out, world, epoch, drop_last=True, **FILTERS[filters])
        assert [len(p) for p in dropped] == [n // world] * world
        flat = [i for p in dropped for i in p]
        assert len(set(flat)) == len(flat) and flat == order[:n // world * world]  # the tail is dropped


def test_drop_last_with_fewer_samples_than_ranks_is_an_error(mixed_out):
    out, _ = mixed_out
    with pytest.raises(ConfigError, match=r"drop_last=True.*14 samples.*world_size=20"):
        Samples(str(out), rank=3, world_size=20, drop_last=True, max_len=MAX_LEN)
    assert len(Samples(str(out), rank=3, world_size=14, drop_last=True, max_len=MAX_LEN)) == 1


# --- real DDP ranks ------------------------------------------------------------------------

WORLD = 4
# (dataset class, reader options, DataLoader workers, the OUT: "mixed" 14 kept / "few" 3 rows)
DDP_CASES = [
    ("map", {"max_len": MAX_LEN}, 0, "mixed"),
    ("iterable", {"max_len": MAX_LEN, "overflow": "truncate"}, 2, "mixed"),
    ("map", {"max_len": MAX_LEN, "drop_last": True}, 0, "mixed"),
    ("iterable", {"max_len": MAX_LEN, "drop_last": True}, 2, "mixed"),
    ("map", {}, 0, "few"),
    ("iterable", {}, 2, "few"),
]


def ddp_rank(rank: int, init: str, outs: dict[str, str], results: Path) -> None:
    """One training rank: every case's loader, one all_reduce per batch (of the case number,
    so a rank that ran out and went on to the next case is seen, not paired silently)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    report = []
    for case, (kind, options, workers, out) in enumerate(DDP_CASES):
        cls = OutDataset if kind == "map" else OutIterableDataset
        ds = cls(outs[out], rank=rank, world_size=WORLD, seed=3, columns=["sample_id"], **options)
        loader = DataLoader(ds, batch_size=1, num_workers=workers, collate_fn=functools.partial(collate, pad_id=0))
        ids, sums = [], set()
        for batch in loader:
            step = torch.tensor([float(case)])
            dist.all_reduce(step)
            sums.add(step.item())
            ids += batch["sample_id"]
        report.append({"ids": ids, "sums": sorted(sums)})
    dist.destroy_process_group()
    (results / f"rank{rank}.json").write_text(json.dumps(report))


def test_ddp_ranks_finish_together(tmp_path, mixed_out):
    """4 gloo ranks, one all_reduce per batch: every rank finishes (a rank left with an extra
    batch would block forever: the join's timeout fails the test), with the same count."""
    few = write_out(tmp_path / "few", [synthetic_row(i, 3, 0, 3, "stop", "a") for i in range(3)], rows_per_shard=2)
    outs = {"mixed": str(mixed_out[0]), "few": str(few)}
    ctx = torch_mp.get_context("fork")  # the ranks start from this process's imports: seconds, not tens
    procs = [ctx.Process(target=ddp_rank, args=(r, str(tmp_path / "init"), outs, tmp_path)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still blocked after 60 s"
    assert [p.exitcode for p in procs] == [0] * WORLD
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for case, (kind, options, workers, out) in enumerate(DDP_CASES):
        parts = [report[case]["ids"] for report in reports]
        assert all(report[case]["sums"] == [case * WORLD] for report in reports), (kind, options)
        kept = mixed_out[1] if out == "mixed" else {f"s{i:04d}" for i in range(3)}
        flat = [i for p in parts for i in p]
        if options.get("drop_last"):
            assert [len(p) for p in parts] == [len(kept) // WORLD] * WORLD  # 3 each
            assert len(set(flat)) == len(flat) and set(flat) <= kept
        else:
            assert [len(p) for p in parts] == [-(-len(kept) // WORLD)] * WORLD  # 4 each; 1 each of 3
            assert set(flat) == kept
