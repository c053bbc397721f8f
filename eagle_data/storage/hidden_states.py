"""OUT/hidden_states/: the target's hidden states at the EAGLE-3 layers, sharded.

A shard is `part-<run id>-<n>.safetensors`, a valid safetensors file (any safetensors
reader opens it) holding one tensor per sample, named by its `sample_id`:
[len(input_ids), len(layer_ids), hidden_size], layers in ascending id order. Its header
(`__metadata__`) says what the tensors are:

    format      "eagle-data hidden states"
    layer_ids   JSON list of vLLM layer ids (id k = the residual stream after k decoder
                layers; id L, the last, is the final state BEFORE the final norm)
    final_norm  "pre" (the state at id L is before the model's final norm)
    dtype       bfloat16 | float16 | float32
    crc32       JSON {sample_id: crc32 of the tensor's bytes}, checked by `verify`, by the
                reader and export when they read a tensor, and by the phase before it runs
    input_ids_crc32  JSON {sample_id: crc32 of the input_ids the tensor was computed from,
                as int32 little-endian bytes (`tokens_crc32`)}: an entry whose data/ row now
                holds other tokens (the row answered again) is not done (`stale`)
    run_id      the run that wrote the shard

A reader reaches one sample by reading the header (8 bytes of length, then JSON) and then
that sample's byte range only (`read_sample`), on any filesystem OUT may be on.

Shards are written in OUT/.staging/ by the workers that pack them and moved into
hidden_states/ by the driver: that move is a sample's commit point, as for data/.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from eagle_data.storage.files import list_folder

SUFFIX = ".safetensors"
FORMAT = "eagle-data hidden states"
# safetensors dtype names, and bytes per value
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


@dataclass(frozen=True)
class Entry:
    """Where one sample's tensor lies in a shard."""

    shard: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int
    crc32: int | None
    input_ids_crc32: int | None = None  # None: a shard written before it was recorded

    @property
    def tokens(self) -> int:
        return self.shape[0]


def encode_header(entries: dict[str, tuple[tuple[int, ...], int]], dtype: str, metadata: dict) -> bytes:
    """The safetensors header for tensors of `dtype`, given name -> (shape, nbytes) in
    file order; padded with spaces to a multiple of 8 bytes, as safetensors aligns."""
    code = DTYPES[dtype][0]
    header, offset = {"__metadata__": {k: str(v) for k, v in metadata.items()}}, 0
    for name, (shape, nbytes) in entries.items():
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor) -> "memoryview":
    """A CPU torch tensor's bytes, as stored (C order), without a copy when it is contiguous."""
    import torch

    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def tokens_crc32(input_ids) -> int:
    """Which tokens a tensor was computed from: crc32 of the input_ids as int32 little-endian bytes."""
    return zlib.crc32(np.asarray(input_ids, dtype="<i4").tobytes())


def write_shard(fs: pafs.FileSystem, path: str, layout: dict[str, tuple[tuple[int, ...], int, int, int]],
                payloads: Iterable, dtype: str, run_id: str, layer_ids: list[int],
                provenance: dict[str, str]) -> int:
    """Write one shard at `path`: `layout` is name -> (shape, nbytes, crc32, crc32 of the
    input_ids it was computed from) in file order,
    `payloads` yields each tensor's bytes in that order (one sample in memory at a time).
    `provenance`: the OUT, run and config it is made under (contract.PROVENANCE, as a Parquet
    shard's footer). Returns its size in bytes. Not atomic: write under OUT/.staging/ and move."""
    metadata = {"format": FORMAT, "layer_ids": json.dumps(layer_ids), "final_norm": "pre", "dtype": dtype,
                "run_id": run_id, "crc32": json.dumps({n: crc for n, (_, _, crc, _) in layout.items()}),
                "input_ids_crc32": json.dumps({n: tokens for n, (*_, tokens) in layout.items()}),
                **provenance}
    header = encode_header({n: (shape, nbytes) for n, (shape, nbytes, *_) in layout.items()}, dtype, metadata)
    size = len(header)
    with fs.open_output_stream(path) as f:
        f.write(header)
        for (name, (_, nbytes, *_)), payload in zip(layout.items(), payloads):
            if len(payload) != nbytes:
                raise ValueError(f"{path}: {name} has {len(payload)} bytes, its header says {nbytes}")
            f.write(payload)
            size += nbytes
    return size


class ShardHeaderError(ValueError):
    """A hidden-states shard whose header cannot be read: damaged, or not ours."""


def read_header(fs: pafs.FileSystem, path: str) -> tuple[dict, dict[str, Entry]]:
    """(metadata, sample_id -> Entry) of one shard, reading its header only."""
    with fs.open_input_file(path) as f:
        size = f.size()
        head = f.read_at(8, 0)
        if len(head) < 8:
            raise ShardHeaderError(f"{path}: {size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ShardHeaderError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read_at(n, 8))
        except ValueError as e:
            raise ShardHeaderError(f"{path}: header is not JSON ({e})") from None
    metadata = header.pop("__metadata__", {})
    if metadata.get("format") != FORMAT:
        raise ShardHeaderError(f"{path}: not an eagle-data hidden-states shard")
    crcs = json.loads(metadata.get("crc32", "{}"))
    tokens = json.loads(metadata.get("input_ids_crc32", "{}"))
    base = 8 + n
    entries = {name: Entry(path, tuple(t["shape"]), base + t["data_offsets"][0], base + t["data_offsets"][1],
                           crcs.get(name), tokens.get(name))
               for name, t in header.items()}
    return metadata, entries


def stale(entry: Entry, input_ids_crc32: int | None) -> str:
    """Why an entry does not belong to its data/ row (whose input_ids have this crc32; None:
    no row), or "": computed from other tokens (the row was answered again), or written
    before shards recorded which tokens (then it cannot be told; it is redone)."""
    if entry.input_ids_crc32 is None:
        return "its shard records no digest of the tokens it was computed from (written by an older eagle-data)"
    if entry.input_ids_crc32 != input_ids_crc32:
        return "its hidden states were computed from other tokens than its data/ row's input_ids"
    return ""


def damaged(entry: Entry, data: bytes) -> str:
    """Why a tensor's bytes are not those written, or ""."""
    if entry.crc32 is None or zlib.crc32(data) != entry.crc32:
        return "its bytes do not match their crc32 (damaged)"
    return ""


def input_ids_digests(fs: pafs.FileSystem, files: list[str]) -> dict[str, int]:
    """sample_id -> tokens_crc32 of its input_ids, over these data/ shards (one batch in memory)."""
    digests = {}
    if not files:
        return digests
    for batch in pads.dataset(files, filesystem=fs, format="parquet").to_batches(columns=["sample_id", "input_ids"]):
        column = batch.column("input_ids")
        offsets, values = column.offsets.to_numpy(), column.values.to_numpy()
        for i, sample_id in enumerate(batch.column("sample_id").to_pylist()):
            digests[sample_id] = tokens_crc32(values[offsets[i]:offsets[i + 1]])
    return digests


def read_bytes(fs: pafs.FileSystem, entry: Entry) -> bytes:
    with fs.open_input_file(entry.shard) as f:
        return f.read_at(entry.end - entry.start, entry.start)


def read_sample(fs: pafs.FileSystem, entry: Entry, dtype: str):
    """One sample's hidden states as a torch tensor [tokens, layers, hidden_size]; a
    ValueError if its bytes do not match their crc32."""
    data = read_bytes(fs, entry)
    if damaged(entry, data):
        raise ValueError(f"{entry.shard}: {damaged(entry, data)}")
    return as_tensor(data, list(entry.shape), dtype)


def as_tensor(data: bytes, shape: list[int], dtype: str):
    """States' bytes (C order) as a CPU tensor of `shape` in `dtype`; a copy, writable
    (torch.frombuffer warns on read-only memory, as Ray's and pyarrow's buffers are)."""
    import torch

    kind = getattr(torch, dtype)
    return torch.frombuffer(bytearray(data), dtype=kind).view(*shape) if len(data) else torch.empty(shape, dtype=kind)


def shard_paths(fs: pafs.FileSystem, folder: str) -> list[str]:
    """The published hidden-states shards of OUT/hidden_states, sorted."""
    return sorted(info.path for info in list_folder(fs, folder)
                  if info.is_file and info.base_name.endswith(SUFFIX) and not info.base_name.startswith((".", "_")))


@dataclass
class Index:
    """Every published sample of OUT/hidden_states: sample_id -> Entry, and the shards'
    metadata (the same for every shard of one OUT; `metadata` is the first's)."""

    entries: dict[str, Entry]
    metadata: dict
    duplicates: list[str]  # sample ids found in more than one shard (verify reports them)

    @classmethod
    def read(cls, fs: pafs.FileSystem, folder: str) -> "Index":
        entries, metadata, duplicates = {}, {}, []
        for path in shard_paths(fs, folder):
            meta, found = read_header(fs, path)
            metadata = metadata or meta
            for sample_id, entry in found.items():
                if sample_id in entries:
                    duplicates.append(sample_id)
                entries[sample_id] = entry
        return cls(entries, metadata, duplicates)

    @property
    def layer_ids(self) -> list[int]:
        return json.loads(self.metadata.get("layer_ids", "[]"))

    @property
    def dtype(self) -> str:
        return self.metadata.get("dtype", "bfloat16")


def layer_bytes(tokens: int, layers: int, hidden_size: int, dtype: str) -> int:
    """The storage the phase needs: tokens x layers x H x bytes per value."""
    return tokens * layers * hidden_size * DTYPES[dtype][1]
