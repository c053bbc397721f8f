"""storage/shards.py and storage/status.py on a local folder, without Ray."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagle_data.storage.contract import FAILED_SCHEMA, SHARD_NAME, STOPPED_SCHEMA
from eagle_data.storage.shards import ShardWriter, shard_files
from eagle_data.storage.status import SampleStatus

IDS = pa.schema([("sample_id", pa.string())])


def rows(*ids: str) -> pa.Table:
    return pa.table({"sample_id": list(ids)})


def test_a_writer_publishes_full_shards_then_the_rest_on_close(tmp_path):
    fs, out = pafs.LocalFileSystem(), str(tmp_path)
    writer = ShardWriter(fs, out, "data", IDS, "20261201T000000-abcdef", rows_per_shard=2)
    writer.add(rows("a", "b", "c"))
    assert [len(pq.read_table(f)) for f in shard_files(fs, f"{out}/data")] == [2]
    writer.add(rows())  # an empty batch publishes nothing
    writer.close()
    files = shard_files(fs, f"{out}/data")
    assert [len(pq.read_table(f)) for f in files] == [2, 1] and writer.written == 3
    assert all(SHARD_NAME.fullmatch(f.rsplit("/", 1)[1]) for f in files)


def test_a_writer_flushes_a_short_shard_after_flush_seconds(tmp_path):
    fs, out = pafs.LocalFileSystem(), str(tmp_path)
    writer = ShardWriter(fs, out, "data", IDS, "20261201T000000-abcdef", rows_per_shard=100, flush_seconds=0)
    writer.add(rows("a"))
    assert len(shard_files(fs, f"{out}/data")) == 1


def test_shard_files_skip_hidden_and_underscore_files(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("part-1.parquet", ".part-2.parquet.tmp", "_SUCCESS", "_x.parquet", ".y.parquet"):
        (tmp_path / "data" / name).write_bytes(b"")
    assert [f.rsplit("/", 1)[1] for f in shard_files(pafs.LocalFileSystem(), str(tmp_path / "data"))] == ["part-1.parquet"]


def test_sample_status_counts_attempts_and_gives_up_at_max_attempts(tmp_path):
    fs, out = pafs.LocalFileSystem(), str(tmp_path)
    ShardWriter(fs, out, "data", IDS, "20261201T000000-abcdef", 10).close()
    data = ShardWriter(fs, out, "data", IDS, "20261201T000000-abcdef", 10)
    data.add(rows("ok", "retried-then-ok"))
    data.close()
    failed = pa.table({"sample_id": ["retried-then-ok", "twice", "twice", "once"], "conversation_id": ["c"] * 4,
                       "turn": pa.array([0] * 4, pa.int32()), "source": ["s"] * 4, "error": ["e"] * 4,
                       "run_id": ["r"] * 4}).cast(FAILED_SCHEMA)
    writer = ShardWriter(fs, out, "failed", FAILED_SCHEMA, "20261201T000000-abcdef", 10)
    writer.add(failed)
    writer.close()
    stopped = ShardWriter(fs, out, "stopped", STOPPED_SCHEMA, "20261201T000000-abcdef", 10)
    stopped.add(pa.table({"sample_id": ["cut-1"], "conversation_id": ["cut"], "turn": pa.array([1], pa.int32()),
                          "source": ["s"], "reason": ["prompt_too_long"], "detail": [""], "run_id": ["r"]}))
    stopped.close()
    status = SampleStatus.read(fs, out, max_attempts=2)
    assert status.ok == {"ok", "retried-then-ok"}
    assert status.given_up == {"twice"} and status.retryable == {"once"}
    assert status.finished() == {"ok", "retried-then-ok", "twice", "cut-1"}
