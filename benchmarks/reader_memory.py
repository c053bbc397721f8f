"""Does the training reader's memory stay flat while it iterates a large OUT (not grow with it)?

    .venv/bin/python benchmarks/reader_memory.py [--rows 200000] [--tokens 1000] [--dir PATH]

Writes ROWS synthetic data/ rows (lengths uniform in [TOKENS/2, 3*TOKENS/2], random ids)
as shards of --rows-per-shard rows plus a manifest, then, in a fresh process so that the
writer's memory does not count, iterates eagle_data.reader.OutIterableDataset (shuffled,
default window, finish_reason filter) and collates batches of 16 as a trainer would. RSS is sampled with psutil
during the pass; the peak is also checked against ru_maxrss. Text columns are short, so
the size on disk is mostly the token lists (what the reader reads).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_out(root: Path, rows: int, tokens: int, rows_per_shard: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.storage.contract import DATA_SCHEMA, MANIFEST_VERSION, SAMPLING_TYPE
    from eagle_data.storage.files import filesystem, write_json

    rng = np.random.default_rng(0)
    (root / "data").mkdir(parents=True, exist_ok=True)
    for start in range(0, rows, rows_per_shard):
        n = min(rows_per_shard, rows - start)
        length = rng.integers(tokens // 2, tokens * 3 // 2 + 1, n)
        prompt = rng.integers(20, 200, n).clip(max=length - 1)
        offsets = np.concatenate([[0], np.cumsum(length)]).astype(np.int32)
        ids = rng.integers(0, 150_000, offsets[-1], dtype=np.int32)
        # 1 from each row's first generated token on: position - row start >= prompt length.
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], length)
        mask = (within >= np.repeat(prompt, length)).astype(np.int8)
        gen = (length - prompt).astype(np.int32)
        ids_list = [f"{start + i:012d}" for i in range(n)]
        table = pa.table({
            "sample_id": ids_list, "conversation_id": ids_list, "turn": np.zeros(n, np.int32),
            "source": [f"src{i % 5}" for i in range(n)],
            "prompt_id": ids_list, "answer": np.zeros(n, np.int32), "variant": ["default"] * n,
            "sampling": pa.array([{"max_tokens": 8192, "temperature": 0.6, "top_p": 0.95, "top_k": 0,
                                   "min_p": 0.0, "seed": 0}] * n, SAMPLING_TYPE),
            "answered_by": ["target"] * n,
            "messages": [[{"role": "user", "content": f"question {s}"}] for s in ids_list],
            "reasoning": [""] * n,
            "response": [f"answer {s}" for s in ids_list],
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "num_prompt_tokens": prompt.astype(np.int32),
            "num_reasoning_tokens": np.zeros(n, np.int32),
            "num_response_tokens": gen,
            "finish_reason": ["stop"] * n,
        }).cast(DATA_SCHEMA)
        pq.write_table(table, root / "data" / f"part-{start // rows_per_shard:05d}.parquet")
    fs, path = filesystem(str(root))
    write_json(fs, f"{path}/manifest.json", {"schema_version": MANIFEST_VERSION, "phases": {"generate": {"tokenizer": {
        "path": "synthetic", "vocab_size": 150_000, "eos_ids": [2], "pad_id": 0,
        "reasoning_start_id": None, "reasoning_end_id": None}}}})


def read_pass(root: str) -> dict:
    import psutil
    import torch  # noqa: F401  (imported before the baseline, like a trainer would)

    from eagle_data.reader import OutReader, OutIterableDataset, collate

    proc = psutil.Process()
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    before = proc.memory_info().rss
    start = time.perf_counter()
    # A filter makes the index read the small columns of every row group (the costly path).
    ds = OutIterableDataset(root, seed=0, finish_reason=["stop"])
    index_s = time.perf_counter() - start
    after_index = proc.memory_info().rss
    pad_id = OutReader(root).pad_id
    n, tokens, peak, batch, samples_at = 0, 0, after_index, [], {}
    checkpoints = {len(ds) * k // 10 for k in (1, 5, 10)}
    start = time.perf_counter()
    for sample in ds:
        batch.append(sample)
        tokens += len(sample["input_ids"])
        if len(batch) == 16:
            collate(batch, pad_id)
            batch = []
        n += 1
        if n % 1000 == 0 or n in checkpoints:
            rss = proc.memory_info().rss
            peak = max(peak, rss)
            if n in checkpoints:
                samples_at[f"{n * 100 // len(ds)}%"] = mib(rss)
    iterate_s = time.perf_counter() - start
    return {
        "samples": n, "tokens": tokens, "index_s": round(index_s, 1),
        "iterate_s": round(iterate_s, 1), "samples_per_s": round(n / iterate_s),
        "rss_before_mib": mib(before), "rss_after_index_mib": mib(after_index),
        "rss_during_mib": samples_at, "rss_peak_sampled_mib": mib(peak),
        "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tokens", type=int, default=1000, help="mean tokens per row")
    parser.add_argument("--rows-per-shard", type=int, default=2000)
    parser.add_argument("--dir", help="where to write the OUT (kept); default: a temp dir")
    parser.add_argument("--read", help=argparse.SUPPRESS)  # the child: one read pass
    args = parser.parse_args()
    if args.read:
        print(json.dumps(read_pass(args.read)))
        return

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="reader-bench-"))
    try:
        out = root / "out"
        if not (out / "manifest.json").exists():
            start = time.perf_counter()
            write_out(out, args.rows, args.tokens, args.rows_per_shard)
            print(f"wrote {args.rows} rows in {time.perf_counter() - start:.0f}s", flush=True)
        shards = sorted((out / "data").glob("*.parquet"))
        disk = sum(p.stat().st_size for p in shards)
        child = subprocess.run([sys.executable, __file__, "--read", str(out)], check=True,
                               capture_output=True, text=True).stdout
        result = json.loads(child.strip().splitlines()[-1])
        result = {"rows": args.rows, "shards": len(shards), "data_on_disk_mib": round(disk / 2**20), **result}
        print(json.dumps(result))
        print("\n| rows | shards | on disk MiB | samples/s | RSS MiB before | after the index | while iterating: "
              + ", ".join(result["rss_during_mib"]) + " | peak |\n" + "|---" * 8 + "|")
        print(f"| {result['samples']:,} | {len(shards)} | {result['data_on_disk_mib']:,} | {result['samples_per_s']:,} | "
              f"{result['rss_before_mib']:.0f} | {result['rss_after_index_mib']:.0f} | "
              + ", ".join(f"{v:.0f}" for v in result["rss_during_mib"].values())
              + f" | {result['rss_peak_sampled_mib']:.0f} |")
    finally:
        if not args.dir:
            shutil.rmtree(root)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
