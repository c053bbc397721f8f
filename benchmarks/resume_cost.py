"""Resume cost: what a rerun reads to learn what is done, on an OUT of 1,000,000 data/ rows.

    .venv/bin/python benchmarks/resume_cost.py [--rows 1000000] [--tokens 200]
        [--rows-per-shard 10000] [--failed 10000] [--repeats 3] [--dir PATH] [--keep]

Writes OUT/data/ (DATA_SCHEMA, shards of --rows-per-shard rows, snappy Parquet as the sink
writes them) and OUT/failed/ (--failed rows, some for samples that also have an ok row).
Rows are deliberately small: ~--tokens input_ids (uniform in [tokens/2, 3*tokens/2],
random ids) and loss_mask, a one-turn message and a response of a few words; a real row
(prompt ~300 + completion ~1,300 tokens, and their text) is about 10x larger, so the
ratio below understates the saving. Sample ids are 20 hex characters, as the job makes.

Times `eagle_data.storage.status.SampleStatus.read(fs, out, max_attempts).finished()` (reads only the
sample_id column of data/ and failed/) against reading all of data/ with pyarrow
(`pyarrow.dataset(...).to_table()`), each --repeats times, alternating; the figure is the
median. "cold": every shard evicted from the page cache first (posix_fadvise DONTNEED on
each file, no root needed), as on a new machine; "warm": right after another read.
Deletes the OUT afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def write_out(root: Path, rows: int, tokens: int, rows_per_shard: int, failed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.storage.contract import FAILED_SCHEMA
    from eagle_data.storage.contract import DATA_SCHEMA, SAMPLING_TYPE

    SAMPLING = {"max_tokens": 8192, "temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "seed": 0}

    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "failed").mkdir(parents=True, exist_ok=True)
    all_ids = []
    for shard, start in enumerate(range(0, rows, rows_per_shard)):
        n = min(rows_per_shard, rows - start)
        length = rng.integers(tokens // 2, tokens * 3 // 2 + 1, n)
        prompt = rng.integers(20, tokens // 2, n).clip(max=length - 1)
        offsets = np.concatenate([[0], np.cumsum(length)]).astype(np.int32)
        ids = rng.integers(0, 150_000, offsets[-1], dtype=np.int32)
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], length)
        mask = (within >= np.repeat(prompt, length)).astype(np.int8)
        sample_ids = [f"{x:020x}" for x in rng.integers(0, 2**63, n)]
        all_ids.append(sample_ids)
        msg_off = pa.array(np.arange(n + 1, dtype=np.int32))
        messages = pa.ListArray.from_arrays(msg_off, pa.StructArray.from_arrays(
            [pa.array(["user"] * n), pa.array([f"question {s}: what is {i} + {i}?" for i, s in enumerate(sample_ids)])],
            names=["role", "content"]))
        table = pa.table({
            "sample_id": sample_ids, "conversation_id": sample_ids, "turn": np.zeros(n, np.int32),
            "source": [f"src{i % 5}" for i in range(n)],
            "prompt_id": sample_ids, "answer": np.zeros(n, np.int32), "variant": ["default"] * n,
            "sampling": pa.array([SAMPLING] * n, SAMPLING_TYPE),
            "answered_by": ["target"] * n,
            "messages": messages,
            "reasoning": [""] * n,
            "response": [f"the answer is {2 * i}" for i in range(n)],
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "num_prompt_tokens": prompt.astype(np.int32),
            "num_reasoning_tokens": np.zeros(n, np.int32),
            "num_response_tokens": (length - prompt).astype(np.int32),
            "finish_reason": ["stop"] * n,
        }).cast(DATA_SCHEMA)
        pq.write_table(table, root / "data" / f"part-bench-{shard:05d}.parquet")
    if failed:
        # Half of them for samples that later succeeded, half for samples never done.
        done = [s for ids in all_ids[:1] for s in ids][: failed // 2]
        fresh = [f"{x:020x}" for x in rng.integers(0, 2**63, failed - len(done))]
        ids = done + fresh
        table = pa.table({"sample_id": ids, "conversation_id": ids, "turn": [0] * len(ids), "source": ["src0"] * len(ids),
                          "error": ["RuntimeError: engine died"] * len(ids),
                          "run_id": ["bench"] * len(ids)}).cast(FAILED_SCHEMA)
        pq.write_table(table, root / "failed" / "part-bench-00000.parquet")


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=200, help="mean tokens per row")
    parser.add_argument("--rows-per-shard", type=int, default=10_000)
    parser.add_argument("--failed", type=int, default=10_000, help="rows in failed/")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="parent folder for the OUT (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the OUT")
    args = parser.parse_args()

    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    from eagle_data.storage.status import SampleStatus
    from eagle_data.storage.files import filesystem
    from eagle_data.storage.shards import shard_files

    parent = Path(tempfile.mkdtemp(prefix="resume-cost-", dir=args.dir))
    out = parent / "out"
    try:
        start = time.perf_counter()
        write_out(out, args.rows, args.tokens, args.rows_per_shard, args.failed)
        files = sorted(out.rglob("*.parquet"))
        data_files = sorted((out / "data").glob("*.parquet"))
        disk = sum(p.stat().st_size for p in data_files)
        sid_bytes = total_bytes = 0
        for p in data_files:
            meta = pq.read_metadata(p)
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                for c in range(rg.num_columns):
                    col = rg.column(c)
                    total_bytes += col.total_compressed_size
                    if col.path_in_schema == "sample_id":
                        sid_bytes += col.total_compressed_size
        print(f"wrote {args.rows:,} data rows ({len(data_files)} shards, {disk / 2**20:,.0f} MiB) + "
              f"{args.failed:,} failed rows in {time.perf_counter() - start:.0f} s; "
              f"sample_id column chunks: {sid_bytes / 2**20:.1f} MiB of {total_bytes / 2**20:,.0f} MiB "
              f"({100 * sid_bytes / total_bytes:.1f}%)", flush=True)

        fs, root = filesystem(str(out))

        def resume():
            progress = SampleStatus.read(fs, root, 3)
            return len(progress.finished())

        def full():
            return pads.dataset(shard_files(fs, f"{root}/data"), filesystem=fs,
                                format="parquet").to_table().num_rows

        timings = {(name, cache): [] for name in ("resume", "full") for cache in ("cold", "warm")}
        finished = rows_read = None
        for _ in range(args.repeats):
            for name, fn in (("resume", resume), ("full", full)):
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        evict(files)
                    t = time.perf_counter()
                    result = fn()
                    timings[(name, cache)].append(time.perf_counter() - t)
                    finished, rows_read = (result, rows_read) if name == "resume" else (finished, result)
        med = {k: statistics.median(v) for k, v in timings.items()}
        print(f"SampleStatus.read(...).finished(): {finished:,} samples finished; full read: {rows_read:,} rows")
        print(f"\n{'':8s} {'SampleStatus.read (sample_id)':>26s} {'full data/ read':>16s} {'ratio full/resume':>18s}")
        for cache in ("cold", "warm"):
            r, f = med[("resume", cache)], med[("full", cache)]
            print(f"{cache:8s} {r:25.2f}s {f:15.2f}s {f / r:17.1f}x")
        print(f"\nresume reads what it needs in {med[('resume', 'cold')]:.2f} s cold for "
              f"{args.rows:,} rows (target: a few seconds)")
        # The figures, machine-readable (tests/test_benchmarks.py checks them): medians in seconds.
        print("RESULT " + json.dumps({"rows": args.rows, "failed": args.failed, "finished": finished,
                                      "rows_read": rows_read,
                                      "seconds": {f"{name} {cache}": t for (name, cache), t in med.items()}}))
    finally:
        if args.keep:
            print(f"kept {out}")
        else:
            shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
