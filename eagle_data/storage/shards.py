"""Parquet shards published atomically, as the job streams.

A shard is written under OUT/.staging/ and then moved into its folder under its final
name (storage/files.py write_atomically), so a reader or a resume never sees a
half-written file: a kill -9 leaves at most a file in .staging/, which nothing reads and
the next run deletes. Every shard's footer names where its rows came from (contract.PROVENANCE:
the OUT, the run, its phase's config fingerprint): `ShardWriter(metadata=...)` puts it there.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagle_data.errors import DamagedShard
from eagle_data.storage.contract import PROVENANCE, STAGING
from eagle_data.storage.files import list_folder, write_atomically

log = logging.getLogger("eagle_data")


def shard_files(fs: pafs.FileSystem, folder: str) -> list[str]:
    """The published shards of a folder (OUT/data, OUT/prompts, ...), sorted."""
    return sorted(
        info.path for info in list_folder(fs, folder)
        if info.is_file and info.base_name.endswith(".parquet")
        and not info.base_name.startswith((".", "_"))
    )


def footer_problem(fs: pafs.FileSystem, path: str) -> str | None:
    """Why a shard's Parquet footer does not read (empty, cut short, not Parquet), or None."""
    try:
        with fs.open_input_file(path) as f:
            pq.read_metadata(f)
    except (OSError, pa.ArrowException) as e:
        return f"{type(e).__name__}: {e}"
    return None


_named: set[str] = set()  # damaged shards already named by this process: once each


def readable_shards(fs: pafs.FileSystem, folder: str, skip: bool = False) -> list[str]:
    """shard_files whose footers read, for the tools (a job quarantines damaged shards at
    start, so it never meets one): a damaged shard is a DamagedShard error naming it, or
    with `skip`, a warning naming it and left out (what reports on an OUT goes on)."""
    files = []
    for path in shard_files(fs, folder):
        why = footer_problem(fs, path)
        if why is None:
            files.append(path)
        elif skip:
            if path in _named:
                continue
            _named.add(path)
            log.warning("%s cannot be read (%s): left out; rerun the job to quarantine it and make its "
                        "samples again", path, why)
        else:
            raise DamagedShard(path, why)
    return files


def read_provenance(fs: pafs.FileSystem, path: str) -> dict[str, str]:
    """The PROVENANCE keys of a shard's footer ({} for a shard without them); reads the footer only."""
    with fs.open_input_file(path) as f:
        found = pq.read_metadata(f).metadata or {}
    return {k.decode(): v.decode() for k, v in found.items() if k.decode() in PROVENANCE}


def read_checked(fs: pafs.FileSystem, path: str, group: int | None = None,
                 columns: list[str] | None = None) -> pa.Table:
    """A shard, or one row group of it, read with every page checked against the checksum
    publish_table wrote: a shard damaged since (bytes cut, or a flipped bit that still
    decodes to another value) is a DamagedShard naming it, never rows with other values."""
    try:
        with fs.open_input_file(path) as f:
            shard = pq.ParquetFile(f, page_checksum_verification=True)
            return shard.read(columns) if group is None else shard.read_row_group(group, columns)
    except (OSError, pa.ArrowException) as e:
        raise DamagedShard(path, f"{type(e).__name__}: {e}") from e


def publish_table(fs: pafs.FileSystem, out: str, folder: str, name: str, table: pa.Table) -> str:
    # Page checksums: `verify` and the start-of-run check catch bytes flipped inside a page,
    # which the footer alone does not show.
    return write_atomically(
        fs, f"{out}/{folder}/{name}",
        lambda tmp: pq.write_table(table, tmp, filesystem=fs, write_page_checksum=True),
        staging=f"{out}/{STAGING}")



class ShardWriter:
    """Buffers rows for one folder and publishes a shard every `rows_per_shard` rows, or
    when `flush_seconds` passed since the last one (bounding what a kill can lose)."""

    def __init__(self, fs, out: str, folder: str, schema: pa.Schema, run_id: str,
                 rows_per_shard: int, flush_seconds: float = float("inf"), metadata: dict[str, str] | None = None):
        self.fs, self.out, self.folder = fs, out, folder
        self.schema = schema.with_metadata(metadata or {})  # each shard's footer (provenance)
        self.run_id, self.rows_per_shard, self.flush_seconds = run_id, rows_per_shard, flush_seconds
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.written = 0
        self.shards = 0
        self.last_flush = time.monotonic()

    def add(self, table: pa.Table) -> None:
        if table.num_rows:
            self.buffer.append(table.select(self.schema.names).cast(self.schema))
            self.buffered += table.num_rows
        while self.buffered >= self.rows_per_shard:
            self._publish(self.rows_per_shard)
        if self.buffered and time.monotonic() - self.last_flush >= self.flush_seconds:
            self._publish(self.buffered)

    def close(self) -> None:
        if self.buffered:
            self._publish(self.buffered)

    def _publish(self, n: int) -> None:
        rows = pa.concat_tables(self.buffer)
        shard, rest = rows.slice(0, n), rows.slice(n)
        name = f"part-{self.run_id}-{self.shards:05d}.parquet"
        publish_table(self.fs, self.out, self.folder, name, shard)
        self.shards += 1
        self.written += n
        self.buffer = [rest] if rest.num_rows else []
        self.buffered = rest.num_rows
        self.last_flush = time.monotonic()
