"""After the hidden-states engine: check each row's features and pack a batch of them into
one shard under OUT/.staging/, on the worker, so the bytes never pass through the driver.

The engine (vLLM's connector, or the transformers pass) wrote one file per row at
`hidden_states_path`: safetensors with `hidden_states` [S, layers, H] and `token_ids`.
A row is packed only when its features pass every check; otherwise it leaves with the
reason in `error` and is never published. The driver then moves the shard into
hidden_states/ (the commit point) and records the failed rows in hidden_failed/.
"""

from __future__ import annotations

import fcntl
import os
import uuid
import zlib

import pyarrow as pa

from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.storage.contract import IDS, STAGING
from eagle_data.storage.files import filesystem
from eagle_data.storage.hidden_states import tensor_bytes, tokens_crc32, write_shard


def load_request_file(path: str) -> dict:
    """The engine's file for one row; waits for vLLM's asynchronous write (its `.lock`)."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # held exclusively by the writer until the file is whole
            return load_file(path)
    return load_file(path)


def remove_request_file(path: str) -> None:
    for name in (path, path + ".lock", path + ".tmp"):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


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


class HiddenStatesPacker(Stage):
    """One batch in, one shard (of the rows that pass) in OUT/.staging/, one small row per
    input row out: `shard` is the staging path ("" for a failed row), `error` why not."""

    reads = columns(*IDS, "input_ids", "hidden_states_path", ENGINE_ERROR_COLUMN)
    makes = columns(*IDS, "shard", "num_tokens", "error")

    def __init__(self, out: str, run_id: str, layer_ids: list[int], hidden_size: int, dtype: str,
                 provenance: dict[str, str]):
        self.out, self.run_id, self.layer_ids, self.provenance = out, run_id, layer_ids, provenance
        self.hidden_size, self.dtype = hidden_size, dtype

    def _load(self, path: str, input_ids: list[int]):
        """(features as stored, "") or (None, why not)."""
        import torch

        try:
            data = load_request_file(path)
        except Exception as e:
            return None, f"the engine's hidden-states file cannot be read ({type(e).__name__}: {e})"
        hidden = data["hidden_states"].to(getattr(torch, self.dtype))
        why = check_states(hidden, data["token_ids"], input_ids, self.layer_ids, self.hidden_size)
        return (None, why) if why else (hidden, "")

    def apply(self, batch: pa.Table) -> pa.Table:
        rows = batch.select([*IDS, "input_ids", "hidden_states_path", ENGINE_ERROR_COLUMN]).to_pylist()
        layout, errors = {}, []
        for row in rows:  # first pass: check each row and note its layout, one sample in memory
            error = row[ENGINE_ERROR_COLUMN] or ""
            if not error:
                hidden, error = self._load(row["hidden_states_path"], row["input_ids"])
                if hidden is not None:
                    data = tensor_bytes(hidden)
                    layout[row["sample_id"]] = (tuple(hidden.shape), len(data), zlib.crc32(data),
                                                tokens_crc32(row["input_ids"]))
            errors.append(error)
        fs, root = filesystem(self.out)
        shard = f"{root}/{STAGING}/hidden-{uuid.uuid4().hex}.safetensors" if layout else ""
        if layout:
            fs.create_dir(f"{root}/{STAGING}", recursive=True)
            paths = {r["sample_id"]: r["hidden_states_path"] for r in rows}
            payloads = (tensor_bytes(self._reload(paths[s])) for s in layout)
            write_shard(fs, shard, layout, payloads, self.dtype, self.run_id, self.layer_ids, self.provenance)
        for row in rows:
            remove_request_file(row["hidden_states_path"])
        return pa.table({
            **{name: [r[name] for r in rows] for name in IDS},
            "shard": pa.array([shard if not e else "" for e in errors], pa.string()),
            "num_tokens": pa.array([len(r["input_ids"]) for r in rows], pa.int64()),
            "error": pa.array(errors, pa.string()),
        })

    def _reload(self, path: str):
        """Second pass: the checked features again, to stream them into the shard."""
        import torch

        return load_request_file(path)["hidden_states"].to(getattr(torch, self.dtype))
