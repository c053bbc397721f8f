"""The torch-free core of the reader: an OUT opened for reading, row filters, and the
filtered, ordered, rank-sharded index of its samples (numpy arrays out).

Memory: only a per-row index (row group id + row number, 8 bytes a row, after filters) is
built up front, from the small num_*_tokens / source / finish_reason columns. Token lists
are read one Parquet row group at a time, and at most `window` row groups are held, so an
OUT of any size iterates in bounded memory (about `window` x one row group).

Order and sharding: an epoch's order is a function of (index, seed, epoch) only, so every
rank computes the same one; rank r takes the r-th contiguous slice of it, and every slice
has the same size (`rank_slice`): a DDP loop with a collective per batch would otherwise
block forever on the ranks that still have a batch. As torch's DistributedSampler: by
default the order is padded by repeating it from its start to ceil(N / world) per rank
(every sample seen, the padding repeats the first ones; world > N still gives each rank
one); `drop_last=True` cuts its tail to floor(N / world) per rank (none seen twice; an
error when N < world, an epoch of nothing). N is the index's size, after every filter (lengths,
overflow, no loss token, missing hidden states): all are decided here, before the split,
never at read time, so no rank's count can change while it iterates.
Shuffling is two-level so that reads stay sequential: row groups are permuted, then rows
are permuted within each group of `window` consecutive row groups. All ranks must see the
same shard list: read an OUT whose generate phase finished (not one still being written).
An OUT whose data/ holds fewer rows than its generate phase recorded ok (a shard deleted or
moved out since) is refused, naming the counts and `verify`: reading on would train on
what is left without a word (`storage/damage.py` `missing_data_rows`). Every data/ page is
read against its Parquet page checksum, as `verify` reads it: a shard damaged since its run
(a flipped bit that still decodes to another token) is a DamagedShard naming it.

A validation split (`holdout=(side, fraction, seed)`, the draft trainer's): only the rows
on that side, "train" or "validation", of a seeded hash of each row's prompt_id
(storage/selection.py `held_out`), decided in the index like every other filter.

Hidden states (`hidden_states=True`, for an OUT whose hidden-states phase ran): each item
also has `hidden_states`, a torch tensor [tokens, n_layers, H] in the OUT's dtype (torch
is imported then: bfloat16 has no numpy dtype), layers in ascending vLLM layer-id order
(`hidden_layer_ids`; id k = the residual stream after k decoder layers, the last id L = the
final state BEFORE the final norm). Row t of it holds the states computed AT token
`input_ids[t]` (from tokens 0..t): a trainer predicting token t+1 from position t shifts
exactly as with labels (`hidden_states[:-1]` with `input_ids[1:]`, `loss_mask[1:]`); under
`overflow="truncate"` it is cut to the same `max_len` rows. The sample_id -> byte range
index is built once, at construction, from the shards' headers only; each item then reads
that one sample's byte range, never a whole shard, so memory stays one sample. Each
tensor read is checked as `verify` checks it: its bytes against their crc32 (the whole
tensor is read, also under truncate, then cut), and the tokens it was computed from against
the row's input_ids; a damaged one, one whose row was answered again with other tokens, or
one of a shard written before shards recorded its tokens is refused (EagleDataError naming
the sample; the next run of the hidden-states phase redoes it). A data/ row with no published hidden states (the
phase did not run for it, failed for it, or its filters left it out) is left out of the
index, and counted in `missing_hidden_states`.

Log-probabilities (`logprobs=True`, for an OUT generated with `sampling.logprobs` = k): each
item also has `top_logprob_ids` [tokens, k] int32, `top_logprobs` [tokens, k] float32 and
`token_logprobs` [tokens] float32, aligned with `input_ids` like the labels they soften:
row t is the target's distribution FOR token t (its top k ids by rank and their
log-probabilities, and `input_ids[t]`'s own log-probability), computed at position t - 1
from tokens 0..t-1. So row t is the soft label of the logits at position t - 1, exactly
as `input_ids[t]` is their hard label: a trainer predicting token t+1 at position t uses
`top_logprobs[1:]` next to `labels = input_ids[1:]` and `loss_mask[1:]`. Prompt rows
(t < num_prompt_tokens: the engine gave no distribution there) are padding: ids 0,
log-probabilities -inf, token_logprobs 0. data/ itself stores one entry per GENERATED token
(no padding); under `overflow="truncate"` the rows are cut with input_ids.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from eagle_data.errors import ConfigError, DamagedShard, EagleDataError, MissingInput
from eagle_data.storage.contract import HIDDEN_STATES, LOGPROB_COLUMNS
from eagle_data.storage.damage import missing_data_rows
from eagle_data.storage.folder import Output
from eagle_data.storage.hidden_states import DTYPES, Entry, Index, ShardHeaderError, damaged, read_header, stale, tokens_crc32
from eagle_data.storage.selection import SPLITS, held_out, row_filter
from eagle_data.storage.shards import read_checked, readable_shards

TOKEN_COLUMNS = ("input_ids", "loss_mask")
LENGTH_COLUMNS = ("num_prompt_tokens", "num_reasoning_tokens", "num_response_tokens")
FILTER_COLUMNS = ("finish_reason", "source", *LENGTH_COLUMNS)  # small: read for the index
CHECKED_PARQUET = pads.ParquetFileFormat(
    default_fragment_scan_options=pads.ParquetFragmentScanOptions(page_checksum_verification=True))


class OutReader:
    """A read-only view of an OUT (storage's `Output`, opened as `Output.existing`): its data/
    shards and what the manifest says of them; nothing but the shard list, their footers and
    the manifest is read here. Refused (MissingInput) when data/ holds fewer rows than the
    generate phase recorded ok."""

    def __init__(self, path: str, filesystem=None):
        out = Output.existing(path, filesystem)
        self.fs, self.root, self.manifest = out.fs, out.root, out.manifest
        self.files = readable_shards(self.fs, out.folder("data"))  # a damaged one: an error naming it
        missing = missing_data_rows(out, self.files)  # a shard gone: refused, not read short
        if missing:
            raise MissingInput(f"{missing}: reading on would serve only what is left. Run `python -m eagle_data "
                               f"verify {self.root}` to see which samples are missing; the job's generate phase "
                               "(the same command) answers them again")

    @property
    def tokenizer(self) -> dict:
        """The token ids the generate phase used; {} before it ran."""
        return self.manifest.tokenizer

    @property
    def pad_id(self) -> int:
        if "pad_id" not in self.tokenizer:
            raise EagleDataError(f"{self.root} has no generate phase yet, so no pad id is recorded: "
                                 "run the job's generate phase, or pass collate the tokenizer's pad id")
        return self.tokenizer["pad_id"]

    def dataset(self) -> pads.Dataset:
        return pads.dataset(self.files, format="parquet", filesystem=self.fs)

    def batches(self, columns: Sequence[str] | None = None, filter: pc.Expression | None = None,
                batch_size: int = 1024) -> Iterator[pa.RecordBatch]:
        """Stream record batches of the chosen columns, shard by shard; filter columns need not
        be among them. Each page is read against its checksum: a shard damaged since its run
        is a DamagedShard naming it, never rows with other tokens."""
        for file in self.files:
            try:
                yield from pads.dataset(file, format=CHECKED_PARQUET, filesystem=self.fs).to_batches(
                    columns=list(columns) if columns else None, filter=filter, batch_size=batch_size)
            except (OSError, pa.ArrowException) as e:
                raise DamagedShard(file, f"{type(e).__name__}: {e}") from e

    def row_group_sizes(self, file: str) -> list[int]:
        with self.fs.open_input_file(file) as f:
            meta = pq.ParquetFile(f).metadata
            return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    def read_row_group(self, file: str, group: int, columns: Sequence[str]) -> pa.Table:
        """One row group, each page read against its checksum (storage's read_checked)."""
        return read_checked(self.fs, file, group, list(columns))

    def hidden_states_index(self) -> Index:
        """hidden_states/'s shard headers (storage's Index), read once per reader: the Samples of
        each side of a split made from one reader share it."""
        if getattr(self, "_hidden_states_index", None) is None:
            self._hidden_states_index = Index.read(self.fs, f"{self.root}/{HIDDEN_STATES}")
        return self._hidden_states_index

    def __getstate__(self):
        # What a Samples pickled to a worker carries: not the headers, which its index already holds.
        return {k: v for k, v in self.__dict__.items() if k != "_hidden_states_index"}


def keeps_a_loss_token(max_len: int, train_on: str | None, expr: pc.Expression | None) -> pc.Expression:
    """Rows that still have a loss token when cut to max_len tokens: the first one is at
    num_prompt_tokens (+ num_reasoning_tokens under mask.train_on=response); a row with no
    loss token at all is dropped too. A prompt-only sample would train on nothing."""
    first = pc.field("num_prompt_tokens").cast(pa.int64())
    if train_on == "response":
        first = first + pc.field("num_reasoning_tokens")
    total = (pc.field("num_prompt_tokens").cast(pa.int64()) + pc.field("num_reasoning_tokens")
             + pc.field("num_response_tokens"))
    keep = (first < max_len) & (first < total)
    return keep if expr is None else expr & keep


class Samples:
    """The filtered row index, the epoch order, the rank's slice of it, and a small LRU
    cache of decoded row groups. `sample(pos)` gives numpy arrays; the torch datasets
    (reader/torch_datasets.py) wrap it. Iterate it for this rank's samples in order."""

    def __init__(self, out: str | OutReader, *, finish_reason=None, source=None, min_len=None,
                 max_len=None, overflow: str = "drop", columns: Sequence[str] = (),
                 rank: int = 0, world_size: int = 1, drop_last: bool = False, shuffle: bool = True, seed: int = 0,
                 window: int = 4, filesystem=None, hidden_states: bool = False, logprobs: bool = False,
                 holdout: tuple[str, float, int] | None = None):
        if overflow not in ("drop", "truncate"):
            raise ValueError("overflow must be 'drop' (filter out rows longer than max_len) "
                             "or 'truncate' (cut them to max_len)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        if holdout is not None and (holdout[0] not in SPLITS or not 0 <= holdout[1] <= 1):
            raise ValueError(f"holdout {holdout}: (one of {SPLITS}, a fraction in [0, 1], a seed)")
        self.holdout = holdout
        self.out = out if isinstance(out, OutReader) else OutReader(out, filesystem)
        self.columns = tuple(c for c in columns if c not in (*TOKEN_COLUMNS, "attention_mask"))
        self.max_len = max_len
        self.truncate = overflow == "truncate" and max_len is not None
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.shuffle, self.seed, self.window = shuffle, seed, max(1, window)
        expr = row_filter(finish_reason, source, min_len, None if self.truncate else max_len)
        self.dropped_no_loss = 0  # truncate: samples cut before their first loss token
        self.missing_hidden_states = 0  # hidden_states: rows left out for having none
        self.hidden_states = hidden_states
        if hidden_states:
            self._open_hidden_states()
        self.logprobs = self._logprobs_k() if logprobs else 0  # k
        if self.truncate:
            before = self._count(expr)
            expr = keeps_a_loss_token(max_len, self.out.manifest.config.get("mask", {}).get("train_on"), expr)
            self._build_index(expr)
            self.dropped_no_loss = before - self.row.size - self.missing_hidden_states
        else:
            self._build_index(expr)
        self._cache: OrderedDict = OrderedDict()
        self.set_epoch(0)

    def _open_hidden_states(self) -> None:
        """The shards' headers -> sample_id -> (shard, byte range), kept as arrays (cheap to
        pickle into DataLoader workers); every tensor must be [tokens, layers, H] alike."""
        folder = f"{self.out.root}/{HIDDEN_STATES}"
        try:
            index = self.out.hidden_states_index()
        except ShardHeaderError as e:
            raise EagleDataError(f"{folder}: {e}; run `python -m eagle_data verify {self.out.root}`") from None
        if not index.entries:
            raise MissingInput(f"{self.out.root} has no hidden states ({folder} holds no shard): run the "
                               "job's hidden-states phase (hidden_states.enabled), or read without hidden_states=True")
        self.hidden_dtype = index.dtype
        if self.hidden_dtype not in DTYPES:
            raise EagleDataError(f"{folder}: unknown hidden-states dtype {self.hidden_dtype!r}")
        self.hidden_layer_ids = index.layer_ids
        shapes = {e.shape[1:] for e in index.entries.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise EagleDataError(f"{folder}: tensors of different layer/hidden shapes {sorted(shapes)}")
        self.hidden_shape = next(iter(shapes))  # (layers, H)
        self._hs_shards = sorted({e.shard for e in index.entries.values()})
        self._hs_shard_number = {s: i for i, s in enumerate(self._hs_shards)}
        self._hs_ids = index.entries  # until _build_index has looked every row up; then dropped

    def _logprobs_k(self) -> int:
        """k of the OUT's log-probability columns; an error if it has none."""
        schema = self.out.dataset().schema if self.out.files else None
        if schema is None or "top_logprob_ids" not in schema.names:
            raise MissingInput(f"{self.out.root} has no log-probabilities in data/: generate with "
                               "--set sampling.logprobs=K (1..20), or read without logprobs=True")
        return schema.field("top_logprob_ids").type.value_type.list_size

    def _count(self, expr: pc.Expression | None) -> int:
        return sum(b.num_rows for b in self.out.batches(FILTER_COLUMNS, filter=expr))

    def _build_index(self, expr: pc.Expression | None) -> None:
        """Per row group: its (file, row group) and the kept row numbers in it. Reads only
        the row group sizes, or with a filter the small FILTER_COLUMNS, one row group at a
        time; never the token lists."""
        self.blocks: list[tuple[int, int]] = []  # (file number, row group number)
        rows, block_ids, spans = [], [], []
        read = (*FILTER_COLUMNS, *(["sample_id"] if self.hidden_states else []),
                *(["prompt_id"] if self.holdout else []))
        for f, path in enumerate(self.out.files):
            for g, n in enumerate(self.out.row_group_sizes(path)):
                keep = np.arange(n, dtype=np.int32)
                if expr is not None or self.hidden_states or self.holdout:
                    table = self.out.read_row_group(path, g, read)
                    table = table.append_column("__row", pa.array(keep))
                    if expr is not None:
                        table = table.filter(expr)
                    if self.holdout:
                        side, fraction, seed = self.holdout
                        validation = held_out(table.column("prompt_id").to_pylist(), fraction, seed)
                        table = table.filter(pa.array([v == (side == "validation") for v in validation], pa.bool_()))
                    keep = table.column("__row").to_numpy()
                    if self.hidden_states:
                        keep, span = self._hidden_spans(table, keep, path)
                        spans.append(span)
                if keep.size:
                    block_ids.append(np.full(keep.size, len(self.blocks), dtype=np.int32))
                    rows.append(keep)
                    self.blocks.append((f, g))
        self.row = np.concatenate(rows) if rows else np.empty(0, np.int32)
        self.block = np.concatenate(block_ids) if block_ids else np.empty(0, np.int32)
        if self.hidden_states:
            # Per index position: shard number, first byte, tokens, crc32 of its bytes and of the
            # input_ids it was computed from (-1: none recorded); rows are stored block by block.
            self._hs = np.concatenate(spans) if spans else np.empty((0, 5), np.int64)
            del self._hs_ids, self._hs_shard_number
        # Positions of each block's rows in the index (rows are stored block by block).
        self.block_start = np.searchsorted(self.block, np.arange(len(self.blocks) + 1))

    def _hidden_spans(self, table: pa.Table, keep: np.ndarray, path: str) -> tuple[np.ndarray, np.ndarray]:
        """The kept rows that have hidden states, and their (shard, start, tokens, crc32,
        input_ids crc32)."""
        ids = table.column("sample_id").to_pylist()
        lengths = sum(table.column(c).to_numpy().astype(np.int64) for c in LENGTH_COLUMNS)
        shard = self._hs_shard_number
        found, span = [], []
        for r, sample_id, n in zip(keep, ids, lengths):
            entry = self._hs_ids.get(sample_id)
            if entry is None:
                self.missing_hidden_states += 1
                continue
            if entry.tokens != n:
                raise EagleDataError(f"{entry.shard}: {sample_id} has hidden states for {entry.tokens} tokens, "
                                     f"its data/ row in {path} has {n}: the OUT is inconsistent; run verify")
            found.append(r)
            span.append((shard[entry.shard], entry.start, entry.tokens, -1 if entry.crc32 is None else entry.crc32,
                         -1 if entry.input_ids_crc32 is None else entry.input_ids_crc32))
        return np.asarray(found, np.int32), np.asarray(span, np.int64).reshape(-1, 5)

    def read_hidden_states(self, pos: int, input_ids: np.ndarray):
        """The hidden states of the sample at index position `pos` (a torch tensor), read
        from its shard's byte range and checked (module docstring) against its crc32 and the
        row's whole `input_ids`: its first max_len rows under truncate, all otherwise."""
        import torch

        shard, start, tokens, crc, tokens_crc = (int(v) for v in self._hs[pos])
        path = self._hs_shards[shard]
        layers, hidden = self.hidden_shape
        nbytes = tokens * layers * hidden * DTYPES[self.hidden_dtype][1]
        with self.out.fs.open_input_file(path) as f:
            data = bytearray(f.read_at(nbytes, start)) if nbytes else bytearray()
        if len(data) != nbytes:
            raise EagleDataError(f"{path}: short read at byte {start} ({len(data)} of {nbytes})")
        entry = Entry(path, (tokens, layers, hidden), start, start + nbytes, None if crc < 0 else crc,
                      None if tokens_crc < 0 else tokens_crc)
        why = stale(entry, tokens_crc32(input_ids)) or damaged(entry, data)
        if why:
            sample_id = next(s for s, e in read_header(self.out.fs, path)[1].items() if e.start == start)
            raise EagleDataError(f"{path}: sample_id {sample_id}: {why}: not served; run the job's hidden-states "
                                 "phase again to redo it (`python -m eagle_data verify` names every such sample)")
        if self.truncate:
            tokens = min(tokens, self.max_len)
        if not tokens:
            return torch.empty((0, layers, hidden), dtype=getattr(torch, self.hidden_dtype))
        return torch.frombuffer(data, dtype=getattr(torch, self.hidden_dtype)).reshape(-1, layers, hidden)[:tokens]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Every index position once; the same on every rank for a given (seed, epoch)."""
        n_blocks = len(self.blocks)
        if not self.shuffle:
            return np.arange(self.row.size, dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch])
        blocks = rng.permutation(n_blocks)
        parts = []
        for i in range(0, n_blocks, self.window):
            group = np.concatenate([np.arange(self.block_start[b], self.block_start[b + 1])
                                    for b in blocks[i:i + self.window]])
            parts.append(rng.permutation(group))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.order = rank_slice(self.epoch_order(epoch), self.rank, self.world_size, self.drop_last)

    def __len__(self) -> int:
        return len(self.order)

    def for_rank(self, rank: int, world_size: int) -> "Samples":
        """These samples as rank `rank` of `world_size` reads them, without reading OUT again
        (the same index, filters, split and order)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        other = copy.copy(self)
        other.rank, other.world_size, other._cache = rank, world_size, OrderedDict()
        other.set_epoch(self.epoch)
        return other

    def sample(self, pos: int) -> dict:
        """The sample at index position `pos` (not a rank-local number)."""
        lists, meta, logprobs = self._row_group(int(self.block[pos]))
        r = int(self.row[pos])
        item = {}
        for name, (offsets, values) in lists.items():
            a, b = offsets[r], offsets[r + 1]
            if self.truncate:
                b = min(b, a + self.max_len)
            item[name] = values[a:b].astype(np.int64)
        item["attention_mask"] = np.ones_like(item["input_ids"])
        if self.hidden_states:
            offsets, values = lists["input_ids"]
            item["hidden_states"] = self.read_hidden_states(pos, values[offsets[r]:offsets[r + 1]])
        if logprobs is not None:
            item.update(self._aligned_logprobs(logprobs, r, item["input_ids"].size))
        for name in self.columns:
            item[name] = meta.column(name)[r].as_py()
        return item

    def _aligned_logprobs(self, logprobs: dict, r: int, n: int) -> dict:
        """Row r's log-probabilities as arrays of its n (kept) input_ids' rows: the generated
        tokens' entries at their own positions, padding on the prompt (module docstring)."""
        k, prompt = self.logprobs, int(logprobs["num_prompt_tokens"][r])
        fills = {"top_logprob_ids": (0, np.int32, (n, k)), "top_logprobs": (-np.inf, np.float32, (n, k)),
                 "token_logprobs": (0, np.float32, (n,))}
        aligned = {}
        for name, (fill, dtype, shape) in fills.items():
            offsets, values = logprobs[name]
            width = k if len(shape) == 2 else 1
            kept = max(0, min(n - prompt, offsets[r + 1] - offsets[r]))
            out = np.full(shape, fill, dtype)
            start = offsets[r] * width
            out[prompt:prompt + kept] = values[start:start + kept * width].reshape(kept, *shape[1:])
            aligned[name] = out
        return aligned

    def _row_group(self, block: int):
        if block in self._cache:
            self._cache.move_to_end(block)
            return self._cache[block]
        f, g = self.blocks[block]
        extra = [c for c in (*LOGPROB_COLUMNS, "num_prompt_tokens") if c not in self.columns] if self.logprobs else []
        table = self.out.read_row_group(self.out.files[f], g, [*TOKEN_COLUMNS, *self.columns, *extra])
        # numpy views of the list columns: a sample is then a slice, not a Python list.
        lists = {name: _list_arrays(table.column(name)) for name in TOKEN_COLUMNS}
        logprobs = None
        if self.logprobs:
            logprobs = {name: _list_arrays(table.column(name)) for name in LOGPROB_COLUMNS}
            logprobs["num_prompt_tokens"] = table.column("num_prompt_tokens").to_numpy()
        entry = (lists, table.select(list(self.columns)), logprobs)
        self._cache[block] = entry
        while len(self._cache) > self.window:
            self._cache.popitem(last=False)
        return entry

    def __iter__(self) -> Iterator[dict]:
        for pos in self.order:
            yield self.sample(int(pos))

    def __getstate__(self):
        # DataLoader workers start with an empty cache, not a copy of the parent's.
        state = dict(self.__dict__)
        state["_cache"] = OrderedDict()
        return state


def rank_slice(order: np.ndarray, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """Rank `rank`'s contiguous slice of an epoch order, the same size on every rank
    (`padded_order`'s r-th of world_size equal parts)."""
    whole = padded_order(order, world_size, drop_last)
    per = whole.size // world_size
    return whole[rank * per:(rank + 1) * per]


def padded_order(order: np.ndarray, world_size: int, drop_last: bool) -> np.ndarray:
    """An epoch order made a multiple of world_size long: padded by repeating it from its
    start to ceil(N / world) per rank, or under drop_last cut to floor(N / world) per rank
    (module docstring)."""
    n = order.size
    per = n // world_size if drop_last else -(-n // world_size)
    if drop_last and n < world_size:
        raise ConfigError(f"drop_last=True with {n} samples (after filters) over world_size={world_size} "
                          "ranks gives every rank none: use drop_last=False (pads by repeating samples), "
                          "fewer ranks, or filters that keep more samples")
    # np.resize repeats the order from its start (as many times as world > N needs).
    return np.resize(order, per * world_size)


def _list_arrays(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat values) of a list column; a list of fixed-size lists (the log-probability
    columns, k values per token) gives its k values per entry in order."""
    arr = column.combine_chunks()
    values = arr.values
    if isinstance(values, pa.FixedSizeListArray):
        values = values.flatten()
    return arr.offsets.to_numpy(), values.to_numpy(zero_copy_only=False)
