"""Counting masked target tokens for `vocab`: eagle_data.tools.token_counts.count_tokens (reader
threads decoding one Parquet row group each, numpy boolean index on the flat values,
np.bincount) against a collections.Counter over the same rows (what the peers' scripts do:
Counter.update on the Python list of each row's masked ids).

    .venv/bin/python benchmarks/vocab_count.py [--rows 1000000] [--tokens 1000] [--dir PATH]
    .venv/bin/python benchmarks/vocab_count.py --smoke        # seconds; used by the tests

Writes ROWS synthetic data/ rows once, laid out as the job writes them (ROWS_PER_SHARD rows a
shard, one row group, page checksums; a short prompt, mask 0, then about TOKENS generated
ids, mask 1, Zipf-distributed over a Qwen3-sized vocabulary so the counts look like real
text), in parallel over the CPUs. Then runs each method in a fresh process (so the writer's
memory does not count), which reports its wall and CPU time and peak RSS and saves its
counts; the count arrays must be equal. Ours also runs over the first quarter of the
shards: its peak RSS should not grow with the rows (memory O(V + a few row groups)).
"decode only" reads the same two columns and does nothing else, on one thread: the CPU
floor that Parquet decoding sets under ours (the rest of ours is the counting).

--counter-rows N times the Counter on the first shards holding about N rows only (the
10^9-token size costs it minutes): its rate is measured there and the speed-up printed is
then marked "extrapolated"; without the option every method reads every row and the
speed-up is measured.

benchmarks/_workload.py writes chat rows for the prompts phase, not data/ shards, so this
script has its own writer (only the columns `vocab` reads, plus sample_id).
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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


ZIPF_TABLE_BITS = 22  # quantiles of the id distribution: 4 Mi entries, 16 MiB


@functools.cache  # once per writer process
def zipf_table() -> np.ndarray:
    """ids at 2^22 evenly spaced quantiles of Zipf(1.15) truncated to V ranks, ranks spread
    over the vocabulary (frequent ids are not 0, 1, 2...). Sampling is then a uniform draw
    and a gather, ~30x faster than rng.zipf, which made writing 10^9 tokens take minutes."""
    rng = np.random.default_rng(0)
    perm = rng.permutation(VOCAB)
    cdf = np.cumsum(np.arange(1, VOCAB + 1, dtype=np.float64) ** -1.15)
    quantiles = (np.arange(1 << ZIPF_TABLE_BITS) + 0.5) / (1 << ZIPF_TABLE_BITS) * cdf[-1]
    return perm[np.searchsorted(cdf, quantiles)].astype(np.int32)


def write_shard(root: Path, shard: int, start: int, n: int, tokens: int, prompt: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng([0, shard])  # the same rows whatever the process count
    n_prompt = rng.integers(prompt // 2, prompt * 3 // 2 + 1, n)
    n_gen = rng.integers(tokens // 2, tokens * 3 // 2 + 1, n)
    length = n_prompt + n_gen
    offsets = np.concatenate([[0], np.cumsum(length)]).astype(np.int32)
    table = zipf_table()
    ids = table[rng.integers(0, table.size, offsets[-1], dtype=np.int32)]
    within = np.arange(offsets[-1], dtype=np.int32) - np.repeat(offsets[:-1], length)
    mask = (within >= np.repeat(n_prompt, length)).astype(np.int8)
    rows = pa.table({
        "sample_id": [f"{start + i:012d}" for i in range(n)],
        "source": [f"src{i % 5}" for i in range(n)],
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
        "finish_reason": ["stop"] * n,
    })
    # As the job's storage/shards.publish_table: one row group a shard, page checksums.
    pq.write_table(rows, root / "data" / f"part-{shard:05d}.parquet", write_page_checksum=True)


def write_out(root: Path, rows: int, tokens: int, prompt: int, rows_per_shard: int) -> None:
    from concurrent.futures import ProcessPoolExecutor

    from eagle_data.storage.contract import MANIFEST_VERSION

    (root / "data").mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        jobs = [pool.submit(write_shard, root, i, start, min(rows_per_shard, rows - start),
                            tokens, prompt)
                for i, start in enumerate(range(0, rows, rows_per_shard))]
        for job in jobs:
            job.result()
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


def decode_only(out: str) -> None:
    """Parquet decoding of the two columns and nothing else, on one thread: what ours cannot
    go under in CPU time without another reader."""
    import pyarrow.parquet as pq

    for path in sorted((Path(out) / "data").glob("*.parquet")):
        f = pq.ParquetFile(path)
        for g in range(f.num_row_groups):
            f.read_row_group(g, columns=["input_ids", "loss_mask"], use_threads=False)


METHODS = {"ours": count_arrow, "counter": count_counter, "decode_only": decode_only}


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
    if counts is not None:
        np.save(save, counts)
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
            "tokens": None if counts is None else int(counts.sum()),
            "peak_rss_mib": peak, "rss_before_mib": before}


def run_child(method: str, out: Path, save: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", method, "--dir", str(out),
                           "--save", str(save)], check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def subset(out: Path, into: Path, shards: int) -> Path:
    """An OUT holding the first `shards` of out's shards (hard links: no copy)."""
    (into / "data").mkdir(parents=True)
    for p in sorted((out / "data").glob("*.parquet"))[:max(1, shards)]:
        (into / "data" / p.name).hardlink_to(p)
    (into / "manifest.json").hardlink_to(out / "manifest.json")
    return into


def rows_in(out: Path) -> tuple[int, int]:
    """(rows, shards) of an OUT, from the footers."""
    import pyarrow.parquet as pq

    shards = sorted((out / "data").glob("*.parquet"))
    return sum(pq.read_metadata(p).num_rows for p in shards), len(shards)


def npy(tmp: Path, label: str) -> Path:
    """Where the run labelled `label` saves its counts (labels hold '/' and spaces)."""
    return tmp / f"{''.join(c if c.isalnum() else '_' for c in label)}.npy"


def measure(out: Path, tmp: Path, counter_rows: int | None) -> dict[str, dict]:
    """Every method in a fresh process, ours also on the first quarter of the shards (memory
    against rows), and with counter_rows the Counter (and ours, for the equality check) on
    the first shards holding about that many rows."""
    rows, shards = rows_in(out)
    runs = {name: (name, out) for name in METHODS}
    runs["ours, N/4 rows"] = ("ours", subset(out, tmp / "quarter", shards // 4))
    if counter_rows:
        few = subset(out, tmp / "few", max(1, round(shards * min(1.0, counter_rows / rows))))
        runs["counter"] = ("counter", few)
        runs["ours, Counter's rows"] = ("ours", few)
    results = {}
    for label, (method, where) in runs.items():
        results[label] = run_child(method, where, npy(tmp, label))
        results[label]["rows"] = rows_in(where)[0]
    return results


def report(results: dict[str, dict], tmp: Path, disk: int, counter_rows: int | None) -> dict:
    ours, counter = results["ours"], results["counter"]
    same_label = "ours, Counter's rows" if counter_rows else "ours"
    same = results[same_label]
    equal = np.array_equal(np.load(npy(tmp, same_label)), np.load(npy(tmp, "counter")))
    results["decode_only"]["tokens"] = ours["tokens"]  # masked tokens of the same rows, for the rate
    print(f"\n{ours['rows']:,} rows, {ours['tokens']:,} masked tokens, {disk / 2**20:.0f} MiB on disk")
    print(f"{'method':<22}{'rows':>10}{'wall s':>9}{'cpu s':>9}{'Mtok/s':>8}{'cpu ns/tok':>11}"
          f"{'peak RSS MiB':>14}")
    for name, r in results.items():
        print(f"{name:<22}{r['rows']:>10,}{r['seconds']:>9.2f}{r['cpu_seconds']:>9.2f}"
              f"{r['tokens'] / max(r['seconds'], 1e-3) / 1e6:>8.1f}"
              f"{r['cpu_seconds'] / r['tokens'] * 1e9:>11.1f}{r['peak_rss_mib']:>14.0f}")
    wall = counter["seconds"] / max(same["seconds"], 1e-3)
    cpu = counter["cpu_seconds"] / max(same["cpu_seconds"], 1e-3)
    print(f"speedup over the Counter, measured on the same {same['rows']:,} rows: {wall:.1f}x wall, "
          f"{cpu:.1f}x CPU; counts equal: {equal}")
    summary = {"rows": ours["rows"], "tokens": ours["tokens"], "disk_mib": round(disk / 2**20),
               "methods": results, "speedup": round(wall, 1), "cpu_speedup": round(cpu, 1),
               "counts_equal": bool(equal)}
    if counter_rows:
        def rate(r, key):
            return r["tokens"] / max(r[key], 1e-3)
        summary["extrapolated_speedup"] = round(rate(ours, "seconds") / rate(counter, "seconds"), 1)
        summary["extrapolated_cpu_speedup"] = round(rate(ours, "cpu_seconds") / rate(counter, "cpu_seconds"), 1)
        print(f"EXTRAPOLATED to {ours['rows']:,} rows (the Counter's rate on its {counter['rows']:,} rows "
              f"against ours on all): {summary['extrapolated_speedup']}x wall, "
              f"{summary['extrapolated_cpu_speedup']}x CPU")
    print(f"decode only (one thread): {results['decode_only']['cpu_seconds'] / ours['cpu_seconds']:.0%} "
          f"of ours' CPU seconds; ours peak RSS {results['ours, N/4 rows']['peak_rss_mib']:.0f} MiB on "
          f"N/4 rows, {ours['peak_rss_mib']:.0f} MiB on N rows")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=1000, help="mean generated tokens per row")
    parser.add_argument("--prompt", type=int, default=40, help="mean prompt tokens per row")
    parser.add_argument("--rows-per-shard", type=int, default=1000, help="the job's default")
    parser.add_argument("--counter-rows", type=int,
                        help="time the Counter on about this many rows only (its rate; the "
                             "full-size speed-up is then extrapolated, and says so)")
    parser.add_argument("--dir", help="where to write the OUT (kept, reused); default: a temp dir")
    parser.add_argument("--smoke", action="store_true", help="2,000 rows of ~100 tokens")
    parser.add_argument("--child", choices=sorted(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.save)))
        return
    if args.smoke:
        args.rows, args.tokens, args.rows_per_shard = 2_000, 100, 400

    tmp = Path(tempfile.mkdtemp(prefix="vocab-bench-"))
    root = Path(args.dir) if args.dir else tmp
    try:
        out = root / "out"
        if not (out / "manifest.json").exists():
            start = time.perf_counter()
            write_out(out, args.rows, args.tokens, args.prompt, args.rows_per_shard)
            print(f"wrote {args.rows} rows in {time.perf_counter() - start:.0f}s", flush=True)
        else:
            print(f"reusing {out} ({rows_in(out)[0]} rows; --rows and the shape options are ignored)")
        disk = sum(p.stat().st_size for p in (out / "data").glob("*.parquet"))
        print(json.dumps(report(measure(out, tmp, args.counter_rows), tmp, disk, args.counter_rows)))
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
