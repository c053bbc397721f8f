"""Driver peak RSS of a full run (prompts + generate) for 1k vs 100k rows (must not grow with rows).

    .venv/bin/python benchmarks/driver_memory.py [--rows 1000 100000] [--mean-tokens 200]
        [--batch-size 16] [--census]

Takes about 4 minutes on 2 cores (the 100k-row run is most of it).

Each size runs in its own process (a fresh local Ray instance, 2 CPUs), like
benchmarks/prompts_memory.py: synthetic one-turn chat rows (8-60 words), the prompts phase
with the real Qwen3 tokenizer, then the generate phase with the simulated engine of
benchmarks/engine_feeding.py in the engine's place (mapped like Ray's vLLM stage, the
project defaults batch_size 16 (--batch-size) x max_concurrent_batches 64, 256 slots, a tiny decode time
so the run is fast), the real postprocess and the real shard writers (project defaults:
1,000 rows per shard). Completion lengths are the long-tailed distribution scaled down to
mean --mean-tokens (cap 2,048) to keep the 100k-row run short; the driver never holds more
than a shard's worth of rows, so the lengths do not change what grows with the row count.

The figure is the child process's peak RSS (ru_maxrss), i.e. the driver's, not the Ray
workers'. A sampler thread (psutil, every 20 ms) also records the peak RSS within each part
of the run, to show where growth comes from: prompts phase, its report, the resume read at
the start and end of generate, the generate stream, and its report; on Linux also split into
RssAnon (the process's heaps: Python objects, Arrow buffers, Ray's C++ core worker),
RssShmem (pages of the Ray object store, /dev/shm, that the driver mapped and touched while
reading the stream's blocks) and RssFile (code and files).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402


from _workload import own_ray, qwen3_dir, write_chat_rows  # noqa: E402

MAX_TOKENS = 2048


class Sampler:
    """Peak RSS per labelled part of the run."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.label = "start"
        self.peaks: dict[str, int] = {}
        self.kind_peaks: dict[tuple, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.02):
            self.sample()

    def sample(self):
        rss = self.proc.memory_info().rss
        self.peaks[self.label] = max(self.peaks.get(self.label, 0), rss)
        for kind, size in self.kinds().items():
            key = (self.label, kind)
            self.kind_peaks[key] = max(self.kind_peaks.get(key, 0), size)

    @staticmethod
    def kinds() -> dict:
        """Linux: RSS split into anonymous (heaps), file-backed and shared memory (the Ray
        object store's /dev/shm pages this process mapped and touched)."""
        try:
            with open("/proc/self/status") as f:
                return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                        if k in ("RssAnon", "RssFile", "RssShmem")}
        except OSError:
            return {}

    def wrap(self, label, fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            previous = self.label
            self.sample()
            self.label = label
            try:
                return fn(*a, **k)
            finally:
                self.sample()
                self.label = previous
        return wrapped


def census(top: int = 12) -> dict:
    """Live Python objects by type (gc-tracked), the most numerous first."""
    import collections
    import gc

    import tracemalloc

    gc.collect()
    counts = collections.Counter(f"{getattr(type(o), '__module__', '')}.{type(o).__qualname__}"
                                 for o in gc.get_objects())
    result = {"gc-tracked objects (all types)": sum(counts.values()), **dict(counts.most_common(top))}
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        result["python heap MiB (tracemalloc)"] = round(sum(s.size for s in snapshot.statistics("filename")) / 2**20, 1)
        for stat in snapshot.statistics("lineno")[:top]:
            frame = stat.traceback[0]
            where = f"{frame.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{frame.lineno}"
            result[f"MiB allocated at {where}"] = round(stat.size / 2**20, 1)
    return result


def child(n: int, mean_tokens: float, take_census: bool = False, batch_size: int = 16) -> None:
    import dataclasses

    import ray

    import eagle_data.job.phases.generate as generate
    import eagle_data.job.phases.run as pipeline
    from eagle_data.config import load_config
    from eagle_data.model_files import load_tokenizer, special_tokens
    from engine_feeding import sim_stage_factory

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if take_census:
        import tracemalloc

        tracemalloc.start()
    sampler = Sampler()
    # Attribute the driver's memory to the parts of the run (same functions, wrapped).
    wrapped = tuple(dataclasses.replace(p, run=sampler.wrap(f"{p.name} phase", p.run)) for p in pipeline.PHASES)
    pipeline.PHASES, pipeline.PHASE_BY_NAME = wrapped, {p.name: p for p in wrapped}
    # job/phases/run.py writes the report after each phase; the first call is the prompts phase's.
    original_report = pipeline.write_report
    calls = []

    def write_report(*a, **k):
        calls.append(1)
        label = "prompts report" if len(calls) == 1 else "generate report"
        return sampler.wrap(label, original_report)(*a, **k)

    pipeline.write_report = write_report
    read = sampler.wrap("resume read (SampleStatus.read)", generate.SampleStatus.read.__func__)
    censuses = []

    def read_and_count(cls, *a, **k):
        if take_census:  # at the start of generate, and at the end of its stream
            censuses.append(census())
        return read(cls, *a, **k)

    generate.SampleStatus.read = classmethod(read_and_count)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_chat_rows(tmp / "rows.jsonl", n, words=(8, 61))
        tok = qwen3_dir(tmp)
        special = special_tokens(load_tokenizer(str(tok)), "<think>", "</think>")
        cfg = load_config(None, [
            f"source.dataset={tmp / 'rows.jsonl'}", f"model.path={tok}", f"output.path={tmp / 'out'}",
            "engine.backend=transformers", "engine.max_model_len=4096", f"sampling.max_tokens={MAX_TOKENS}",
            "output.log_every_s=3600", f"engine.batch_size={batch_size}"])
        stage = sim_stage_factory(slots=256, token_s=2e-6, measure_s=1e9, events=str(tmp / "events.jsonl"),
                                  special=special, mean_tokens=mean_tokens)
        own_ray(num_cpus=2)
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.WARNING)
        sampler.sample()
        sampler.label = "between phases"
        sampler.thread.start()
        start = time.perf_counter()
        result = pipeline.run(cfg, engine=stage)
        wall = time.perf_counter() - start
        sampler.stop.set()
        ray.shutdown()
    import pyarrow as pa

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    arrow_peak = pa.default_memory_pool().max_memory()
    print(json.dumps({"rows": n, "prompts": result["prompts"]["prompts"], "ok": result["generate"]["ok"],
                      "wall_s": round(wall, 1), "driver_peak_rss_mib": round(peak_mib, 1),
                      "batch_size": batch_size, "arrow_pool_peak_mib": round((arrow_peak or 0) / 2**20, 1),
                      "peaks_mib": {k: round(v / 2**20, 1) for k, v in sampler.peaks.items()},
                      "kind_peaks_mib": {f"{label} | {kind}": round(v / 2**20, 1)
                                         for (label, kind), v in sampler.kind_peaks.items()},
                      **({"census": censuses} if take_census else {})}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--mean-tokens", type=float, default=200)
    parser.add_argument("--census", action="store_true",
                        help="also count live Python objects by type, and the Python heap by "
                             "allocation site (tracemalloc: slow), at the start and the end of the "
                             "generate stream (where growth comes from)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="engine.batch_size (rows per engine call and per block downstream)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.mean_tokens, args.census, args.batch_size)
    results = []
    for n in args.rows:
        proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--mean-tokens", str(args.mean_tokens)]
                              + ["--batch-size", str(args.batch_size)]
                              + (["--census"] if args.census else []), capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"child {n} failed:\n{proc.stderr[-5000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("census", "kind_peaks_mib")}),
              flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"\nrows x{r['rows'] / base['rows']:.0f}: driver peak RSS {base['driver_peak_rss_mib']:.0f} -> "
              f"{r['driver_peak_rss_mib']:.0f} MiB (ratio {r['driver_peak_rss_mib'] / base['driver_peak_rss_mib']:.2f}, "
              f"target <= 1.2); {r['rows'] / r['wall_s']:.0f} rows/s; engine.batch_size {r['batch_size']}; "
              f"Arrow memory pool peak {base['arrow_pool_peak_mib']:.0f} -> {r['arrow_pool_peak_mib']:.0f} MiB")
        print(f"{'part of the run':32s} {base['rows']:>9,d} rows {r['rows']:>9,d} rows {'growth MiB':>11s}")
        for label in r["peaks_mib"]:
            a, b = base["peaks_mib"].get(label, float("nan")), r["peaks_mib"][label]
            print(f"{label:32s} {a:12.0f} MiB {b:12.0f} MiB {b - a:+11.0f}")
            for kind in ("RssAnon", "RssShmem", "RssFile"):
                key = f"{label} | {kind}"
                if key in r["kind_peaks_mib"]:
                    a, b = base["kind_peaks_mib"].get(key, float("nan")), r["kind_peaks_mib"][key]
                    print(f"  peak {kind:26s} {a:12.0f} MiB {b:12.0f} MiB {b - a:+11.0f}")
        if args.census:
            print("\nat the end of the generate stream: live Python objects by type (gc), Python heap "
                  "and its largest allocation sites (tracemalloc)")
            print(f"{'':90s} {base['rows']:>10,d} rows {r['rows']:>10,d} rows")
            a_end, b_end = base["census"][-1], r["census"][-1]
            for name in sorted(set(a_end) | set(b_end), key=lambda k: -b_end.get(k, 0)):
                print(f"{name[-90:]:90s} {a_end.get(name, 0):15,} {b_end.get(name, 0):15,}")


if __name__ == "__main__":
    main()
