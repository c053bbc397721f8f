"""Is the driver's memory flat in rows? The job's prompts phase and generate phase at several
sizes, each size in a fresh process (its own local Ray, 2 CPUs): peak memory of the driver
(and of Ray's workers), time and CPU against the smallest size.

    .venv/bin/python benchmarks/driver_memory.py [--rows 1000 100000] [--phases prompts generate]
        [--sample N] [--mean-tokens 200] [--batch-size 16] [--smoke]

Rows: synthetic one-turn chat rows of real English text (8-60 words; benchmarks/_workload.py),
in jsonl files of at most 100,000 rows (one read task each). The prompts phase is the real
one (Qwen3's tokenizer and chat template, the duplicate check, prompts/ and skipped/ shards,
its report); the generate phase runs the simulated engine of benchmarks/engine_feeding.py in
the engine's place (mapped like Ray's vLLM stage, the project's 16 x 64 feeding, 256 slots,
a tiny decode time so that the run is fast), the real postprocess and shard writers (1,000
rows a shard). Completion lengths are the long-tailed distribution scaled to a mean of
--mean-tokens (cap 2,048): the driver never holds more than a shard's rows, so the lengths do
not change what grows with the row count. With --sample N, the largest size's prompts phase
runs once more with `source.sample: N` (the sample's threshold is what it holds then).

Per size and phase: the driver's peak RSS and, sampled every 0.1 s, its peak RssAnon (its own
heap: Python objects, Arrow buffers, Ray's core worker) and RssShmem (the object store's pages
it maps: bounded by the store, not by rows); the phase's wall time. Per size: the driver's peak
RSS over the run (VmHWM: the child is the driver; ru_maxrss would be the parent's at the fork),
the CPU seconds of the driver and of Ray's workers, and the workers' largest peak RSS and
RssAnon (`ray::` processes, VmHWM). Then each figure against the smallest size.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from _workload import own_ray, qwen3_dir, write_chat_rows  # noqa: E402

MAX_TOKENS = 2048
FILE_ROWS = 100_000


def status_kib(pid: int | str, fields: tuple[str, ...]) -> dict[str, int]:
    """Fields of /proc/PID/status, in KiB (VmHWM: peak RSS; RssAnon, RssShmem: its parts)."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in fields}


class Peaks:
    """Sampled in a thread: the driver's peak RSS, RssAnon and RssShmem per label (the part of
    the run), and every Ray worker's peak RSS, peak RssAnon and CPU seconds (a worker there
    before the sampling counts its CPU from then)."""

    def __init__(self, every_s: float = 0.1):
        self.label, self.every_s = "start", every_s
        self.driver: dict[str, dict[str, int]] = {}  # label -> {VmRSS, RssAnon, RssShmem: peak KiB}
        self.hwm: dict[int, int] = {}  # worker pid -> KiB
        self.anon: dict[int, int] = {}
        self.cpu: dict[int, list[float]] = {}  # worker pid -> [CPU s when first seen (0 if started since), last]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def sample(self, first: bool = False) -> None:
        import psutil

        peaks = self.driver.setdefault(self.label, {})
        for key, kib in status_kib("self", ("VmRSS", "RssAnon", "RssShmem")).items():
            peaks[key] = max(peaks.get(key, 0), kib)
        for proc in psutil.Process().children(recursive=True):
            try:
                name = proc.cmdline()[0]
                if not name.startswith("ray::") or name.endswith("Agent"):  # workers, not raylet, gcs, agents
                    continue
                status, times = status_kib(proc.pid, ("VmHWM", "RssAnon")), proc.cpu_times()
            except (psutil.Error, OSError, IndexError, KeyError):
                continue  # gone meanwhile
            self.hwm[proc.pid] = max(self.hwm.get(proc.pid, 0), status["VmHWM"])
            self.anon[proc.pid] = max(self.anon.get(proc.pid, 0), status["RssAnon"])
            used = times.user + times.system
            self.cpu.setdefault(proc.pid, [used if first else 0.0, used])[1] = used

    def phase(self, label: str, fn):
        self.sample()
        self.label = label
        try:
            return fn()
        finally:
            self.sample()


def child(dataset: str, n: int, phases: list[str], sample: int | None, mean_tokens: float, batch_size: int) -> None:
    import ray

    from eagle_data.config import load_config
    from eagle_data.job.phases.run import run
    from eagle_data.model_files import load_tokenizer, special_tokens
    from engine_feeding import sim_stage_factory

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    with tempfile.TemporaryDirectory() as tmp:
        tok = qwen3_dir(Path(tmp))
        cfg = load_config(None, [
            f"source.dataset={dataset}", f"model.path={tok}", f"output.path={Path(tmp) / 'out'}",
            "engine.backend=transformers", "engine.max_model_len=4096", f"sampling.max_tokens={MAX_TOKENS}",
            "output.log_every_s=3600", f"engine.batch_size={batch_size}"] + ([f"source.sample={sample}"] if sample else []))
        stage = sim_stage_factory(slots=256, token_s=2e-6, measure_s=1e9, events=str(Path(tmp) / "events.jsonl"),
                                  special=special_tokens(load_tokenizer(str(tok)), "<think>", "</think>"),
                                  mean_tokens=mean_tokens)
        own_ray(num_cpus=2)
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.WARNING)
        peaks, counts, walls = Peaks(), {}, {}
        peaks.sample(first=True)
        peaks.thread.start()
        cpu = time.process_time()
        for phase in phases:
            start = time.perf_counter()
            counts.update(peaks.phase(phase, lambda: run(cfg, phase=phase, engine=stage)))
            walls[phase] = round(time.perf_counter() - start, 1)
        cpu = time.process_time() - cpu
        peaks.stop.set()
        peaks.thread.join()
        ray.shutdown()
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    print(json.dumps({
        "rows": n, "sample": sample, "prompts": counts["prompts"]["prompts"],
        "ok": counts["generate"]["ok"] if "generate" in counts else None, "wall_s": walls,
        "driver_cpu_s": round(cpu, 1), "worker_cpu_s": round(sum(last - first for first, last in peaks.cpu.values()), 1),
        "driver_peak_rss_mib": mib(status_kib("self", ("VmHWM",))["VmHWM"]),
        "phases_mib": {label: {k: mib(v) for k, v in p.items()} for label, p in peaks.driver.items() if label in phases},
        "workers": len(peaks.hwm), "worker_peak_max_mib": mib(max(peaks.hwm.values(), default=0)),
        "worker_peak_anon_max_mib": mib(max(peaks.anon.values(), default=0))}))


def write_rows(folder: Path, n: int) -> Path:
    """n rows in jsonl files of at most FILE_ROWS rows (one read task each), the same rows for
    a file index whatever n."""
    folder.mkdir(parents=True)
    for k in range(0, n, FILE_ROWS):
        write_chat_rows(folder / f"rows-{k // FILE_ROWS:03d}.jsonl", min(FILE_ROWS, n - k), words=(8, 61),
                        seed=k // FILE_ROWS)
    return folder


def print_table(results: list[dict]) -> None:
    base = results[0]
    print("\n| rows | source.sample | prompts | answers | wall s by phase | CPU s driver + workers | driver peak RSS "
          "by phase, MiB (RssAnon / RssShmem) | driver peak RSS | worker peak RSS max (RssAnon max) | driver peak x |\n"
          + "|---" * 10 + "|")
    for r in results:
        by_phase = "; ".join(f"{label} {p['VmRSS']:.0f} ({p['RssAnon']:.0f} / {p['RssShmem']:.0f})"
                             for label, p in r["phases_mib"].items())
        print(f"| {r['rows']:,} | {r['sample'] or 'null'} | {r['prompts']:,} | "
              f"{'-' if r['ok'] is None else format(r['ok'], ',')} | "
              f"{'; '.join(f'{k} {v:.1f}' for k, v in r['wall_s'].items())} | "
              f"{r['driver_cpu_s']:.1f} + {r['worker_cpu_s']:.1f} | {by_phase} | {r['driver_peak_rss_mib']:.0f} | "
              f"{r['worker_peak_max_mib']:.0f} ({r['worker_peak_anon_max_mib']:.0f}) | "
              f"{r['driver_peak_rss_mib'] / base['driver_peak_rss_mib']:.2f} |")
    for r in [r for r in results if r["sample"] is None][1:]:
        print(f"\nrows x{r['rows'] / base['rows']:g}: driver peak RSS {base['driver_peak_rss_mib']:.0f} -> "
              f"{r['driver_peak_rss_mib']:.0f} MiB (x{r['driver_peak_rss_mib'] / base['driver_peak_rss_mib']:.2f}, "
              f"target <= 1.2), {(r['driver_peak_rss_mib'] - base['driver_peak_rss_mib']) * 2**20 / (r['rows'] - base['rows']):.1f}"
              f" bytes per added row; CPU {1e6 * (r['driver_cpu_s'] + r['worker_cpu_s'] - base['driver_cpu_s'] - base['worker_cpu_s']) / (r['rows'] - base['rows']):.0f}"
              " us per added row")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--phases", nargs="+", default=["prompts", "generate"], choices=["prompts", "generate"])
    parser.add_argument("--sample", type=int, help="source.sample of one more prompts-phase run at the largest size")
    parser.add_argument("--mean-tokens", type=float, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="engine.batch_size (rows per engine call)")
    parser.add_argument("--smoke", action="store_true", help="200 and 400 rows, sample 100 (the suite's size)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one size: its JSON arguments
    args = parser.parse_args()
    if args.child:
        return child(**json.loads(args.child))
    if args.smoke:
        args.rows, args.sample = [200, 400], 100
    runs = [(n, args.phases, None) for n in args.rows] + ([(max(args.rows), ["prompts"], args.sample)] if args.sample else [])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, phases, sample in runs:
            dataset = Path(tmp) / f"rows-{n}"
            if not dataset.exists():
                write_rows(dataset, n)
            spec = {"dataset": str(dataset), "n": n, "phases": phases, "sample": sample,
                    "mean_tokens": args.mean_tokens, "batch_size": args.batch_size}
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"the {n}-row run failed:\n{proc.stderr[-5000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    print_table(results)


if __name__ == "__main__":
    main()
