"""The feature stream's two sides (docs/streaming.md): how long a Ray Train worker waits for
data and how long the engine replica idles, with a trainer step slower and faster than the
engine; and the peak memory of the driver, the stream's coordinator, each training worker
and the object store at two sizes 10x apart.

    .venv/bin/python benchmarks/stream_balance.py [--rows 50 500] [--tokens 256] [--hidden 256]
        [--steps 0.5 2] [--workers 2] [--object-store-mib 0] [--prefetch 4] [--smoke]

The workload: synthetic data/ rows (benchmarks/reader_memory.py's writer: random token ids,
--tokens a row on average), a random-weight 8-layer Qwen3 of hidden size --hidden built from
a config, the transformers engine (one replica, batches of 4, float32 states at EAGLE-3's
layer ids), one epoch, `eagle_data.training.stream.features` into a TorchTrainer of --workers
workers that reserve no CPU (the machine's cores are the engine's; a training step is a
sleep of the step's cost per row, as a GPU step costs the host next to nothing).

1. Calibration: the stream of --rows[1] rows iterated by the driver at no cost: the engine's
   seconds per row, e (the median batch's, from the replica's own start and end time of
   every batch).
2. For each --steps factor k, at --rows[1] rows: a trainer step of k x e per row (each worker sleeps k x e x
   workers per row it gets, so the workers together take k x e a row). k < 1, the trainer is faster:
   the engine's idle share of its window (first batch start to last batch end; target
   <= 10%). k > 1, the engine is faster: the trainer's wait share (time blocked on the next
   batch over its time from the first batch on; the first batch waits for the model load;
   target <= 5%).
3. Memory: the largest k's run at --rows[1] and the same at --rows[0]: peak RSS of the driver, of the
   stream's split coordinator (the actor that runs the Ray Data execution), of each training
   worker, and the object store's peak use (Ray's memory summary, every 0.5 s). Bounded means
   flat: the 10x run's peaks near the small run's.

With --object-store-mib, every run sets Ray Data's resource_limits.object_store_memory
(default: none, Ray Data's own budget, a share of the object store). The workers fetch
--prefetch batches ahead (iter_batches' prefetch_batches; Ray's default is 1).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from _workload import start_ray  # noqa: E402  (puts the repo and tests/ on sys.path)
from reader_memory import write_out  # noqa: E402

VOCAB = 151_936  # reader_memory's token ids go up to 150,000


def build_model(dest: Path, hidden: int) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    from support import tiny_qwen3_config

    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config(VOCAB, 64, tie_word_embeddings=True, layers=8,
                                       heads=hidden // 64)).save_pretrained(dest)
    return dest


def timed_engine(spans: Path):
    """The transformers hidden-states stage, its replica writing each batch's (start, end)."""
    from eagle_data.job.stages.engines.transformers_backend import actor_pool
    from eagle_data.job.stages.engines.transformers_hidden_states import TransformersHiddenStates

    class TimedHiddenStates(TransformersHiddenStates):
        def apply(self, batch):
            start = time.time()
            out = super().apply(batch)
            with open(spans / f"engine-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps([start, time.time(), batch.num_rows]) + "\n")
            return out

    def stage(ds, cfg, layer_ids, dtype, scratch_dir):
        return actor_pool(ds, cfg, TimedHiddenStates, cfg.engine.batch_size, layer_ids=layer_ids, dtype=dtype)

    return stage


def engine_figures(spans: Path) -> dict:
    rows = [json.loads(line) for f in spans.glob("engine-*.jsonl") for line in f.read_text().splitlines()]
    start, end = min(r[0] for r in rows), max(r[1] for r in rows)
    busy = sum(r[1] - r[0] for r in rows)
    per_row = sorted((r[1] - r[0]) / r[2] for r in rows if r[2])
    return {"rows": sum(r[2] for r in rows), "busy_s": busy, "window_s": end - start,
            "idle_share": 1 - busy / (end - start), "median_s_per_row": per_row[len(per_row) // 2]}


def train_loop(config: dict) -> None:
    """A worker: a step of `step_s` per row (a sleep); what it waited for and its peak RSS,
    whole and split into its own memory (RssAnon) and the shared pages it maps (RssShmem:
    the object store's, while it reads its blocks)."""
    import ray.train

    def rss() -> dict:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return {k: int(status[k].split()[0]) << 10 for k in ("VmRSS", "RssAnon", "RssShmem")}

    shard = ray.train.get_dataset_shard("train")
    rows, waited, first, peak = 0, 0.0, None, {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    it = iter(shard.iter_batches(batch_size=4, batch_format="numpy", prefetch_batches=config["prefetch"]))
    while True:
        asked = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            break
        got = time.monotonic()
        if first is None:
            first = got
        else:
            waited += got - asked
        n = len(batch["sample_id"])
        rows += n
        time.sleep(config["step_s"] * n)
        peak = {k: max(v, peak[k]) for k, v in rss().items()}
    done = time.monotonic()
    rank = ray.train.get_context().get_world_rank()
    Path(config["save"], f"worker-{rank}.json").write_text(json.dumps(
        {"rows": rows, "waited_s": waited, "from_first_s": done - (first or done), "rss": peak["VmRSS"],
         "anon": peak["RssAnon"], "shmem": peak["RssShmem"]}))


class Peaks:
    """Every 0.5 s: this process's RSS, the split coordinator's, and the object store's use."""

    def __init__(self):
        self.driver = self.coordinator = self.store = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil
        import ray
        from ray._private.internal_api import memory_summary

        me = psutil.Process()
        # This script's own Ray instance: without an address Ray looks for one and fails when the
        # machine runs several (a test session's, another smoke's).
        gcs = ray.get_runtime_context().gcs_address
        while not self._stop.wait(0.5):
            self.driver = max(self.driver, me.memory_info().rss)
            for p in psutil.process_iter(["cmdline"]):
                if any("SplitCoordinator" in part for part in p.info["cmdline"] or []):
                    try:
                        self.coordinator = max(self.coordinator, p.memory_info().rss)
                    except psutil.Error:
                        pass
            used = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(gcs, stats_only=True))
            if used:
                self.store = max(self.store, int(used.group(1)) << 20)

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_stream(out: Path, cfg, work: Path, workers: int, step_s: float | None, store_bytes: int | None,
               prefetch: int = 1) -> dict:
    """One epoch of the stream: into a TorchTrainer (step_s per row), or, with step_s None,
    iterated by the driver at no cost."""
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from eagle_data.training.stream import features

    spans = Path(tempfile.mkdtemp(dir=work))
    if store_bytes:  # Ray Train's default DataConfig takes the execution limits from this driver's context
        options = ray.data.DataContext.get_current().execution_options
        options.resource_limits = options.resource_limits.copy(object_store_memory=store_bytes)
    ds = features(str(out), cfg, world_size=workers if step_s is not None else 1, shuffle=False,
                  engine=timed_engine(spans))
    started = time.monotonic()
    with Peaks() as peaks:
        if step_s is None:
            rows = sum(len(b["sample_id"]) for b in ds.iter_batches(batch_size=4, batch_format="numpy"))
            trainers = [{"rows": rows, "waited_s": 0.0, "from_first_s": 0.0, "rss": 0}]
        else:
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            TorchTrainer(train_loop, train_loop_config={"step_s": step_s, "save": str(spans), "prefetch": prefetch}, datasets={"train": ds},
                         scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"memory": 1}),
                         run_config=RunConfig(storage_path=str(work / "ray-train"), name=spans.name)).fit()
            trainers = [json.loads((spans / f"worker-{r}.json").read_text()) for r in range(workers)]
    return {"wall_s": time.monotonic() - started, "engine": engine_figures(spans), "trainers": trainers,
            "driver_rss": peaks.driver, "coordinator_rss": peaks.coordinator, "store": peaks.store}


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs=2, default=[50, 500])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--object-store-mib", type=int, default=0,
                        help="Ray Data's resource_limits.object_store_memory for the stream; 0 = Ray Data's default "
                             "budget. At 64 it bounded neither the store's peak nor kept the engine busy "
                             "(docs/performance.md, section 13)")
    parser.add_argument("--prefetch", type=int, default=4,
                        help="the workers' iter_batches(prefetch_batches=): batches fetched ahead of the step")
    parser.add_argument("--smoke", action="store_true", help="8 and 40 rows of 32 tokens, hidden 64")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.tokens, args.hidden = [8, 40], 32, 64

    from support import as_config

    where = start_ray(num_cpus=2)
    work = Path(tempfile.mkdtemp(prefix="stream-balance-"))
    model = build_model(work / "model", args.hidden)
    outs = {}
    for n in args.rows:
        outs[n] = work / f"out-{n}"
        write_out(outs[n], n, args.tokens, rows_per_shard=max(4, n // 10))
    cfg = as_config({"model": {"path": str(model)}, "output": {"path": str(outs[args.rows[0]])},
                     "engine": {"backend": "transformers", "batch_size": 4, "max_model_len": 4096},
                     "sampling": {"max_tokens": 16},
                     "hidden_states": {"dtype": "float32"}})
    print(f"Ray: {where}; {args.rows} rows of ~{args.tokens} tokens, 8 layers, H {args.hidden}, "
          f"{args.workers} training workers fetching {args.prefetch} batches ahead, Ray Data's object-store "
          f"limit {f'{args.object_store_mib} MiB' if args.object_store_mib else 'its default'}")

    small, large = args.rows
    store = args.object_store_mib << 20 or None
    # At the larger size: on the first run after Ray's start, a few dozen batches' median
    # was up to twice the engine's settled time (workers still starting beside it).
    calibration = run_stream(outs[large], cfg, work, args.workers, None, store)
    e = calibration["engine"]["median_s_per_row"]  # the median batch's: the first one also warms the model up
    print(f"\ncalibration ({large} rows, no trainer): engine busy {e * 1000:.1f} ms a row, "
          f"idle {calibration['engine']['idle_share']:.1%} of its {calibration['engine']['window_s']:.1f} s window")
    # A worker's step per row: k x e x workers, so the workers together take k x e a row.
    # The balance at the larger size, where the engine's window is long beside the training
    # workers' start (their imports share the cores with the engine's first batches).
    runs = {k: run_stream(outs[large], cfg, work, args.workers, k * e * args.workers, store, args.prefetch)
            for k in args.steps}
    runs_small = run_stream(outs[small], cfg, work, args.workers, max(args.steps) * e * args.workers, store,
                            args.prefetch)

    print("\n| trainer step (x engine) | rows | wall s | engine ms a row (median batch) | trainer waits (share of "
          "its time) | engine idles (share of its window) | target |")
    print("|---|---|---|---|---|---|---|")
    for k, r in runs.items():
        wait = max(t["waited_s"] / max(t["from_first_s"], 1e-9) for t in r["trainers"])
        target = "trainer waits <= 5%" if k > 1 else "engine idles <= 10%" if k < 1 else "-"
        print(f"| {k:g} ({'slower' if k > 1 else 'faster' if k < 1 else 'equal'}) | "
              f"{sum(t['rows'] for t in r['trainers'])} | {r['wall_s']:.1f} | "
              f"{r['engine']['median_s_per_row'] * 1000:.1f} | {wait:.1%} | "
              f"{r['engine']['idle_share']:.1%} | {target} |")

    print("\n| rows | driver peak RSS | split coordinator peak RSS | training worker peak RSS (max) | "
          "worker's own (RssAnon) | worker's shared (RssShmem) | object store peak |")
    print("|---|---|---|---|---|---|---|")
    for n, r in ((small, runs_small), (large, runs[max(args.steps)])):
        print(f"| {n} | {mib(r['driver_rss'])} | {mib(r['coordinator_rss'])} | "
              f"{mib(max(t['rss'] for t in r['trainers']))} | {mib(max(t['anon'] for t in r['trainers']))} | "
              f"{mib(max(t['shmem'] for t in r['trainers']))} | {mib(r['store'])} |")
    runs_large = runs[max(args.steps)]
    print(f"\n{large} vs {small} rows: driver x{runs_large['driver_rss'] / runs_small['driver_rss']:.2f}, "
          f"worker x{max(t['rss'] for t in runs_large['trainers']) / max(t['rss'] for t in runs_small['trainers']):.2f}")


if __name__ == "__main__":
    main()
