"""The feature stream: EAGLE-3 training samples computed by the engine replicas and handed
to a trainer as a Ray Dataset, with no file written (docs/streaming.md).

    data/ rows (the reader's filters; each epoch in the reader's (seed, epoch) order, padded
    or cut to a multiple of world_size as the reader does; every epoch in one execution)
      -> requests -> the hidden-states engine (the phase's own stage: vLLM or transformers,
         the same layer ids, dtype and norm convention; vLLM's file for a row is written on
         the engine's node under hidden_states.scratch_dir, read back and removed there)
      -> the phase's per-row checks: a row that fails one never reaches the trainer; the
         stream's report counts it with its reason
      -> rows: sample_id, epoch, input_ids, loss_mask, hidden_states (bytes, [S, layers, H] in
         the dtype), hidden_states_shape

Give it to Ray Train: `TorchTrainer(loop, datasets={"train": features(out, cfg, epochs=E,
world_size=W)}, scaling_config=ScalingConfig(num_workers=W))`. Ray Train splits it with
`streaming_split(W, equal=True)`; each worker iterates its shard ONCE, for all E epochs
(every row has its `epoch`), and `eagle_data.training.batches.collate` makes padded
torch tensors of a batch, as the reader's `collate` does. All epochs run in one Ray Data
execution so the engine replicas load the model once: iterating a shard again would start
them again.

What each worker gets: every selected sample once per epoch across the workers (plus the
padding, repeats of the epoch's first samples, as the reader pads), and the same number of
rows as every other worker over the whole stream, so a DDP loop with a collective per step
never hangs. Which worker gets a row is decided as rows come (Ray's split hands each block
to the worker with the fewest rows), so a worker's share of one epoch, and the exact order
rows arrive in, vary from run to run; the order the rows are ASKED in is a function of
(seed, epoch). A batch may hold the end of one epoch and the start of the next. A row that
fails a check makes its epoch one row short; Ray's equal split then drops up to W - 1 rows
at the very end of the stream.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray

from eagle_data.config import Config
from eagle_data.errors import ConfigError, MissingInput
from eagle_data.job.phases.hidden_states import layer_ids, target_shape
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines import apply_hidden_states_engine
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.job.stages.engines.state_files import STATE_COLUMNS
from eagle_data.job.stages.pack_hidden_states import row_error
from eagle_data.reader.samples import Samples, padded_order
from eagle_data.storage.manifest import new_run_id

log = logging.getLogger("eagle_data")

# The chunk numbers' blocks: one a chunk up to this many (each read_chunk call then reads one
# chunk, as the engine takes it), fewer and larger beyond, so that a stream of many epochs does
# not put a block per chunk in the object store and Ray Data's scheduler.
MAX_BLOCKS = 1000
# What a chunk's read reserves: it reads a few row groups and holds no core for long. A whole
# CPU (Ray's default) would wait behind the engine replicas and training workers, which hold
# every CPU of a small node, and starve the engine.
READ_CPUS = 0.25
SAMPLE_COLUMNS = ("sample_id", "epoch", "input_ids", "loss_mask", "hidden_states", "hidden_states_shape")


def features(out: str, cfg: Config, *, epochs: int = 1, world_size: int = 1, seed: int = 0,
             shuffle: bool = True, drop_last: bool = False, max_len: int | None = None, window: int = 4,
             report: str | None = None, engine=None, holdout: tuple[str, float, int] | None = None
             ) -> ray.data.Dataset:
    """The training samples of OUT's data/ rows selected by `cfg.hidden_states`'s
    finish_reason and source (and at most `max_len` tokens), with the target's states at
    the EAGLE-3 layers computed by `cfg.engine`'s replicas, for `epochs` epochs (module
    docstring). `report` names the actor that counts each epoch's rows (default
    `eagle-data-stream-<id>`, logged); `stream_report(name)` reads it. `engine(ds, cfg,
    layer_ids, dtype, scratch_dir) -> ds` replaces the configured engine stage, as in the
    hidden-states phase (benchmarks put a timed one there). `holdout` = (side, fraction,
    seed): only the rows on that side of the reader's validation split (reader/samples.py)."""
    if epochs < 1 or world_size < 1:
        raise ConfigError(f"the stream's epochs and world_size must be at least 1, got {epochs} and {world_size}")
    samples = Samples(out, finish_reason=cfg.hidden_states.finish_reason, source=cfg.hidden_states.source,
                      max_len=max_len, shuffle=shuffle, seed=seed, window=window, columns=("sample_id",),
                      holdout=holdout)
    if not samples.row.size:
        raise MissingInput(no_rows(samples, cfg, max_len))
    per_epoch = padded_order(np.arange(samples.row.size), world_size, drop_last).size
    num_layers, hidden_size = target_shape(cfg)
    ids, dtype = layer_ids(cfg, num_layers), cfg.hidden_states.dtype
    name = report or f"eagle-data-stream-{uuid.uuid4().hex[:8]}"
    reporter = StreamReport.options(name=name).remote(name, per_epoch, epochs, cfg.output.log_every_s)
    chunk = cfg.engine.batch_size
    chunks = -(-per_epoch // chunk)
    log.info("stream %s: %d samples an epoch (%d selected), %d epochs, layer ids %s of %d, H %d, %s",
             name, per_epoch, samples.row.size, epochs, ids, num_layers, hidden_size, dtype)
    scratch = f"{cfg.hidden_states.scratch_dir.rstrip('/')}/eagle-data-stream-{uuid.uuid4().hex}/{new_run_id()}"
    # Chunk numbers as blocks in the object store (no read task: one would take a whole CPU,
    # which the engines and training workers hold); each read_chunk call reads one chunk.
    ds = ray.data.from_items([{"id": k} for k in range(epochs * chunks)],
                             override_num_blocks=min(epochs * chunks, MAX_BLOCKS))
    ds = ds.map_batches(read_chunk, batch_size=1, batch_format="pyarrow", num_cpus=READ_CPUS, fn_kwargs=dict(
        samples=ray.put(samples), world_size=world_size, drop_last=drop_last, chunk=chunk, chunks=chunks,
        scratch=scratch))
    ds = (engine or apply_hidden_states_engine)(ds, cfg, ids, dtype, scratch)
    # The checks in actors of their own, not tasks: when Ray Train restarts its workers, Ray
    # Data cancels the old execution's tasks, and a task cancelled while importing torch left
    # it half-imported in a worker that the next execution's check then ran in ("duplicate
    # registrations for aten.linspace"). An actor's process ends with its execution.
    return ds.map_batches(Checks, batch_format="pyarrow", num_cpus=0,
                          compute=ray.data.ActorPoolStrategy(size=cfg.engine.replicas),
                          fn_constructor_kwargs=dict(reporter=reporter, layer_ids=ids, hidden_size=hidden_size,
                                                     dtype=dtype))


def no_rows(samples: Samples, cfg: Config, max_len: int | None) -> str:
    """Why the stream has no sample: data/ is missing or holds no row (the generate phase has
    not run, or answered nothing), or the filters that are set leave none."""
    root = samples.out.root
    filters = {"hidden_states.finish_reason": cfg.hidden_states.finish_reason,
               "hidden_states.source": cfg.hidden_states.source, "max_len": max_len}
    named = ", ".join(f"{key} {value}" for key, value in filters.items() if value is not None)
    if samples.out.files and named:
        return f"{root}: no data/ row is selected by {named}: widen them (null: any)"
    found = samples.out.fs.get_file_info(f"{root}/data").type == pafs.FileType.Directory
    return (f"{root}/data {'holds no row' if found else 'is missing'}: this OUT has no answers to stream (has the "
            "generate phase run? `python -m ray_jobs.generate --config FILE --phase generate` makes them)")


def read_chunk(batch: pa.Table, samples: ray.ObjectRef, world_size: int, drop_last: bool, chunk: int,
               chunks: int, scratch: str) -> pa.Table:
    """Chunk numbers k (the `id` of each row) -> the data/ rows at positions
    [j x chunk, (j + 1) x chunk) of epoch k // chunks's order, j = k % chunks, each with its
    request's file path (unique per request: padding may ask a sample twice in an epoch)."""
    rows = []
    for k in batch.column("id").to_pylist():
        epoch, part = divmod(k, chunks)
        order, reader = epoch_order(samples, world_size, drop_last, epoch)
        for position in range(part * chunk, min((part + 1) * chunk, order.size)):
            item = reader.sample(int(order[position]))
            rows.append({"sample_id": item["sample_id"], "epoch": epoch, "position": position,
                         "input_ids": item["input_ids"].tolist(), "loss_mask": item["loss_mask"].tolist(),
                         "hidden_states_path": f"{scratch}/{uuid.uuid4().hex}.safetensors"})
    return pa.Table.from_pylist(rows, schema=READ_SCHEMA)


# `position`: the row's place in its epoch's order, what the report counts (once, whichever
# execution computed it: after Ray Train restarts its workers the stream runs again).
READ_SCHEMA = pa.schema([("sample_id", pa.string()), ("epoch", pa.int64()), ("position", pa.int64()),
                         ("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                         ("hidden_states_path", pa.string())])
SAMPLE_TYPES = {**{f.name: f.type for f in READ_SCHEMA}, **STATE_COLUMNS}


@functools.lru_cache(maxsize=1)  # per worker process: a chunk's epoch is mostly the one before's
def epoch_order(samples: ray.ObjectRef, world_size: int, drop_last: bool, epoch: int) -> tuple[np.ndarray, Samples]:
    """The epoch's order as the reader's ranks 0..W-1 would read it, one after the other."""
    reader = ray.get(samples)
    return padded_order(reader.epoch_order(epoch), world_size, drop_last), reader


class Checks(Stage):
    """The engine's rows -> the samples that pass the hidden-states phase's checks; the
    others are counted, with their reasons, in the stream's report."""

    reads = columns("sample_id", "epoch", "position", "input_ids", "loss_mask", ENGINE_ERROR_COLUMN, *STATE_COLUMNS)
    makes = columns(*SAMPLE_COLUMNS)

    def __init__(self, reporter, layer_ids: list[int], hidden_size: int, dtype: str):
        import torch  # noqa: F401  (the checks' own import, once, before any batch)

        self.reporter, self.layer_ids, self.hidden_size, self.dtype = reporter, layer_ids, hidden_size, dtype

    def apply(self, batch: pa.Table) -> pa.Table:
        rows = batch.select(list(self.reads)).to_pylist()
        errors = [row_error(row, self.layer_ids, self.hidden_size, self.dtype) for row in rows]
        ok = [row for row, error in zip(rows, errors) if not error]
        self.reporter.add.remote([(row["epoch"], row["position"]) for row in ok],
                                 [(row["epoch"], row["position"], row["sample_id"], e)
                                  for row, e in zip(rows, errors) if e])
        return pa.table({name: pa.array([row[name] for row in ok], SAMPLE_TYPES[name]) for name in SAMPLE_COLUMNS})


@ray.remote(num_cpus=0)
class StreamReport:
    """Counts each epoch's rows that passed the checks and those that did not, with their
    reasons, once per place in the epoch's order (a bit per place: after Ray Train restarts
    its workers, the stream runs again from epoch 0, and a place computed twice counts once);
    logs a progress line every `every_s` while rows come and one line per finished epoch."""

    def __init__(self, name: str, per_epoch: int, epochs: int, every_s: float):
        self.name, self.per_epoch, self.epochs, self.every_s = name, per_epoch, epochs, every_s
        self.passed = np.zeros((epochs, per_epoch), bool)
        self.failed: dict[tuple[int, int], tuple[str, str]] = {}  # (epoch, position) -> (sample_id, reason)
        self.logged: set[int] = set()
        self.checked = 0  # rows checked, places computed again included
        self.started = self.last = time.monotonic()
        logging.basicConfig(level=logging.INFO, format="%(message)s")

    def add(self, ok: list[tuple[int, int]], failed: list[tuple[int, int, str, str]]) -> None:
        self.checked += len(ok) + len(failed)
        for epoch, position in ok:
            self.passed[epoch, position] = True
            self.failed.pop((epoch, position), None)  # computed again, and passed this time
        for epoch, position, sample_id, error in failed:
            if not self.passed[epoch, position]:
                self.failed[epoch, position] = (sample_id, error)
        for epoch in ({e for e, _ in ok} | {e for e, *_ in failed}) - self.logged:
            counts = self.epoch_counts(epoch)
            if counts["ok"] + sum(counts["failed"].values()) == self.per_epoch:
                self.logged.add(epoch)
                log.info("stream %s: epoch %d done: %d samples passed, %d failed%s", self.name, epoch,
                         counts["ok"], sum(counts["failed"].values()), reasons(Counter(counts["failed"])))
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            log.info("stream %s: %d/%d samples passed, %d failed, %.0f s", self.name, int(self.passed.sum()),
                     self.per_epoch * self.epochs, len(self.failed), self.last - self.started)

    def epoch_counts(self, epoch: int) -> dict:
        why = Counter(reason for (e, _), (_, reason) in self.failed.items() if e == epoch)
        return {"ok": int(self.passed[epoch].sum()), "failed": dict(why)}

    def summary(self) -> dict:
        """{"per_epoch": N, "epochs": {e: {"ok": n, "failed": {reason: n}}}, "failures": [(epoch,
        sample_id, reason)], "checked": rows checked, places computed again included}"""
        return {"per_epoch": self.per_epoch, "checked": self.checked,
                "failures": [(e, sid, why) for (e, _), (sid, why) in sorted(self.failed.items())],
                "epochs": {e: self.epoch_counts(e) for e in range(self.epochs)}}


def reasons(failed: Counter) -> str:
    return "" if not failed else " (" + "; ".join(f"{n} x {why}" for why, n in failed.most_common()) + ")"


def stream_report(name: str, namespace: str | None = None) -> dict:
    """What the stream's report actor counted so far (`StreamReport.summary`); `namespace`:
    the Ray namespace of the driver that started the stream, from another driver."""
    return ray.get(ray.get_actor(name, namespace=namespace).summary.remote())
