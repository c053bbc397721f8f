"""The hidden-states engines' hand-over: a row's states leave its engine's node as columns,
never as a file on OUT's storage.

vLLM's connector can only write a file per request. It writes it under
`hidden_states.scratch_dir` on the engine's own node; the engine's actor reads it back there
(`take`, as soon as the request is answered), removes it, and hands the bytes on in the
row. The transformers pass has the tensor in memory and hands it on the same way
(`as_columns`). The packer (pack_hidden_states.py) then writes each byte once, into a shard
under OUT/.staging/.

Columns of an ok row: `hidden_states` (the states' bytes, C order, [S, layers, H] in the
phase's dtype), `hidden_states_shape` ([S, layers, H]) and `hidden_token_ids` (the tokens the
engine computed them on, which the packer checks against `input_ids`).

Scratch layout: `<scratch_dir>/eagle-data-<out_id>/<run_id>/<sample_id>.safetensors`. A run
killed on a node leaves its folder there; the next run's engine actors on that node remove
the folders of this OUT's earlier runs (`clean_earlier_runs`: only folders named like a run
id, inside the folder named after this OUT; an OUT runs one phase at a time, its lock says so).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil

import pyarrow as pa

from eagle_data.errors import NotWritable

STATE_COLUMNS = {"hidden_states": pa.large_binary(), "hidden_states_shape": pa.list_(pa.int64()),
                   "hidden_token_ids": pa.list_(pa.int64())}
RUN_FOLDER = re.compile(r"^\d{8}T\d{6}-[0-9a-f]{6}$")  # manifest.new_run_id's names


def scratch_folder(scratch_dir: str, out_id: str, run_id: str) -> str:
    return f"{scratch_dir.rstrip('/')}/eagle-data-{out_id}/{run_id}"


def with_state_columns(batch: pa.Table) -> pa.Table:
    """The hand-over columns in their types (large_binary: a batch's states may pass 2 GiB),
    null where a row failed, present even when every row of the batch failed."""
    for name, kind in STATE_COLUMNS.items():
        if name in batch.column_names:
            batch = batch.set_column(batch.column_names.index(name), name, batch.column(name).cast(kind))
        else:
            batch = batch.append_column(name, pa.nulls(batch.num_rows, kind))
    return batch


def as_columns(hidden, token_ids) -> dict:
    """A CPU tensor [S, layers, H] and its tokens, as the row's hand-over columns."""
    from eagle_data.storage.hidden_states import tensor_bytes

    return {"hidden_states": bytes(tensor_bytes(hidden)), "hidden_states_shape": list(hidden.shape),
            "hidden_token_ids": [int(t) for t in token_ids]}


def take(path: str, dtype: str) -> dict:
    """The connector's file for one answered request, as columns; the file is removed.
    Waits for the connector's asynchronous write (it holds `<path>.lock` exclusively until
    the file is whole)."""
    import torch
    from safetensors.torch import load_file

    try:
        lock = path + ".lock"
        if os.path.exists(lock):
            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_SH)
                data = load_file(path)
        else:
            data = load_file(path)
        return as_columns(data["hidden_states"].to(getattr(torch, dtype)), data["token_ids"].tolist())
    finally:
        remove(path)


def remove(path: str) -> None:
    for name in (path, path + ".lock", path + ".tmp"):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


def prepare(run_folder: str) -> None:
    """At an engine actor's start on its node: this run's scratch folder made (one that
    cannot be is the engine's start failure, said in one line, instead of a failed row per
    request), and this OUT's earlier runs' folders there removed."""
    try:
        os.makedirs(run_folder, exist_ok=True)
    except OSError as e:
        raise NotWritable(f"hidden_states.scratch_dir: cannot make {run_folder} on this node ({e}); choose a "
                          "folder on each engine node's own storage that the job may write") from None
    clean_earlier_runs(run_folder)


def clean_earlier_runs(run_folder: str) -> list[str]:
    """Remove the folders this OUT's earlier runs left in this node's scratch; returns them."""
    parent, current = os.path.split(run_folder.rstrip("/"))
    removed = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if name != current and RUN_FOLDER.match(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
