"""Counting masked target tokens for `vocab`: eagle_data.tools.token_counts.count_tokens (Arrow flatten +
np.bincount, one row group at a time) against a collections.Counter over the same rows (what
the peers' scripts do: Counter.update on the Python list of each row's masked ids).

    .venv/bin/python benchmarks/vocab_count.py [--rows 1000000] [--tokens 1000] [--dir PATH]
    .venv/bin/python benchmarks/vocab_count.py --smoke        # seconds; used by the tests

Writes ROWS synthetic data/ rows once (a short prompt, mask 0, then about TOKENS generated
ids, mask 1, Zipf-distributed over a Qwen3-sized vocabulary so the counts look like real
text), then runs each method in a fresh process (so the writer's memory does not count),
which reports its wall time and peak RSS (ru_maxrss) and saves its counts; the two count
arrays must be equal. The Arrow method also runs over the first quarter of the shards:
its peak RSS should not grow with the rows (memory O(V + one row group)).

benchmarks/_workload.py writes chat rows for the prompts phase, not data/ shards, so this
script has its own writer (only the columns `vocab` reads, plus sample_id).
The last line printed is a JSON summary.
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
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
VOCAB = 151_936  # Qwen3's config.json vocab_size


def write_out(root: Path, rows: int, tokens: int, prompt: int, rows_per_shard: int,
              row_group_rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.storage.contract import MANIFEST_VERSION

    rng = np.random.default_rng(0)
    perm = rng.permutation(VOCAB)  # frequent ids spread over the vocabulary, not 0, 1, 2...
    (root / "data").mkdir(parents=True, exist_ok=True)
    for start in range(0, rows, rows_per_shard):
        n = min(rows_per_shard, rows - start)
        n_prompt = rng.integers(prompt // 2, prompt * 3 // 2 + 1, n)
        n_gen = rng.integers(tokens // 2, tokens * 3 // 2 + 1, n)
        length = n_prompt + n_gen
        offsets = np.concatenate([[0], np.cumsum(length)]).astype(np.int32)
        ids = perm[np.minimum(rng.zipf(1.15, offsets[-1]), VOCAB) - 1].astype(np.int32)
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], length)
        mask = (within >= np.repeat(n_prompt, length)).astype(np.int8)
        table = pa.table({
            "sample_id": [f"{start + i:012d}" for i in range(n)],
            "source": [f"src{i % 5}" for i in range(n)],
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "finish_reason": ["stop"] * n,
        })
        pq.write_table(table, root / "data" / f"part-{start // rows_per_shard:05d}.parquet",
                       row_group_size=row_group_rows)
    (root / "manifest.json").write_text(json.dumps(
        {"schema_version": MANIFEST_VERSION, "phases": {"generate": {"tokenizer": {"model_vocab_size": VOCAB}}}}))


def count_arrow(out: str) -> np.ndarray:
    from eagle_data.tools.token_counts import count_tokens

    return count_tokens(out, VOCAB).counts


def count_counter(out: str) -> np.ndarray:
    """The Counter baseline, streamed by row group too (its memory is O(V) as well; the
    difference is per-token Python work)."""
    import pyarrow.parquet as pq

    counter: Counter = Counter()
    for path in sorted((Path(out) / "data").glob("*.parquet")):
        f = pq.ParquetFile(path)
        for g in range(f.num_row_groups):
            t = f.read_row_group(g, columns=["input_ids", "loss_mask"])
            for ids, mask in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist()):
                counter.update([i for i, m in zip(ids, mask) if m == 1])
    counts = np.zeros(VOCAB, np.int64)
    for i, c in counter.items():
        counts[i] = c
    return counts


METHODS = {"arrow_numpy": count_arrow, "counter": count_counter}


def _proc_status(key: str) -> float | None:
    """A /proc/self/status memory line in MiB (Linux). VmHWM is this process image's peak
    RSS; ru_maxrss is not usable here: it keeps the parent's peak across fork + exec."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(method: str, out: str, save: str) -> dict:
    """One method in this (fresh) process: wall and CPU time, peak RSS, counts saved."""
    # Libraries loaded before the clock starts: the work is measured, not the imports nor
    # pyarrow.compute's one-time kernel registry setup (~0.4 s on the first call).
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet  # noqa: F401

    import eagle_data.tools.token_counts  # noqa: F401

    pc.list_flatten(pa.array([[1]]))
    before = _proc_status("VmRSS")
    cpu, start = _cpu_seconds(), time.perf_counter()
    counts = METHODS[method](out)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    peak = _proc_status("VmHWM") or round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    np.save(save, counts)
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "tokens": int(counts.sum()),
            "peak_rss_mib": peak, "rss_before_mib": before}


def run_child(method: str, out: Path, save: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", method, "--dir", str(out),
                           "--save", str(save)], check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def quarter(out: Path, into: Path) -> Path:
    """An OUT holding the first quarter of out's shards (hard links: no copy)."""
    (into / "data").mkdir(parents=True)
    shards = sorted((out / "data").glob("*.parquet"))
    for p in shards[:max(1, len(shards) // 4)]:
        (into / "data" / p.name).hardlink_to(p)
    (into / "manifest.json").hardlink_to(out / "manifest.json")
    return into


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=1000, help="mean generated tokens per row")
    parser.add_argument("--prompt", type=int, default=40, help="mean prompt tokens per row")
    parser.add_argument("--rows-per-shard", type=int, default=10_000)
    parser.add_argument("--row-group-rows", type=int, default=1_000)
    parser.add_argument("--dir", help="where to write the OUT (kept, reused); default: a temp dir")
    parser.add_argument("--smoke", action="store_true", help="2,000 rows of ~100 tokens")
    parser.add_argument("--child", choices=sorted(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.save)))
        return
    if args.smoke:
        args.rows, args.tokens, args.rows_per_shard, args.row_group_rows = 2_000, 100, 400, 100

    tmp = Path(tempfile.mkdtemp(prefix="vocab-bench-"))
    root = Path(args.dir) if args.dir else tmp
    try:
        out = root / "out"
        if not (out / "manifest.json").exists():
            start = time.perf_counter()
            write_out(out, args.rows, args.tokens, args.prompt, args.rows_per_shard,
                      args.row_group_rows)
            print(f"wrote {args.rows} rows in {time.perf_counter() - start:.0f}s", flush=True)
        disk = sum(p.stat().st_size for p in (out / "data").glob("*.parquet"))
        results = {m: run_child(m, out, tmp / f"{m}.npy") for m in METHODS}
        small = run_child("arrow_numpy", quarter(out, tmp / "quarter"), tmp / "quarter.npy")
        equal = all(np.array_equal(np.load(tmp / "arrow_numpy.npy"), np.load(tmp / f"{m}.npy"))
                    for m in METHODS)
        fast, slow = results["arrow_numpy"], results["counter"]
        speedup = slow["seconds"] / max(fast["seconds"], 1e-3)
        cpu_speedup = slow["cpu_seconds"] / max(fast["cpu_seconds"], 1e-3)
        tokens = fast["tokens"]
        print(f"\n{args.rows} rows, {tokens:,} masked tokens, {disk / 2**20:.0f} MiB on disk")
        print(f"{'method':<14}{'wall s':>8}{'cpu s':>8}{'Mtok/s':>8}{'peak RSS MiB':>14}"
              f"{'RSS before':>12}")
        for name, r in {**results, "arrow_numpy/4": small}.items():
            print(f"{name:<14}{r['seconds']:>8.2f}{r['cpu_seconds']:>8.2f}"
                  f"{r['tokens'] / max(r['seconds'], 1e-3) / 1e6:>8.1f}"
                  f"{r['peak_rss_mib']:>14.0f}{r['rss_before_mib'] or 0:>12.0f}")
        print(f"speedup {speedup:.1f}x wall, {cpu_speedup:.1f}x CPU; counts equal: {equal}; "
              f"arrow_numpy peak RSS {small['peak_rss_mib']:.0f} MiB on N/4 rows, "
              f"{fast['peak_rss_mib']:.0f} MiB on N rows")
        print(json.dumps({"rows": args.rows, "tokens": tokens, "disk_mib": round(disk / 2**20),
                          "methods": results, "quarter": small, "speedup": round(speedup, 1),
                          "cpu_speedup": round(cpu_speedup, 1), "counts_equal": equal}))
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
