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

A feature stream's files are under `<scratch_dir>/eagle-data-stream-<id>/<run_id>/` (one
folder per stream, training/stream.py); several streams may run at once on a node. Each of
its engine actors holds a shared lock (fcntl) on the stream's folder itself from its start
until its process ends, however it ends (the kernel lets go of a dead process's lock). Every
hidden-states engine that starts on a node (a stream's or the phase's) removes the folders
of the streams whose folder no engine holds (`clean_ended_streams`: the run folders in it,
then the folder once empty; a folder left by an eagle-data from before these locks goes
too). A folder with something else in it is left, and so is any name the project does not
make. No lock file: the folder is the lock.
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
STREAM_FOLDER = re.compile(r"^eagle-data-stream-[0-9a-f]{32}$")  # training/stream.py's, one per stream
_held: dict[str, int] = {}  # the stream folders this process holds: path -> its open descriptor


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
    """At an engine actor's start on its node: a stream's folder held (for as long as this
    process lives), this run's scratch folder made (one that cannot be is the engine's start
    failure, said in one line, instead of a failed row per request), this OUT's earlier
    runs' folders there removed, and the folders of streams that no longer run."""
    folder = os.path.dirname(run_folder.rstrip("/"))
    scratch_dir, top = os.path.split(folder)
    try:
        if STREAM_FOLDER.match(top):
            hold(folder)
        os.makedirs(run_folder, exist_ok=True)
    except OSError as e:
        raise NotWritable(f"hidden_states.scratch_dir: cannot make {run_folder} on this node ({e}); choose a "
                          "folder on each engine node's own storage that the job may write") from None
    clean_earlier_runs(run_folder)
    clean_ended_streams(scratch_dir)


def hold(folder: str) -> None:
    """Make `folder` and hold a shared lock on it until this process ends (once per process).
    A cleaner that took it exclusively first has removed it: then it is made again."""
    if folder in _held:
        return
    while True:
        os.makedirs(folder, exist_ok=True)
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(folder, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                _held[folder] = fd
                return
        except FileNotFoundError:
            pass
        os.close(fd)


def clean_ended_streams(scratch_dir: str) -> list[str]:
    """Remove what ended streams left in this node's scratch: each stream folder whose lock
    can be taken exclusively (no live engine holds it) loses its run folders, then goes if
    that left it empty. Returns the stream folders removed."""
    removed = []
    try:
        names = sorted(os.listdir(scratch_dir))
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(scratch_dir, name)
        if not STREAM_FOLDER.match(name) or folder in _held or os.path.islink(folder) or not os.path.isdir(folder):
            continue
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for run in os.listdir(folder):
                path = os.path.join(folder, run)
                if RUN_FOLDER.match(run) and os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
            os.rmdir(folder)  # fails on anything the project did not put there: the folder is left
            removed.append(folder)
        except OSError:  # BlockingIOError: a running stream's engine holds it
            continue
        finally:
            os.close(fd)
    return removed


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
