"""The prompts phase at open-perfectblend's full size: time and peak memory against rows.

    .venv/bin/python benchmarks/prompts_memory.py [--rows 100000 400000 1400000] [--sample 100000]
    .venv/bin/python benchmarks/prompts_memory.py --smoke   # 100 and 200 rows, sample 50 (tests/test_benchmarks.py)

The real prompts phase (`run(cfg, phase="prompts")`: source read, seeded sample, prompts
stage with the real Qwen3 tokenizer and chat template, duplicate check, prompts/ and
skipped/ shards) on a local Ray with 2 CPUs, over synthetic rows shaped like
mlabonne/open-perfectblend (`conversations`: [{from, value}], `source`): a human turn of
real English text, long-tailed (lognormal words, median 120: ~160 Qwen3 tokens), a longer
gpt answer, some rows with a system turn or a second exchange, ~0.5% repeated prompts.
Rows are written once as Parquet shards (100k rows, row groups of 10k: one read task
each); a size reads the first shards of the same rows. Each size runs in its own process
with `source.sample: null`; the largest once more with `source.sample=--sample`.

Per run: wall time of the phase, CPU seconds of the driver and of the workers (the steadier
figure on a shared machine), the driver's peak RSS (VmHWM of the child, which is the
driver) and, sampled every 0.25 s, its peak RssAnon (its own heap) and RssShmem (object
store pages it maps: bounded by the store, not by rows), and the Ray workers' peak RSS
(VmHWM of every `ray::` worker: the largest one, and the sum over workers, an upper bound
of what they held at once; and the largest sampled RssAnon); then how each grows against
the smallest size, per added row.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import english_text, own_ray, qwen3_dir  # noqa: E402

SEED = 0
SOURCES = ["theblackcat102/evol-codealpaca-v1", "WizardLM/WizardLM_evol_instruct_V2_196k", "meta-math/MetaMathQA",
           "HuggingFaceH4/ultrachat_200k", "microsoft/orca-math-word-problems-200k", "openbmb/UltraInteract_sft"]
SYSTEM = "You are a helpful assistant. Answer the question carefully and explain your reasoning."


class Pool:
    """Real English text and where its words start: a row's turn is one slice of it."""

    def __init__(self):
        self.text = english_text()
        self.starts = np.array([m.start() for m in re.finditer(r"\S+", self.text)] + [len(self.text)])

    def slices(self, rng: np.random.Generator, words: np.ndarray) -> list[str]:
        words = np.minimum(words, self.starts.size - 2)
        first = rng.integers(0, self.starts.size - 1 - words)
        lo, hi = self.starts[first].tolist(), self.starts[first + words].tolist()
        text = self.text
        return [text[a:b].rstrip() for a, b in zip(lo, hi)]


def lognormal_words(rng: np.random.Generator, n: int, median: float, sigma: float, hi: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), 1, hi).astype(np.int64)


def shard_table(pool: Pool, shard: int, rows: int):
    """One shard's rows, the same for a shard index whatever the sizes asked for."""
    import pyarrow as pa

    rng = np.random.default_rng([SEED, shard])
    first = shard * rows
    user = pool.slices(rng, lognormal_words(rng, rows, 120, 1.0, 6000))
    user = [f"Question {first + i}: {t}" for i, t in enumerate(user)]
    repeated = np.flatnonzero(rng.random(rows) < 0.005)  # the same prompt as an earlier row of the shard
    for i in repeated[repeated > 0].tolist():
        user[i] = user[int(rng.integers(0, i))]
    answer = pool.slices(rng, lognormal_words(rng, rows, 180, 1.0, 8000))
    system = rng.random(rows) < 0.05
    second = rng.random(rows) < 0.08  # a second exchange (user, gpt)
    user2 = pool.slices(rng, lognormal_words(rng, int(second.sum()), 60, 1.0, 2000))
    answer2 = pool.slices(rng, lognormal_words(rng, int(second.sum()), 120, 1.0, 4000))
    roles, values, lengths, k = [], [], [], 0
    for i in range(rows):
        turns = [("system", SYSTEM)] if system[i] else []
        turns += [("human", user[i]), ("gpt", answer[i])]
        if second[i]:
            turns += [("human", user2[k]), ("gpt", answer2[k])]
            k += 1
        roles += [r for r, _ in turns]
        values += [v for _, v in turns]
        lengths.append(len(turns))
    turn = pa.StructArray.from_arrays([pa.array(roles, pa.string()), pa.array(values, pa.string())],
                                      names=["from", "value"])
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    conversations = pa.ListArray.from_arrays(offsets, turn)
    source = pa.array(np.array(SOURCES)[rng.integers(0, len(SOURCES), rows)].tolist(), pa.string())
    return pa.table({"conversations": conversations, "source": source})


def write_rows(folder: Path, n: int, shard_rows: int, row_group: int) -> Path:
    """A folder holding the first n rows: links to the shards (written once, in `folder`/shards)."""
    import pyarrow.parquet as pq

    shards, view = folder / "shards", folder / f"rows-{n}"
    shards.mkdir(parents=True, exist_ok=True)
    if view.exists():
        shutil.rmtree(view)
    view.mkdir()
    pool = None
    for shard in range((n + shard_rows - 1) // shard_rows):
        rows = min(shard_rows, n - shard * shard_rows)
        name = f"shard-{shard:05d}-{shard_rows}" + ("" if rows == shard_rows else f"-first-{rows}") + ".parquet"
        path = shards / name
        if not path.exists():
            pool = pool or Pool()
            table = shard_table(pool, shard, shard_rows).slice(0, rows)
            pq.write_table(table, path.with_suffix(".tmp"), row_group_size=row_group, compression="zstd")
            path.with_suffix(".tmp").rename(path)
        (view / name).symlink_to(path)
    return view


def status_kib(pid: int | str, fields: tuple[str, ...]) -> dict[str, int]:
    """Fields of /proc/PID/status, in KiB: VmHWM (peak RSS), RssAnon (the process's own heap,
    not the object store's shared pages it maps: RssShmem), ..."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in fields}


class Peaks:
    """Sampled in a thread: peak RSS (VmHWM) and peak RssAnon of every Ray worker under this
    process, and their CPU time (a worker there before the phase counts from then, one
    started during it from its start); and the driver's own peak RssAnon and RssShmem."""

    def __init__(self, every_s: float = 0.25):
        self.hwm: dict[int, int] = {}  # pid -> bytes
        self.anon: dict[int, int] = {}
        self.cpu: dict[int, list[float]] = {}  # pid -> [CPU s at the start, CPU s last seen]
        self.driver = {"RssAnon": 0, "RssShmem": 0}
        self.started = False  # workers first seen after the phase started count from 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(every_s,), daemon=True)

    def run(self, every_s: float) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.is_set():
            self.sample(me)
            self.stop.wait(every_s)

    def sample(self, me) -> None:
        import psutil

        for key, kib in status_kib("self", tuple(self.driver)).items():
            self.driver[key] = max(self.driver[key], kib * 1024)
        for proc in me.children(recursive=True):
            try:
                name = proc.cmdline()[0]
                if not name.startswith("ray::") or name.endswith("Agent"):  # workers, not raylet, gcs, agents
                    continue
                status = status_kib(proc.pid, ("VmHWM", "RssAnon"))
                times = proc.cpu_times()
            except (psutil.Error, OSError, IndexError, KeyError):
                continue  # gone meanwhile
            self.hwm[proc.pid] = max(self.hwm.get(proc.pid, 0), status["VmHWM"] * 1024)
            self.anon[proc.pid] = max(self.anon.get(proc.pid, 0), status["RssAnon"] * 1024)
            used = times.user + times.system
            self.cpu.setdefault(proc.pid, [0.0 if self.started else used, used])[1] = used

    @property
    def cpu_s(self) -> float:
        return sum(last - first for first, last in self.cpu.values())

    def __enter__(self):
        import psutil

        self.sample(psutil.Process())
        self.started = True
        self.thread.start()
        return self

    def __exit__(self, *exc):
        import psutil

        self.sample(psutil.Process())  # the workers still alive, once more at the end
        self.stop.set()
        self.thread.join()


def status_mib(field: str) -> float:
    """The driver's VmRSS (now) or VmHWM (peak). Not ru_maxrss: a child started by fork +
    exec starts from its parent's RSS at the fork (here: the rows just generated)."""
    return status_kib("self", (field,))[field] / 1024


def child(dataset: str, n: int, sample: int | None, tokenizer: str) -> None:
    import ray

    from eagle_data.config import load_config
    from eagle_data.job.phases.run import run

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"source.dataset={dataset}", f"model.path={tokenizer}", f"output.path={Path(tmp) / 'out'}",
                     "engine.max_model_len=4096", "sampling.max_tokens=1024", "output.rows_per_shard=5000"]
        if sample is not None:
            overrides.append(f"source.sample={sample}")
        cfg = load_config(None, overrides)
        own_ray(num_cpus=2)
        start_rss = status_mib("VmRSS")
        with Peaks() as peaks:
            start, cpu = time.perf_counter(), time.process_time()
            counts = run(cfg, phase="prompts")["prompts"]
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        ray.shutdown()
    peak_mib = status_mib("VmHWM")
    mib = lambda values: round(max(values, default=0) / 2**20, 1)  # noqa: E731
    print(json.dumps({"rows": n, "sample": sample, "selected": counts["selected"], "prompts": counts["prompts"],
                      "duplicates": counts["skipped_by_reason"].get("duplicate", 0),
                      "prompt_tokens": counts["prompt_tokens"], "wall_s": round(wall, 1),
                      "driver_cpu_s": round(cpu, 1), "worker_cpu_s": round(peaks.cpu_s, 1),
                      "driver_start_rss_mib": round(start_rss, 1), "driver_peak_rss_mib": round(peak_mib, 1),
                      "driver_peak_anon_mib": mib([peaks.driver["RssAnon"]]),
                      "driver_peak_shmem_mib": mib([peaks.driver["RssShmem"]]),
                      "workers": len(peaks.hwm), "worker_peak_max_mib": mib(peaks.hwm.values()),
                      "worker_peak_sum_mib": round(sum(peaks.hwm.values()) / 2**20, 1),
                      "worker_peak_anon_max_mib": mib(peaks.anon.values())}))


def print_table(results: list[dict]) -> None:
    base = results[0]
    print("\n| rows | source.sample | prompts | wall s | us/row | CPU s driver + workers | driver peak RSS MiB "
          "(RssAnon / RssShmem peaks) | worker peak RSS max / sum MiB (RssAnon max) | rows x | wall x | "
          "driver peak x | driver RssAnon x | worker max x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']:,} | {r['sample'] if r['sample'] is not None else 'null'} | {r['prompts']:,} | "
              f"{r['wall_s']:.1f} | {1e6 * r['wall_s'] / r['rows']:.0f} | "
              f"{r['driver_cpu_s']:.1f} + {r['worker_cpu_s']:.1f} | "
              f"{r['driver_peak_rss_mib']:.0f} ({r['driver_peak_anon_mib']:.0f} / {r['driver_peak_shmem_mib']:.0f}) | "
              f"{r['worker_peak_max_mib']:.0f} / {r['worker_peak_sum_mib']:.0f} ({r['worker_peak_anon_max_mib']:.0f}) | "
              f"{r['rows'] / base['rows']:.1f} | {r['wall_s'] / base['wall_s']:.2f} | "
              f"{r['driver_peak_rss_mib'] / base['driver_peak_rss_mib']:.2f} | "
              f"{r['driver_peak_anon_mib'] / base['driver_peak_anon_mib']:.2f} | "
              f"{r['worker_peak_max_mib'] / max(base['worker_peak_max_mib'], 1e-9):.2f} |")
    unsampled = [r for r in results if r["sample"] is None]
    for r in unsampled[1:]:
        per_row = lambda key: (r[key] - base[key]) * 2**20 / (r["rows"] - base["rows"])  # noqa: E731
        print(f"driver peak RSS growth {base['rows']:,} -> {r['rows']:,} rows: {per_row('driver_peak_rss_mib'):.1f} "
              f"bytes per added row (RssAnon {per_row('driver_peak_anon_mib'):.1f}); worker peak RSS "
              f"{per_row('worker_peak_max_mib'):.1f}; wall {1e6 * (r['wall_s'] - base['wall_s']) / (r['rows'] - base['rows']):.0f} "
              f"us and CPU {1e6 * (r['driver_cpu_s'] + r['worker_cpu_s'] - base['driver_cpu_s'] - base['worker_cpu_s']) / (r['rows'] - base['rows']):.0f} us per added row")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 400_000, 1_400_000])
    parser.add_argument("--sample", type=int, default=100_000, help="source.sample of the extra run at the largest size")
    parser.add_argument("--data", type=Path, help="folder for the synthetic rows (kept and reused); default: a "
                                                   "temporary folder, deleted at the end")
    parser.add_argument("--smoke", action="store_true", help="100 and 200 rows, sample 50 (the suite's size)")
    parser.add_argument("--child", nargs=4, metavar=("DATASET", "ROWS", "SAMPLE", "TOKENIZER"))
    args = parser.parse_args()
    if args.child:
        dataset, n, sample, tokenizer = args.child
        return child(dataset, int(n), None if sample == "null" else int(sample), tokenizer)
    if args.smoke:
        args.rows, args.sample = [100, 200], 50
    shard_rows, row_group = (100, 50) if args.smoke else (100_000, 10_000)
    tmp = Path(tempfile.mkdtemp(prefix="prompts-memory-"))
    data = args.data or tmp / "data"
    try:
        tokenizer = qwen3_dir(tmp)
        start = time.perf_counter()
        views = {n: write_rows(data, n, shard_rows, row_group) for n in sorted(set(args.rows))}
        size = sum(p.stat().st_size for p in (data / "shards").iterdir())
        print(f"rows written in {time.perf_counter() - start:.1f} s: {data / 'shards'} ({size / 2**20:.0f} MiB)",
              flush=True)
        runs = [(n, None) for n in args.rows] + [(max(args.rows), args.sample)]
        results = []
        for n, sample in runs:
            proc = subprocess.run([sys.executable, __file__, "--child", str(views[n]), str(n),
                                   "null" if sample is None else str(sample), str(tokenizer)],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"the {n}-row run failed:\n{proc.stderr[-4000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
        print_table(results)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
