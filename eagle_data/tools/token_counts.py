"""Counting how often each target token id is a training target (loss_mask == 1) in an
OUT's data/, streamed one Parquet row group at a time: memory O(V), not O(rows).
Used by the `vocab` tool (tools/vocab.py).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagle_data.errors import VocabError
from eagle_data.reader.samples import OutReader


@dataclass
class TokenCounts:
    """Masked-token counts over the kept rows of an OUT, and how the rows were kept."""

    counts: np.ndarray  # int64 [V]: counts[t] = times token t is a training target
    rows: int = 0  # rows read
    kept: int = 0  # rows counted (after the filters)
    removed: dict[str, int] = field(default_factory=dict)  # filter name -> rows it removed

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())


# ----------------------------------------------------------------------------- counting

def _keep_mask(table: pa.Table, filters: dict[str, Sequence[str]],
               removed: dict[str, int]) -> pa.ChunkedArray | None:
    """Rows passing every filter (column value in the list; null never passes, as with
    eagle_data.reader's row_filter `pc.field(c).isin(values)`); tallies what each filter removes on
    its own, so an empty result can say which filter emptied it."""
    keep = None
    for column, values in filters.items():
        ok = pc.fill_null(pc.is_in(table[column], value_set=pa.array(list(values), pa.string())),
                          False)
        removed[column] += pc.sum(pc.invert(ok).cast(pa.int64())).as_py() or 0
        keep = ok if keep is None else pc.and_(keep, ok)
    return keep


def _masked_ids(table: pa.Table, vocab_size: int, where: str) -> np.ndarray:
    """The token ids of a row group whose loss_mask is 1, as one flat intp array (what
    np.bincount takes without its own, slower, int32 -> intp cast), by a boolean index into
    zero-copy numpy views of the flat Arrow values (cheaper than Arrow's filter). Refuses
    rows whose two lists differ in length (every later token would be misaligned), null
    lists or ids (they have no place in the flat values), and ids outside [0, V) (V is then
    not this model's vocab size, or the shard not from this model)."""
    kept = [_batch_masked_ids(batch.column(0), batch.column(1), where)
            for batch in table.select(["input_ids", "loss_mask"]).to_batches()]
    ids = kept[0] if len(kept) == 1 else np.concatenate(kept or [np.zeros(0, np.int32)])
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise VocabError(f"{where}: token id {bad} is outside [0, {vocab_size}), the target's "
                             "vocabulary recorded in the manifest: this OUT's tokens are not that model's")
    return ids.astype(np.intp)


def _batch_masked_ids(ids: pa.ListArray, mask: pa.ListArray, where: str) -> np.ndarray:
    if ids.null_count or mask.null_count:
        raise VocabError(f"{where}: a row has a null input_ids or loss_mask; the shard is not "
                         "eagle-data output (or is corrupt)")
    if not np.array_equal(pc.list_value_length(ids).to_numpy(), pc.list_value_length(mask).to_numpy()):
        raise VocabError(f"{where}: a row's input_ids and loss_mask differ in length; the "
                         "shard is not eagle-data output (or is corrupt)")
    flat_ids, flat_mask = pc.list_flatten(ids), pc.list_flatten(mask)
    if flat_ids.null_count:
        raise VocabError(f"{where}: a row has a null token id; the shard is not eagle-data "
                         "output (or is corrupt)")
    if flat_mask.null_count:  # a null mask entry is not a 1, as in Arrow's filter(equal(m, 1))
        flat_mask = pc.fill_null(flat_mask, 0)
    return flat_ids.to_numpy()[flat_mask.to_numpy() == 1]


@dataclass
class _Group:
    """What one row group contributes: its row tallies and its masked ids."""

    rows: int
    kept: int
    removed: dict[str, int]
    ids: np.ndarray


def _read_group(fs: pafs.FileSystem, path: str, group: int, metadata: pq.FileMetaData,
                columns: list[str], filters: dict, vocab_size: int) -> _Group:
    """One row group, read, filtered and reduced to its masked ids (runs in a thread; the
    footer parsed once per file is passed in, not parsed again per row group)."""
    with fs.open_input_file(path) as f:
        table = pq.ParquetFile(f, metadata=metadata).read_row_group(group, columns=columns,
                                                                    use_threads=False)
    removed = {c: 0 for c in filters}
    keep = _keep_mask(table, filters, removed)
    rows = table.num_rows
    if keep is not None:
        table = table.filter(keep)
    return _Group(rows, table.num_rows, removed,
                  _masked_ids(table, vocab_size, f"{path} row group {group}"))


def _row_groups(fs: pafs.FileSystem, files: list[str]) -> Iterator[tuple[str, int, pq.FileMetaData]]:
    for path in files:
        with fs.open_input_file(path) as f:
            metadata = pq.read_metadata(f)
        yield from ((path, g, metadata) for g in range(metadata.num_row_groups))


class _Tally:
    """counts += bincount(ids). A bincount costs O(V) on top of its ids, so row groups with
    fewer than V masked ids (the job's shards can be a few rows) are pooled up to FLUSH
    first; larger ones are counted as they come (no copy into a pool). Memory O(V + FLUSH).
    np.bincount holds the GIL: it runs here, in the folding thread, while the readers decode."""

    FLUSH = 1 << 20

    def __init__(self, counts: np.ndarray):
        self.counts, self.pending, self.n = counts, [], 0

    def add(self, ids: np.ndarray) -> None:
        if ids.size >= self.counts.size:
            self._count(ids)
            return
        self.pending.append(ids)
        self.n += ids.size
        if self.n >= self.FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.n:
            self._count(self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending))
        self.pending, self.n = [], 0

    def _count(self, ids: np.ndarray) -> None:
        self.counts += np.bincount(ids, minlength=self.counts.size)


def count_tokens(out: str, vocab_size: int, finish_reason: Sequence[str] | None = None,
                 source: Sequence[str] | None = None, threads: int | None = None) -> TokenCounts:
    """How often each target token id is a training target (loss_mask == 1) in OUT/data,
    over the rows passing the filters. Row groups are read whole, only the needed columns,
    by `threads` readers (default: the CPUs, at most 8) with at most threads + 1 groups in
    flight, and folded in file order: memory is O(V + a few row groups), never O(rows).
    Parquet decoding is most of the cost and parallelises; the bincount stays serial."""
    opened = OutReader(out)
    fs, files = opened.fs, opened.files
    if not files:
        raise VocabError(f"{out}/data has no shards: run the generate phase first")
    filters = {c: v for c, v in {"finish_reason": finish_reason, "source": source}.items()
               if v is not None}
    columns = ["input_ids", "loss_mask", *filters]
    result = TokenCounts(np.zeros(vocab_size, np.int64), removed={c: 0 for c in filters})
    tally = _Tally(result.counts)
    threads = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        groups = _row_groups(fs, files)
        try:
            for path, group, metadata in groups:
                pending.append(pool.submit(_read_group, fs, path, group, metadata, columns,
                                           filters, vocab_size))
                while len(pending) > threads or (pending and pending[0].done()):
                    _fold(result, tally, pending.popleft().result())
            while pending:
                _fold(result, tally, pending.popleft().result())
        finally:
            for future in pending:
                future.cancel()
    tally.flush()
    _check_counted(out, result, filters)
    return result


def _fold(result: TokenCounts, tally: _Tally, group: _Group) -> None:
    result.rows += group.rows
    result.kept += group.kept
    for c, n in group.removed.items():
        result.removed[c] += n
    tally.add(group.ids)


def _check_counted(out: str, counted: TokenCounts, filters: dict) -> None:
    if counted.rows == 0:
        raise VocabError(f"{out}/data has no rows: run the generate phase first")
    if counted.kept == 0:
        why = "; ".join(f"--{c.replace('_', '-')} {' '.join(filters[c])} removed {n} of "
                        f"{counted.rows} rows" for c, n in counted.removed.items())
        raise VocabError(f"no rows left to count in {out}: {why}")
    if counted.tokens == 0:
        raise VocabError(f"the {counted.kept} rows counted in {out} have no token with "
                         "loss_mask 1: nothing to choose a draft vocabulary from")
