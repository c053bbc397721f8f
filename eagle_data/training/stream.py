"""The feature stream: EAGLE-3 training samples computed by the engine replicas and handed
to a trainer as a Ray Dataset, with no file written (docs/streaming.md).

    data/ rows (the reader's filters; each epoch in the reader's (seed, epoch) order, padded
    or cut to a multiple of world_size as the reader does; every epoch in one execution)
      -> requests -> the hidden-states engine (the phase's own stage: vLLM or transformers,
         the same layer ids, dtype and norm convention; vLLM's file for a row is written on
         the engine's node under hidden_states.scratch_dir, read back and removed there)
      -> the phase's per-row checks: a row that fails one never reaches the trainer; the
         stream's gate counts it with its reason
      -> rows: sample_id, epoch, input_ids, loss_mask, hidden_states (bytes, [S, layers, H] in
         the dtype), hidden_states_shape

Give it to Ray Train: `TorchTrainer(loop, datasets={"train": features(out, cfg, epochs=E,
world_size=W)}, scaling_config=ScalingConfig(num_workers=W))`. Ray Train splits it with
`streaming_split(W, equal=True)`; each worker iterates its shard ONCE, for all E epochs
(every row has its `epoch`), and `eagle_data.reader.batches.collate` makes padded
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

The bound: the stream's gate (training/stream_gate.py, an actor that also counts the rows).
A chunk is asked of the engines only when the bytes of the rows asked and not yet taken by a
trainer (their states: tokens x layers x H x the dtype's bytes, plus the token ids) stay
within `stream.max_bytes_in_flight` (default: a quarter of the smallest object store among
the cluster's nodes), whatever the rows, epochs and the trainers' speed; a trainer takes
rows with `stream_batches(shard, name, ...)`, which tells the gate. A chunk's rows (their
token ids, 16 bytes a token) are read before the gate is asked: it admits them by their
real bytes, which their tokens decide; their states, what the bound is about, are computed
only once admitted. The gate always lets through what the trainers' prefetch windows and
Ray's equal split may hold back (fewer rows could stop the stream: a DDP worker waits in a
collective for one that waits for rows). A consumer that never joins (a driver's
`iter_batches`, `materialize`) is not bounded.
"""

from __future__ import annotations

import functools
import logging
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import ray

from eagle_data.config import Config
from eagle_data.errors import ConfigError, MissingInput
from eagle_data.feature_shape import FeatureShape, feature_shape
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines import apply_hidden_states_engine
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.job.stages.engines.state_files import STATE_COLUMNS
from eagle_data.job.stages.pack_hidden_states import row_error
from eagle_data.reader.samples import LENGTH_COLUMNS, Samples, padded_order
from eagle_data.storage.hidden_states import DTYPES
from eagle_data.storage.manifest import new_run_id
from eagle_data.training.stream_gate import StreamGate, size

log = logging.getLogger("eagle_data")

# The chunk numbers' blocks: one a chunk up to this many (each read_chunk call then reads one
# chunk, as the engine takes it), fewer and larger beyond, so that a stream of many epochs does
# not put a block per chunk in the object store and Ray Data's scheduler.
MAX_BLOCKS = 1000
# What a chunk's read reserves: it reads a few row groups and holds no core for long. A whole
# CPU (Ray's default) would wait behind the engine replicas and training workers, which hold
# every CPU of a small node, and starve the engine.
READ_CPUS = 0.25
# Read tasks at a time: each may wait for the gate; two, so that one's start-up (a task, the
# samples' object, the gate's answer) overlaps the other's wait.
READ_TASKS = 2
# What read_chunk takes of a sample besides its tokens (the Samples' `columns` it is given).
READ_COLUMNS = ("sample_id",)
SAMPLE_COLUMNS = ("sample_id", "epoch", "position", "input_ids", "loss_mask", "hidden_states",
                  "hidden_states_shape")
# A row's bytes besides its states: input_ids and loss_mask (int64 a token each in the row's
# Arrow block), and its strings and shapes.
TOKEN_BYTES, ROW_BYTES = 16, 256
# The gates this driver started, by name: an actor whose every handle is gone ends, and the
# Dataset that holds the others (in its stages' arguments) may be gone before its summary is read.
GATES: dict = {}


def features(out: str, cfg: Config, *, epochs: int = 1, world_size: int = 1, seed: int = 0,
             shuffle: bool = True, drop_last: bool = False, max_len: int | None = None, window: int = 4,
             gate: str | None = None, engine=None, holdout: tuple[str, float, int] | None = None,
             shape: FeatureShape | None = None) -> ray.data.Dataset:
    """The training samples of OUT's data/ rows selected by `cfg.hidden_states`'s
    finish_reason and source (and at most `max_len` tokens), with the target's states at
    the EAGLE-3 layers computed by `cfg.engine`'s replicas, for `epochs` epochs (module
    docstring). `gate` names the stream's gate, the actor that counts each epoch's rows
    and bounds the bytes in flight (default `eagle-data-stream-<id>`, logged);
    `stream_gate.gate_summary(name)` reads its counts. `engine(ds, cfg,
    layer_ids, dtype, scratch_dir) -> ds` replaces the configured engine stage, as in the
    hidden-states phase (benchmarks put a timed one there). `holdout` = (side, fraction,
    seed): only the rows on that side of the reader's validation split (reader/samples.py).
    `shape`: the target's (feature_shape), where the caller has read it."""
    samples = Samples(out, finish_reason=cfg.hidden_states.finish_reason, source=cfg.hidden_states.source,
                      max_len=max_len, shuffle=shuffle, seed=seed, window=window, columns=READ_COLUMNS,
                      holdout=holdout)
    if not samples.row.size:
        raise MissingInput(no_rows(samples, cfg, max_len))
    return features_of(samples, cfg, epochs=epochs, world_size=world_size, drop_last=drop_last, gate=gate,
                       engine=engine, shape=shape)


def features_of(samples: Samples, cfg: Config, *, epochs: int = 1, world_size: int = 1, drop_last: bool = False,
                gate: str | None = None, engine=None, shape: FeatureShape | None = None) -> ray.data.Dataset:
    """features() of samples the caller has selected and ordered (the reader's Samples, with
    READ_COLUMNS; at least one row): OUT is not read again. The draft trainer streams the
    two sides of its split so."""
    if epochs < 1 or world_size < 1:
        raise ConfigError(f"the stream's epochs and world_size must be at least 1, got {epochs} and {world_size}")
    per_epoch = padded_order(np.arange(samples.row.size), world_size, drop_last).size
    shape = shape or feature_shape(cfg)
    num_layers, hidden_size, ids = shape.num_layers, shape.hidden_size, list(shape.layer_ids)
    dtype = cfg.hidden_states.dtype
    name = gate or f"eagle-data-stream-{uuid.uuid4().hex[:8]}"
    chunk = cfg.engine.batch_size
    chunks = -(-per_epoch // chunk)
    token_bytes = len(ids) * hidden_size * DTYPES[dtype][1] + TOKEN_BYTES
    bound = {"limit": bytes_limit(cfg), "world_size": world_size, "chunk": chunk, "replicas": cfg.engine.replicas,
             "max_row_bytes": longest_row(samples, samples.max_len) * token_bytes + ROW_BYTES}
    actor = StreamGate.options(name=name).remote(name, per_epoch, epochs, cfg.output.log_every_s, bound)
    GATES[name] = actor  # alive while this driver is: gate_summary() after the Dataset is gone
    log.info("stream %s: %d samples an epoch (%d selected), %d epochs, layer ids %s of %d, H %d, %s; at most %s "
             "in flight (stream.max_bytes_in_flight%s)", name, per_epoch, samples.row.size, epochs, ids, num_layers,
             hidden_size, dtype, size(bound["limit"]), "" if cfg.stream.max_bytes_in_flight else
             ": a quarter of the smallest object store")
    scratch = f"{cfg.hidden_states.scratch_dir.rstrip('/')}/eagle-data-stream-{uuid.uuid4().hex}/{new_run_id()}"
    # Chunk numbers as blocks in the object store (no read task: one would take a whole CPU,
    # which the engines and training workers hold); each read_chunk call reads one chunk.
    ds = ray.data.from_items([{"id": k} for k in range(epochs * chunks)],
                             override_num_blocks=min(epochs * chunks, MAX_BLOCKS))
    # READ_TASKS read tasks at a time: each waits for the gate's room before it hands its chunk on.
    ds = ds.map_batches(read_chunk, batch_size=1, batch_format="pyarrow", num_cpus=READ_CPUS,
                        compute=ray.data.TaskPoolStrategy(size=READ_TASKS), fn_kwargs=dict(
                            samples=ray.put(samples), world_size=world_size, drop_last=drop_last, chunk=chunk,
                            chunks=chunks, scratch=scratch, gate=actor, token_bytes=token_bytes))
    ds = (engine or apply_hidden_states_engine)(ds, cfg, ids, dtype, scratch)
    # The checks in actors of their own, not tasks: when Ray Train restarts its workers, Ray
    # Data cancels the old execution's tasks, and a task cancelled while importing torch left
    # it half-imported in a worker that the next execution's check then ran in ("duplicate
    # registrations for aten.linspace"). An actor's process ends with its execution.
    return ds.map_batches(Checks, batch_format="pyarrow", num_cpus=0,
                          compute=ray.data.ActorPoolStrategy(size=cfg.engine.replicas),
                          fn_constructor_kwargs=dict(gate=actor, layer_ids=ids, hidden_size=hidden_size,
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


def bytes_limit(cfg: Config) -> int:
    """stream.max_bytes_in_flight, or a quarter of the smallest object store among the
    cluster's alive nodes (the rows pass through the engine nodes' stores, then the trainer
    nodes'): under it, nothing the stream holds is spilled to disk."""
    if cfg.stream.max_bytes_in_flight:
        return cfg.stream.max_bytes_in_flight
    stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n.get("Alive")]
    return max(1, int(min((s for s in stores if s), default=2 << 30) // 4))


def longest_row(samples: Samples, max_len: int | None) -> int:
    """The most tokens a selected row may have: the longest data/ row (max_len at most)."""
    longest = 0
    for batch in samples.out.batches(list(LENGTH_COLUMNS)):
        if batch.num_rows:
            longest = max(longest, int(np.max(sum(batch.column(c).to_numpy() for c in LENGTH_COLUMNS))))
    return min(longest, max_len) if max_len else longest


def read_chunk(batch: pa.Table, samples: ray.ObjectRef, world_size: int, drop_last: bool, chunk: int,
               chunks: int, scratch: str, gate, token_bytes: int) -> pa.Table:
    """Chunk numbers k (the `id` of each row) -> the data/ rows at positions
    [j x chunk, (j + 1) x chunk) of epoch k // chunks's order, j = k % chunks, each with its
    request's file path (unique per request: padding may ask a sample twice in an epoch);
    handed on once the stream's gate has room for their bytes, without the places a resumed
    trainer had trained on before (StreamGate.admit). The rows are read first: the gate
    admits them by their bytes, which their tokens decide."""
    rows = []
    for k in batch.column("id").to_pylist():
        epoch, part = divmod(k, chunks)
        order, reader = epoch_order(samples, world_size, drop_last, epoch)
        for position in range(part * chunk, min((part + 1) * chunk, order.size)):
            item = reader.sample(int(order[position]))
            rows.append({"sample_id": item["sample_id"], "epoch": epoch, "position": position,
                         "input_ids": item["input_ids"].tolist(), "loss_mask": item["loss_mask"].tolist(),
                         "hidden_states_path": f"{scratch}/{uuid.uuid4().hex}.safetensors"})
    places = [(row["epoch"], row["position"]) for row in rows]
    tokens = [len(row["input_ids"]) for row in rows]
    while True:  # the gate answers within a second: a cancelled task stops waiting soon
        skip = ray.get(gate.admit.remote(places, [n * token_bytes + ROW_BYTES for n in tokens], tokens, 1.0))
        if skip is not None:
            break
    return pa.Table.from_pylist([row for row, skipped in zip(rows, skip) if not skipped], schema=READ_SCHEMA)


# `position`: the row's place in its epoch's order, what the gate counts (once, whichever
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
    others are counted, with their reasons, by the stream's gate."""

    reads = columns("sample_id", "epoch", "position", "input_ids", "loss_mask", ENGINE_ERROR_COLUMN, *STATE_COLUMNS)
    makes = columns(*SAMPLE_COLUMNS)

    def __init__(self, gate, layer_ids: list[int], hidden_size: int, dtype: str):
        import torch  # noqa: F401  (the checks' own import, once, before any batch)

        self.gate, self.layer_ids, self.hidden_size, self.dtype = gate, layer_ids, hidden_size, dtype

    def apply(self, batch: pa.Table) -> pa.Table:
        rows = batch.select(list(self.reads)).to_pylist()
        errors = [row_error(row, self.layer_ids, self.hidden_size, self.dtype) for row in rows]
        ok = [row for row, error in zip(rows, errors) if not error]
        self.gate.add.remote([(row["epoch"], row["position"]) for row in ok],
                             [(row["epoch"], row["position"], row["sample_id"], e)
                                  for row, e in zip(rows, errors) if e])
        return pa.table({name: pa.array([row[name] for row in ok], SAMPLE_TYPES[name]) for name in SAMPLE_COLUMNS})
