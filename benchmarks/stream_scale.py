"""The feature stream at Kimi-K2.5's row size (docs/streaming.md, "The bound"): with a
stand-in engine that hands back rows of the production shape, does the stream's bound hold
the object store flat at two sizes 10x apart, with nothing spilled, and keep both sides
busy: the engine when the trainer is faster, the trainer when the engine is faster?

    .venv/bin/python benchmarks/stream_scale.py [--rows 40 400] [--tokens 400] [--engine-s 0.25]
        [--steps 0.5 2] [--workers 2] [--batch 2] [--store-gib 2] [--max-bytes 0] [--smoke]

The workload: synthetic data/ rows (benchmarks/reader_memory.py's writer: random token ids,
uniform lengths from --tokens / 2 to 1.5 x --tokens), and a target that is a config only:
Kimi-K2.5's 61 layers and hidden size 7,168, so the stream's layer ids are [2, 30, 58, 61]:
4 layers x 7,168 x bfloat16 = 56 KiB a token, as in production. Production's rows are ~1.6k
tokens, ~90 MB; the default --tokens 400 scales them down to ~22 MB (11-34 MB), which keeps a
row in the tens of MB and 400 rows' 9 GB streamed within a few minutes of a 2-core machine
(--tokens 1600 is production's size). The stand-in engine (one replica, batches of 2 rows)
answers each row with its states (bfloat16 1.0, which pass the stream's checks) after
--engine-s seconds a row (a GPU's time costs the host next to nothing: it sleeps what
making the bytes did not take); its actor records the start and end of each batch. The
stream (`eagle_data.training.stream.features`, its checks, its gate: `stream.max_bytes_in_flight`,
default a quarter of the object store, here --store-gib) runs one epoch into a TorchTrainer
of --workers workers that reserve no CPU and take --batch rows a step with `stream_batches`
(prefetch: what fits half the bound); a step is a sleep of k x e x workers a row for each
worker, so that the workers together take k x e a row (e = --engine-s).

1. For each --steps factor k, at --rows[1] rows: k < 1, the trainer is faster: the engine's
   idle share of its window (first batch start to last batch end; target <= 10%). k > 1,
   the engine is faster: the trainer's wait share (the most any worker was blocked on its
   next batch, of its time from its first batch on; target <= 5%). Beside each, the
   stream's own figures (its report): the engines' busy share and the trainers' wait share.
2. Memory: the largest k's run at --rows[1] and the same at --rows[0] (the baseline, in the
   same run): the object store's peak use and what was spilled to disk (Ray's memory
   summary every 0.5 s; spilled: the run's own, the instance's count before and after), the
   stream's own peak of bytes (and rows) in flight against its bound (its limit, or what the
   trainers' windows and the split hold where that is more: the gate's floor), the chunks
   its gate held back a full second for want of room (its `held`), the peak RSS of the
   driver, of the stream's split coordinator and of each training worker (whole, own
   (RssAnon), own with no batch in hand (between steps: what it keeps), and the object-store pages it maps
   (RssShmem: the store's memory, not the worker's)). Flat means the 10x run's peaks near the
   baseline's: printed as ratios.
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

from _cpu import Every  # noqa: E402
from _workload import start_ray  # noqa: E402  (puts the repo on sys.path)
from reader_memory import write_out  # noqa: E402

KIMI = {"num_hidden_layers": 61, "hidden_size": 7168}  # Kimi-K2.5's text model: layer ids [2, 30, 58, 61]
BF16_ONE = 0x3F80  # bfloat16 1.0: finite, no layer all zeros


def stand_in_engine(spans: Path, engine_s: float):
    """The hidden-states engine stage's stand-in: each row's states, [S, layers, H] bfloat16,
    handed back after engine_s seconds a row; each batch's (start, end, rows) written by its actor."""
    import numpy as np
    import pyarrow as pa
    import ray

    from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
    from eagle_data.job.stages.engines.state_files import with_state_columns

    class StandInEngine:
        def __init__(self, layers: int, hidden: int):
            self.layers, self.hidden = layers, hidden

        def __call__(self, batch: pa.Table) -> pa.Table:
            start = time.time()
            rows = batch.to_pylist()
            for row in rows:
                n = len(row["input_ids"])
                row.update({ENGINE_ERROR_COLUMN: "", "hidden_token_ids": row["input_ids"],
                            "hidden_states_shape": [n, self.layers, self.hidden],
                            "hidden_states": np.full(n * self.layers * self.hidden, BF16_ONE, np.uint16).tobytes()})
            out = with_state_columns(pa.Table.from_pylist(rows))
            time.sleep(max(0.0, engine_s * len(rows) - (time.time() - start)))
            with open(spans / f"engine-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps([start, time.time(), len(rows)]) + "\n")
            return out

    def stage(ds, cfg, layer_ids, dtype, scratch_dir):
        assert dtype == "bfloat16"
        return ds.map_batches(StandInEngine, batch_size=cfg.engine.batch_size, batch_format="pyarrow", num_cpus=0.5,
                              compute=ray.data.ActorPoolStrategy(size=cfg.engine.replicas),
                              fn_constructor_kwargs={"layers": len(layer_ids), "hidden": KIMI["hidden_size"]})

    return stage


def engine_figures(spans: Path) -> dict:
    rows = [json.loads(line) for f in spans.glob("engine-*.jsonl") for line in f.read_text().splitlines()]
    start, end = min(r[0] for r in rows), max(r[1] for r in rows)
    busy = sum(r[1] - r[0] for r in rows)
    per_row = sorted((r[1] - r[0]) / r[2] for r in rows if r[2])
    return {"rows": sum(r[2] for r in rows), "window_s": end - start, "idle_share": 1 - busy / (end - start),
            "median_s_per_row": per_row[len(per_row) // 2]}


def train_loop(config: dict) -> None:
    """A worker: the stream's batches (stream_batches), a step of `step_s` a row (a sleep);
    what it waited for and its peak RSS, whole, its own (RssAnon) and the shared pages it maps
    (RssShmem: the object store's, while it reads its blocks)."""
    import ray.train

    from eagle_data.training.stream_gate import stream_batches

    def rss() -> dict:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return {k: int(status[k].split()[0]) << 10 for k in ("VmRSS", "RssAnon", "RssShmem")}

    shard = ray.train.get_dataset_shard("train")
    rows, waited, first, peak = 0, 0.0, None, {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    between = 0  # its own memory with no batch in hand: what it keeps from step to step
    it = stream_batches(shard, config["report"], batch_size=config["batch"])
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
        peak = {k: max(v, peak[k]) for k, v in rss().items()}
        del batch
        between = max(between, rss()["RssAnon"])
        time.sleep(config["step_s"] * n)
    done = time.monotonic()
    rank = ray.train.get_context().get_world_rank()
    Path(config["save"], f"worker-{rank}.json").write_text(json.dumps(
        {"rows": rows, "waited_s": waited, "from_first_s": done - (first or done), "rss": peak["VmRSS"],
         "anon": peak["RssAnon"], "shmem": peak["RssShmem"], "between": between}))


def store_stats() -> dict:
    """The object store's use and what was spilled so far (MiB), from Ray's memory summary."""
    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    found = {key: re.search(pattern, text) for key, pattern in (
        ("used", r"Plasma memory usage (\d+) MiB"), ("spilled", r"Spilled (\d+) MiB"),
        ("fallback", r"Plasma filesystem mmap usage: (\d+) MiB"))}
    return {key: int(m.group(1)) << 20 if m else 0 for key, m in found.items()}


class Peaks(Every):
    """Every 0.5 s: this process's RSS, the split coordinator's, the object store's use."""

    def __init__(self):
        super().__init__(0.5)
        self.driver = self.coordinator = self.store = self.fallback = 0

    def sample(self) -> None:
        import psutil

        self.driver = max(self.driver, psutil.Process().memory_info().rss)
        for p in psutil.process_iter(["cmdline"]):
            if any("SplitCoordinator" in part for part in p.info["cmdline"] or []):
                try:
                    self.coordinator = max(self.coordinator, p.memory_info().rss)
                except psutil.Error:
                    pass
        stats = store_stats()
        self.store, self.fallback = max(self.store, stats["used"]), max(self.fallback, stats["fallback"])


def run_stream(out: Path, cfg, work: Path, args, step_s: float) -> dict:
    """One epoch of the stream into a TorchTrainer whose workers step step_s a row."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from eagle_data.training.stream import features
    from eagle_data.training.stream_gate import gate_summary

    spans = Path(tempfile.mkdtemp(dir=work))
    name = f"stream-scale-{spans.name}"
    ds = features(str(out), cfg, world_size=args.workers, shuffle=False, gate=name,
                  engine=stand_in_engine(spans, args.engine_s))
    spilled = store_stats()["spilled"]
    started = time.monotonic()
    with Peaks() as peaks:
        TorchTrainer(train_loop, train_loop_config={"step_s": step_s, "save": str(spans), "batch": args.batch,
                                                    "report": name}, datasets={"train": ds},
                     scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"memory": 1}),
                     run_config=RunConfig(storage_path=str(work / "ray-train"), name=spans.name)).fit()
    trainers = [json.loads((spans / f"worker-{r}.json").read_text()) for r in range(args.workers)]
    return {"wall_s": time.monotonic() - started, "engine": engine_figures(spans), "trainers": trainers,
            "driver_rss": peaks.driver, "coordinator_rss": peaks.coordinator, "store": peaks.store,
            "fallback": peaks.fallback, "spilled": store_stats()["spilled"] - spilled,
            "stream": gate_summary(name)["figures"]}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs=2, default=[40, 400])
    parser.add_argument("--tokens", type=int, default=400, help="a row's mean tokens (uniform, 0.5-1.5x)")
    parser.add_argument("--engine-s", type=float, default=0.25, help="the stand-in engine's seconds a row")
    parser.add_argument("--steps", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="rows a training step, per worker")
    parser.add_argument("--store-gib", type=float, default=2.0, help="the Ray instance's object store")
    parser.add_argument("--max-bytes", type=int, default=0,
                        help="stream.max_bytes_in_flight; 0: its default, a quarter of the object store")
    parser.add_argument("--smoke", action="store_true", help="4 and 48 rows of 64 tokens, 0.05 s a row, 1 GiB store "
                        "(tests/smokes.py adds --max-bytes 120000000: the gate holds the 48 rows' ~180 MB)")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.tokens, args.engine_s, args.store_gib, args.steps = [4, 48], 64, 0.05, 1.0, [2.0]

    import ray.cloudpickle

    from eagle_data.config import Config

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-in and the loop, on Ray's workers
    where = start_ray(num_cpus=2, object_store_memory=int(args.store_gib * 2**30))
    work = Path(tempfile.mkdtemp(prefix="stream-scale-"))
    model = work / "kimi-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI))
    outs = {}
    for n in args.rows:
        outs[n] = work / f"out-{n}"
        write_out(outs[n], n, args.tokens, rows_per_shard=max(4, n // 10))
    cfg = Config.model_validate({
        "model": {"path": str(model)}, "output": {"path": str(outs[args.rows[0]]), "log_every_s": 10},
        "engine": {"backend": "transformers", "batch_size": 2, "max_model_len": 4096},
        "sampling": {"max_tokens": 16}, "hidden_states": {"dtype": "bfloat16"},
        **({"stream": {"max_bytes_in_flight": args.max_bytes}} if args.max_bytes else {})})
    row_mb = args.tokens * 4 * KIMI["hidden_size"] * 2 / 1e6
    print(f"Ray: {where}, object store {args.store_gib:g} GiB; {args.rows} rows of ~{args.tokens} tokens (uniform "
          f"{args.tokens // 2}-{args.tokens * 3 // 2}), states 4 x {KIMI['hidden_size']} bfloat16 a token: "
          f"~{row_mb:.0f} MB a row; the stand-in engine {args.engine_s * 1000:.0f} ms a row, 1 replica, 2 rows a "
          f"batch; {args.workers} training workers, {args.batch} rows a step")

    small, large = args.rows
    e = args.engine_s
    runs = {k: run_stream(outs[large], cfg, work, args, k * e * args.workers) for k in args.steps}
    baseline = run_stream(outs[small], cfg, work, args, max(args.steps) * e * args.workers)

    print("\n| trainer step (x engine) | rows | wall s | engine ms a row (median batch) | trainer waits (share of "
          "its time) | engine idles (share of its window) | the stream's own: engines busy, trainers waited | "
          "target |")
    print("|---|---|---|---|---|---|---|---|")
    for k, r in runs.items():
        wait = max(t["waited_s"] / max(t["from_first_s"], 1e-9) for t in r["trainers"])
        target = "trainer waits <= 5%" if k > 1 else "engine idles <= 10%" if k < 1 else "-"
        s = r["stream"]
        print(f"| {k:g} ({'slower' if k > 1 else 'faster' if k < 1 else 'equal'}) | "
              f"{sum(t['rows'] for t in r['trainers'])} | {r['wall_s']:.1f} | "
              f"{r['engine']['median_s_per_row'] * 1000:.0f} | {wait:.1%} | {r['engine']['idle_share']:.1%} | "
              f"{percent(s['engine_busy_share'])}, {percent(s['trainer_wait_share'])} | {target} |")

    print("\n| rows | bound (its limit) | peak in flight (the stream's count) | chunks held >= 1 s (no room) | "
          "object store peak | spilled to disk | driver peak RSS | split coordinator peak RSS | training worker "
          "peak RSS (max) | worker's own (RssAnon) | worker's own between steps | worker's shared (RssShmem) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    largest = runs[max(args.steps)]
    for n, r in ((small, baseline), (large, largest)):
        s = r["stream"]
        print(f"| {n} | {mib(s['bound_bytes'])} ({mib(s['limit_bytes'])}) | {mib(s['peak_bytes_in_flight'])} "
              f"({s['peak_rows_in_flight']} rows) | {s['held']} | "
              f"{mib(r['store'])} | {mib(r['spilled'])} | {mib(r['driver_rss'])} | {mib(r['coordinator_rss'])} | "
              f"{mib(max(t['rss'] for t in r['trainers']))} | {mib(max(t['anon'] for t in r['trainers']))} | "
              f"{mib(max(t['between'] for t in r['trainers']))} | {mib(max(t['shmem'] for t in r['trainers']))} |")

    def ratio(key) -> str:
        return f"x{key(largest) / max(key(baseline), 1):.2f}"

    print(f"\n{large} vs {small} rows (baseline): object store peak "
          f"{ratio(lambda r: r['store'])}, peak in flight {ratio(lambda r: r['stream']['peak_bytes_in_flight'])}, "
          f"driver {ratio(lambda r: r['driver_rss'])}, coordinator {ratio(lambda r: r['coordinator_rss'])}, "
          f"worker {ratio(lambda r: max(t['rss'] for t in r['trainers']))}, worker's own "
          f"{ratio(lambda r: max(t['anon'] for t in r['trainers']))}, between steps "
          f"{ratio(lambda r: max(t['between'] for t in r['trainers']))}; spilled {mib(baseline['spilled'])} and "
          f"{mib(largest['spilled'])}; filesystem fallback {mib(max(baseline['fallback'], largest['fallback']))}")
    print("RESULT " + json.dumps({"rows": args.rows, "tokens": args.tokens, "engine_s": e, "runs": {
        str(k): {"rows": sum(t["rows"] for t in r["trainers"]), "engine_idle": r["engine"]["idle_share"],
                 "trainer_wait": max(t["waited_s"] / max(t["from_first_s"], 1e-9) for t in r["trainers"]),
                 "stream": r["stream"], "store": r["store"], "spilled": r["spilled"]} for k, r in runs.items()},
        "baseline": {"rows": sum(t["rows"] for t in baseline["trainers"]), "store": baseline["store"],
                     "spilled": baseline["spilled"], "stream": baseline["stream"]}}))


if __name__ == "__main__":
    main()
