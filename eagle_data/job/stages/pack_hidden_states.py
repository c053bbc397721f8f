"""After the hidden-states engine: check each row's features and pack a batch of them into
one shard under OUT/.staging/, on the worker, so the bytes never pass through the driver.

The engine (vLLM's pass, or the transformers pass) hands each ok row's states on in the
row (state_files.py: `hidden_states` bytes, `hidden_states_shape`, `hidden_token_ids`), so
the only write of a feature byte to OUT's storage is the shard's, and nothing is read back.
A row is packed only when its features pass every check; otherwise it leaves with the
reason in `error` and is never published. The driver then moves the shard into
hidden_states/ (the commit point) and records the failed rows in hidden_failed/.
"""

from __future__ import annotations

import uuid
import zlib

import pyarrow as pa

from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.job.stages.engines.state_files import STATE_COLUMNS
from eagle_data.storage.contract import IDS, STAGING
from eagle_data.storage.files import filesystem
from eagle_data.storage.hidden_states import DTYPES, as_tensor, tokens_crc32, write_shard


def check_states(hidden, token_ids, input_ids: list[int], layer_ids: list[int], hidden_size: int) -> str:
    """Why these features must not be published ("" when they pass): the row count, the
    tokens they were computed on, finiteness, and no layer all zeros (vLLM #46301 gave
    all-zero states; #44485 gave fewer rows than tokens under prefix caching)."""
    import torch

    expected = (len(input_ids), len(layer_ids), hidden_size)
    if tuple(hidden.shape) != expected:
        return f"check: hidden states have shape {list(hidden.shape)}, expected {list(expected)} (tokens, layers, H)"
    if token_ids.tolist() != list(input_ids):
        return "check: the engine's token_ids differ from the row's input_ids"
    if not bool(torch.isfinite(hidden).all()):
        return "check: hidden states hold non-finite values (inf or nan)"
    zero = [k for j, k in enumerate(layer_ids) if not bool(hidden[:, j].any())]
    if zero:
        return f"check: layer id(s) {zero} are all zeros"
    return ""


def row_error(row: dict, layer_ids: list[int], hidden_size: int, dtype: str) -> str:
    """Why an engine's output row (its error column and hand-over columns, state_files.py)
    must not be used ("" when it passes every check)."""
    import torch

    if row[ENGINE_ERROR_COLUMN]:
        return row[ENGINE_ERROR_COLUMN]
    shape, data = row["hidden_states_shape"], row["hidden_states"]
    if data is None or shape is None:
        return "the engine handed over no hidden states for this row"
    itemsize = DTYPES[dtype][1]
    if len(data) != itemsize * int(torch.tensor(shape).prod()):
        return f"check: {len(data)} bytes of hidden states for shape {shape} in {dtype}"
    return check_states(as_tensor(data, shape, dtype), torch.tensor(row["hidden_token_ids"]), row["input_ids"], layer_ids, hidden_size)


class HiddenStatesPacker(Stage):
    """One batch in, one shard (of the rows that pass) in OUT/.staging/, one small row per
    input row out: `shard` is the staging path ("" for a failed row), `error` why not."""

    reads = columns(*IDS, "input_ids", ENGINE_ERROR_COLUMN, *STATE_COLUMNS)
    makes = columns(*IDS, "shard", "num_tokens", "error")

    def __init__(self, out: str, run_id: str, layer_ids: list[int], hidden_size: int, dtype: str,
                 provenance: dict[str, str]):
        self.out, self.run_id, self.layer_ids, self.provenance = out, run_id, layer_ids, provenance
        self.hidden_size, self.dtype = hidden_size, dtype

    def apply(self, batch: pa.Table) -> pa.Table:
        rows = batch.select([*IDS, "input_ids", ENGINE_ERROR_COLUMN, *STATE_COLUMNS]).to_pylist()
        errors = [row_error(row, self.layer_ids, self.hidden_size, self.dtype) for row in rows]
        packed = [row for row, error in zip(rows, errors) if not error]
        fs, root = filesystem(self.out)
        shard = f"{root}/{STAGING}/hidden-{uuid.uuid4().hex}.safetensors" if packed else ""
        if packed:
            layout = {row["sample_id"]: (tuple(row["hidden_states_shape"]), len(row["hidden_states"]),
                                         zlib.crc32(row["hidden_states"]), tokens_crc32(row["input_ids"]))
                      for row in packed}
            fs.create_dir(f"{root}/{STAGING}", recursive=True)
            write_shard(fs, shard, layout, (row["hidden_states"] for row in packed), self.dtype, self.run_id,
                        self.layer_ids, self.provenance)
        return pa.table({
            **{name: [r[name] for r in rows] for name in IDS},
            "shard": pa.array([shard if not e else "" for e in errors], pa.string()),
            "num_tokens": pa.array([len(r["input_ids"]) for r in rows], pa.int64()),
            "error": pa.array(errors, pa.string()),
        })
