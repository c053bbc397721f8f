"""Stream rows -> torch (eagle_data/reader/batches.py), on a hand-made batch as Ray Train's
`iter_batches(batch_format="numpy")` gives it (Ray's own Arrow -> numpy conversion, no Ray
instance): `collate` pads it as the reader does, `pack` makes speculators' packed batch.
Every expected value is computed here from the rows' own numbers, not with the module's code
or speculators'."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from eagle_data.reader.batches import collate, pack, stream_items

LAYERS, H = 4, 2  # 4 layer ids: 3 aux inputs and the final (pre-norm) state
ROWS = [  # (sample_id, epoch, prompt tokens, generated tokens): lengths 5, 3, 6
    ("s0", 0, 3, 2),
    ("s1", 0, 1, 2),
    ("s2", 1, 2, 4),
]


def token(row: int, t: int) -> int:
    return 1000 + 100 * row + t


def state(row: int, t: int, layer: int, h: int) -> float:
    """The value at [t, layer, h] of row `row`'s states: distinct integers below 256, so
    exact in bfloat16 too."""
    return float(((row * 6 + t) * LAYERS + layer) * H + h)


def states_bytes(row: int, n: int, dtype: str) -> bytes:
    values = [[[state(row, t, layer, h) for h in range(H)] for layer in range(LAYERS)] for t in range(n)]
    if dtype == "float32":
        return np.asarray(values, dtype="<f4").tobytes()
    # bfloat16: the top two bytes of each float32 (exact for these values)
    return (np.asarray(values, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()


def numpy_batch(dtype: str) -> dict:
    """The rows as stream.py's SAMPLE_COLUMNS, through Ray Data's Arrow -> numpy batch."""
    from ray.data.block import BlockAccessor

    rows = []
    for i, (sid, epoch, p, g) in enumerate(ROWS):
        n = p + g
        rows.append({"sample_id": sid, "epoch": epoch, "input_ids": [token(i, t) for t in range(n)],
                     "loss_mask": [0] * p + [1] * g, "hidden_states": states_bytes(i, n, dtype),
                     "hidden_states_shape": [n, LAYERS, H]})
    schema = pa.schema([("sample_id", pa.string()), ("epoch", pa.int64()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int64())), ("hidden_states", pa.large_binary()),
                        ("hidden_states_shape", pa.list_(pa.int64()))])
    return BlockAccessor.for_block(pa.Table.from_pylist(rows, schema=schema)).to_batch_format("numpy")


@pytest.mark.parametrize("stream_dtype, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                 ("bfloat16", torch.float32)])
def test_pack_concatenates_the_rows_shifted_as_speculators_shift_batch(stream_dtype, dtype):
    """Each row of n tokens gives n - 1 positions: position t pairs token t + 1 (its
    input_ids and loss_mask) with the aux states AT token t (every layer id but the last,
    flattened layer by layer) and the final state AT token t + 1 (verifier_last); position
    ids from 1; the rows one after the other, document ids 0, 1, 2, no padding."""
    packed = pack(stream_items(numpy_batch(stream_dtype), stream_dtype), hidden_size=H, dtype=dtype)
    assert set(packed) == {"input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states",
                           "position_ids", "document_ids"}
    ids, mask, aux, last, positions, docs = [], [], [], [], [], []
    for i, (_, _, p, g) in enumerate(ROWS):
        n = p + g
        for t in range(n - 1):
            ids.append(token(i, t + 1))
            mask.append(0 if t + 1 < p else 1)
            aux.append([state(i, t, layer, h) for layer in range(LAYERS - 1) for h in range(H)])
            last.append([state(i, t + 1, LAYERS - 1, h) for h in range(H)])
            positions.append(t + 1)
            docs.append(i)
    total = sum(p + g - 1 for _, _, p, g in ROWS)
    assert len(ids) == total == 11
    assert packed["input_ids"].shape == packed["loss_mask"].shape == packed["position_ids"].shape == (1, total)
    assert packed["input_ids"][0].tolist() == ids
    assert packed["loss_mask"][0].tolist() == mask
    assert sum(mask) == sum(g for *_, g in ROWS)  # every generated token is still a target
    assert packed["position_ids"][0].tolist() == positions
    assert packed["document_ids"].shape == (1, total) and packed["document_ids"][0].tolist() == docs
    assert packed["hidden_states"].shape == (1, total, (LAYERS - 1) * H) and packed["hidden_states"].dtype == dtype
    assert packed["verifier_last_hidden_states"].shape == (1, total, H)
    assert packed["verifier_last_hidden_states"].dtype == dtype
    assert packed["hidden_states"][0].float().tolist() == aux
    assert packed["verifier_last_hidden_states"][0].float().tolist() == last
    assert packed["input_ids"].dtype == packed["loss_mask"].dtype == torch.int64


def test_pack_of_one_row():
    batch = numpy_batch("float32")
    one = {k: v[1:2] for k, v in batch.items()}  # s1: 1 prompt token, 2 generated
    packed = pack(stream_items(one, "float32"), hidden_size=H, dtype=torch.float32)
    assert packed["input_ids"][0].tolist() == [token(1, 1), token(1, 2)]
    assert packed["loss_mask"][0].tolist() == [1, 1]
    assert packed["document_ids"][0].tolist() == [0, 0]
    assert packed["verifier_last_hidden_states"][0].tolist() == [[state(1, t, LAYERS - 1, h) for h in range(H)]
                                                                 for t in (1, 2)]


@pytest.mark.parametrize("multiple", [None, 4])
def test_collate_pads_the_rows_with_their_states(multiple):
    """The reader's padded batch: ids with pad_id, masks with 0, states [B, T, layers, H]
    with zeros, rows as they came; sample_id and epoch as lists."""
    pad_id = 7
    got = collate(numpy_batch("bfloat16"), pad_id=pad_id, dtype="bfloat16", pad_to_multiple_of=multiple)
    longest = max(p + g for _, _, p, g in ROWS)
    width = longest if multiple is None else -(-longest // multiple) * multiple
    assert width == (6 if multiple is None else 8)
    assert got["sample_id"] == [sid for sid, *_ in ROWS] and got["epoch"] == [e for _, e, *_ in ROWS]
    assert all(type(e) is int for e in got["epoch"]) and all(type(s) is str for s in got["sample_id"])
    for name in ("input_ids", "loss_mask", "attention_mask"):
        assert got[name].shape == (len(ROWS), width) and got[name].dtype == torch.long
    assert got["hidden_states"].shape == (len(ROWS), width, LAYERS, H)
    assert got["hidden_states"].dtype == torch.bfloat16
    for i, (_, _, p, g) in enumerate(ROWS):
        n, pad = p + g, width - (p + g)
        assert got["input_ids"][i].tolist() == [token(i, t) for t in range(n)] + [pad_id] * pad
        assert got["loss_mask"][i].tolist() == [0] * p + [1] * g + [0] * pad
        assert got["attention_mask"][i].tolist() == [1] * n + [0] * pad
        assert got["hidden_states"][i].float().tolist() == (
            [[[state(i, t, layer, h) for h in range(H)] for layer in range(LAYERS)] for t in range(n)]
            + [[[0.0] * H] * LAYERS] * pad)
