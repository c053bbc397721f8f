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

The bound: the stream's report actor is also its gate. A chunk is asked of the engines only
when the bytes of the rows asked and not yet taken by a trainer (their states: tokens x
layers x H x the dtype's bytes, plus the token ids) stay within `stream.max_bytes_in_flight`
(default: a quarter of the smallest object store among the cluster's nodes), whatever the
rows, epochs and the trainers' speed; a trainer takes rows with `stream_batches(shard,
name, ...)`, which tells the gate. The gate always lets through what the trainers' prefetch
windows and Ray's equal split may hold back (fewer rows could stop the stream: a DDP worker
waits in a collective for one that waits for rows). A consumer that never joins (a driver's
`iter_batches`, `materialize`) is not bounded.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import Counter
from typing import Iterator

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
from eagle_data.reader.samples import LENGTH_COLUMNS, Samples, padded_order
from eagle_data.storage.hidden_states import DTYPES
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
# Read tasks at a time: each may wait for the gate; two, so that one's start-up (a task, the
# samples' object, the gate's answer) overlaps the other's wait.
READ_TASKS = 2
SAMPLE_COLUMNS = ("sample_id", "epoch", "position", "input_ids", "loss_mask", "hidden_states",
                  "hidden_states_shape")
# A row's bytes besides its states: input_ids and loss_mask (int64 a token each in the row's
# Arrow block), and its strings and shapes.
TOKEN_BYTES, ROW_BYTES = 16, 256
# The rows a trainer's stream_batches may hold besides its prefetched batches: the one its loop
# works on, and a block on its way.
WINDOW_EXTRA_BATCHES = 2
# stream_batches' prefetch when none is given: at most this many batches, fewer where the
# trainers' windows would take more than half of the stream's bound.
MAX_PREFETCH = 4
# The report actors this driver started, by name: an actor whose every handle is gone ends, and
# the Dataset that holds the others (in its stages' arguments) may be gone before its report is read.
REPORTS: dict = {}


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
    chunk = cfg.engine.batch_size
    chunks = -(-per_epoch // chunk)
    token_bytes = len(ids) * hidden_size * DTYPES[dtype][1] + TOKEN_BYTES
    gate = {"limit": bytes_limit(cfg), "world_size": world_size, "chunk": chunk, "replicas": cfg.engine.replicas,
            "max_row_bytes": longest_row(samples, max_len) * token_bytes + ROW_BYTES}
    reporter = StreamReport.options(name=name).remote(name, per_epoch, epochs, cfg.output.log_every_s, gate)
    REPORTS[name] = reporter  # alive while this driver is: stream_report() after the Dataset is gone
    log.info("stream %s: %d samples an epoch (%d selected), %d epochs, layer ids %s of %d, H %d, %s; at most %s "
             "in flight (stream.max_bytes_in_flight%s)", name, per_epoch, samples.row.size, epochs, ids, num_layers,
             hidden_size, dtype, size(gate["limit"]), "" if cfg.stream.max_bytes_in_flight else
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
                            chunks=chunks, scratch=scratch, reporter=reporter, token_bytes=token_bytes))
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


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def read_chunk(batch: pa.Table, samples: ray.ObjectRef, world_size: int, drop_last: bool, chunk: int,
               chunks: int, scratch: str, reporter, token_bytes: int) -> pa.Table:
    """Chunk numbers k (the `id` of each row) -> the data/ rows at positions
    [j x chunk, (j + 1) x chunk) of epoch k // chunks's order, j = k % chunks, each with its
    request's file path (unique per request: padding may ask a sample twice in an epoch);
    handed on once the stream's gate has room for their bytes, without the places a resumed
    trainer had trained on before (StreamReport.admit)."""
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
        skip = ray.get(reporter.admit.remote(places, [n * token_bytes + ROW_BYTES for n in tokens], tokens, 1.0))
        if skip is not None:
            break
    return pa.Table.from_pylist([row for row, skipped in zip(rows, skip) if not skipped], schema=READ_SCHEMA)


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


@ray.remote(num_cpus=0, max_concurrency=64)  # threads: a read task waits in admit while rows are taken
class StreamReport:
    """The stream's actor. Counts each epoch's rows that passed the checks and those that did
    not, with their reasons, once per place in the epoch's order (a bit per place: after Ray
    Train restarts its workers, the stream runs again, and a place computed twice counts
    once); logs a progress line every `every_s` while rows come and one line per finished
    epoch.

    And the stream's gate (`gate`: limit, world_size, chunk, replicas, max_row_bytes; none: it
    only counts): `admit` lets a chunk of places be asked of the engines while the bytes of
    the rows asked and not yet taken stay within the limit, `taken` (stream_batches) frees
    them, a failed check too. Bounded only while trainers have joined (stream_batches); the
    gate always lets `floor_rows` rows through, what the trainers' windows and Ray's equal
    split may hold back. A trainer group that joins in place of another (Ray Train started
    its workers again: a new execution) starts the gate's count afresh, and `resume` names
    the places a restored trainer had trained on, which are not asked again."""

    def __init__(self, name: str, per_epoch: int, epochs: int, every_s: float, gate: dict | None = None):
        self.name, self.per_epoch, self.epochs, self.every_s = name, per_epoch, epochs, every_s
        self.passed = np.zeros((epochs, per_epoch), bool)
        self.failed: dict[tuple[int, int], tuple[str, str]] = {}  # (epoch, position) -> (sample_id, reason)
        self.logged: set[int] = set()
        self.checked = 0  # rows checked, places computed again included
        self.started = self.last = time.monotonic()
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        gate = gate or {}
        self.limit = gate.get("limit")
        self.world_size, self.chunk = gate.get("world_size", 1), gate.get("chunk", 1)
        self.replicas, self.max_row_bytes = gate.get("replicas", 1), gate.get("max_row_bytes", 0)
        self.cond = threading.Condition()
        self.consumed = np.zeros((epochs, per_epoch), bool)  # resume: places trained on before, not asked
        self.inflight: dict[tuple[int, int], list] = {}  # place -> [bytes, tokens, states back?]
        self.inflight_bytes = self.peak_bytes = self.peak_rows = 0
        self.waiting = 0  # rows asked whose states are not back yet: the engines' work
        self.consumers: dict[int, dict] = {}  # rank -> worker, window (rows), waited_s, elapsed_s
        self.groups = 0  # trainer groups that joined (more than 1: Ray Train started its workers again)
        self.held = 0  # admit calls that found no room (a chunk held back, for a second at most each)
        self.first_asked = self.last_event = self.last_computed = None
        self.had_work_s = self.had_work_at_last = 0.0
        self.taken_rows = self.taken_tokens = self.ok_rows = self.ok_tokens = 0
        self.first_taken = self.last_taken = None

    # --- the gate ---------------------------------------------------------------------------

    def admit(self, places: list[tuple[int, int]], nbytes: list[int], tokens: list[int],
              wait_s: float) -> list[bool] | None:
        """Which of a chunk's places to leave out (a resumed trainer had trained on them), once
        there is room for the others' bytes; None when there was none within `wait_s` (ask again)."""
        with self.cond:
            skip = [bool(self.consumed[e, p]) for e, p in places]
            todo = [(place, b, t) for place, b, t, s in zip(places, nbytes, tokens, skip) if not s]
            need = sum(b for _, b, _ in todo)
            deadline = time.monotonic() + wait_s
            while todo and not self._room(len(todo), need):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.held += 1
                    return None
                self.cond.wait(left)
            now = time.monotonic()
            self._tick(now)
            self.first_asked = self.first_asked or now
            for place, b, t in todo:
                self._drop(place)  # asked again (a new execution): counted once
                self.inflight[place] = [b, t, False]
                self.inflight_bytes += b
                self.waiting += 1
            self.peak_bytes = max(self.peak_bytes, self.inflight_bytes)
            self.peak_rows = max(self.peak_rows, len(self.inflight))
            return skip

    def _room(self, rows: int, need: int) -> bool:
        if self.limit is None or not self.consumers or not self.inflight:
            return True
        return self.inflight_bytes + need <= self.limit or len(self.inflight) + rows <= self.floor_rows()

    def floor_rows(self) -> int:
        """The rows the gate always lets be in flight: every trainer's window (its prefetched
        batches, the one its loop works on, one on its way) and what Ray's equal split holds
        back to even the shares (up to a block per worker) and hands on (as much again)."""
        return sum(c["window"] for c in self.consumers.values()) + 2 * self.world_size * self.chunk

    def bound(self) -> int | None:
        """The bytes in flight the gate keeps to: the limit, or the floor's rows at their longest."""
        if self.limit is None:
            return None
        return max(self.limit, self.floor_rows() * self.max_row_bytes) if self.consumers else self.limit

    def _drop(self, place: tuple[int, int]) -> list | None:
        entry = self.inflight.pop(place, None)
        if entry is not None:
            self.inflight_bytes -= entry[0]
            if not entry[2]:
                self.waiting -= 1
        return entry

    def _tick(self, now: float) -> None:
        """The engines' work over time: the share of the replicas that had a batch to compute."""
        if self.last_event is not None:
            self.had_work_s += (now - self.last_event) * min(1.0, self.waiting / (self.replicas * self.chunk))
        self.last_event = now

    def join(self, rank: int, worker: str, batch_size: int, prefetch_batches: int | None) -> dict:
        """A trainer (stream_batches) starts taking rows: its window counts in the floor. The
        prefetch it is to use: `prefetch_batches`, or at most MAX_PREFETCH, fewer where the
        trainers' windows would take more than half of the limit."""
        with self.cond:
            known = self.consumers.get(rank)
            if known is not None and known["worker"] != worker:  # Ray Train started its workers again
                log.info("stream %s: a new group of trainers (Ray Train started its workers again): the stream "
                         "runs again; %d rows (%s) in flight dropped from the count", self.name, len(self.inflight),
                         size(self.inflight_bytes))
                self._tick(time.monotonic())
                self.consumers.clear()
                for place in list(self.inflight):
                    self._drop(place)
            if not self.consumers:
                self.groups += 1
            prefetch = prefetch_batches
            if prefetch is None:
                prefetch = MAX_PREFETCH
                while prefetch > 1 and self.limit and self.world_size * (prefetch + WINDOW_EXTRA_BATCHES) * \
                        batch_size * self.max_row_bytes > self.limit / 2:
                    prefetch -= 1
            self.consumers[rank] = {"worker": worker, "window": (prefetch + WINDOW_EXTRA_BATCHES) * batch_size,
                                    "waited_s": 0.0, "elapsed_s": 0.0}
            if len(self.consumers) == self.world_size and self.limit is not None:
                log.info("stream %s: %d trainers take rows, %d batches of %d prefetched each: at most %s in flight%s",
                         self.name, self.world_size, prefetch, batch_size, size(self.bound()),
                         "" if self.bound() == self.limit else f" (the limit, {size(self.limit)}, raised to what "
                         f"the trainers' windows and the equal split hold: {self.floor_rows()} rows)")
            self.cond.notify_all()
            return {"prefetch_batches": prefetch, "bound": self.bound()}

    def resume(self, consumed: np.ndarray) -> None:
        """The places ([epochs, per_epoch] bools) a restored trainer had trained on: not asked again."""
        with self.cond:
            self.consumed = np.asarray(consumed, bool).reshape(self.epochs, self.per_epoch).copy()

    def taken(self, rank: int, places: list[tuple[int, int]], tokens: int, waited_s: float, elapsed_s: float) -> None:
        """A trainer took these rows (stream_batches): their bytes leave the count. `waited_s`
        of its `elapsed_s` since its first batch it waited for rows."""
        with self.cond:
            now = time.monotonic()
            self._tick(now)
            for place in places:
                self._drop(tuple(place))
            self.taken_rows += len(places)
            self.taken_tokens += tokens
            self.first_taken = self.first_taken or now
            self.last_taken = now
            if rank in self.consumers:
                self.consumers[rank].update(waited_s=waited_s, elapsed_s=elapsed_s)
            self.cond.notify_all()
            self._progress()

    # --- the counts ---------------------------------------------------------------------------

    def add(self, ok: list[tuple[int, int]], failed: list[tuple[int, int, str, str]]) -> None:
        with self.cond:
            now = time.monotonic()
            self._tick(now)
            self.checked += len(ok) + len(failed)
            for epoch, position in ok:
                self.passed[epoch, position] = True
                self.failed.pop((epoch, position), None)  # computed again, and passed this time
                entry = self.inflight.get((epoch, position))
                if entry is not None and not entry[2]:
                    entry[2] = True
                    self.waiting -= 1
                self.ok_rows += 1
                self.ok_tokens += entry[1] if entry is not None else 0
            for epoch, position, sample_id, error in failed:
                if not self.passed[epoch, position]:
                    self.failed[epoch, position] = (sample_id, error)
                self._drop((epoch, position))  # never taken: its bytes leave the count now
            if ok or failed:
                self.last_computed, self.had_work_at_last = now, self.had_work_s
            self.cond.notify_all()
            for epoch in ({e for e, _ in ok} | {e for e, *_ in failed}) - self.logged:
                counts = self.epoch_counts(epoch)
                if counts["ok"] + sum(counts["failed"].values()) == self.per_epoch:
                    self.logged.add(epoch)
                    log.info("stream %s: epoch %d done: %d samples passed, %d failed%s", self.name, epoch,
                             counts["ok"], sum(counts["failed"].values()), reasons(Counter(counts["failed"])))
            self._progress()

    def _progress(self) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            f = self.figures()
            log.info("stream %s: %d/%d samples passed, %d failed, %.0f s; %.2f rows/s, %.0f tokens/s; %s in flight "
                     "(peak %s%s); engines busy %s, trainers waited %s", self.name, int(self.passed.sum()),
                     self.per_epoch * self.epochs, len(self.failed), self.last - self.started, f["rows_per_s"],
                     f["tokens_per_s"], size(f["bytes_in_flight"]), size(f["peak_bytes_in_flight"]),
                     f", bound {size(f['bound_bytes'])}" if f["bound_bytes"] else "", percent(f["engine_busy_share"]),
                     percent(f["trainer_wait_share"]))

    def figures(self) -> dict:
        """The stream's own figures: rows and tokens a second (taken by the trainers; rows that
        passed the checks where none joined), bytes in flight (now, peak, the bound), the
        engines' busy share (of the time from the first row asked to the last one computed:
        the share of the replicas that had a batch to compute, rows asked and their states not
        back) and the trainers' wait share (the most any waited, of its time from its first batch)."""
        if self.taken_rows:
            rows, tokens, span = self.taken_rows, self.taken_tokens, self.last_taken - self.first_taken
        else:
            rows, tokens = self.ok_rows, self.ok_tokens
            span = (self.last_computed - self.first_asked) if self.last_computed and self.first_asked else 0
        window = (self.last_computed - self.first_asked) if self.last_computed and self.first_asked else 0
        waits = [c["waited_s"] / c["elapsed_s"] for c in self.consumers.values() if c["elapsed_s"] > 0]
        return {"rows_per_s": rows / span if span > 0 else 0.0, "tokens_per_s": tokens / span if span > 0 else 0.0,
                "rows_taken": self.taken_rows, "bytes_in_flight": self.inflight_bytes, "rows_in_flight": len(self.inflight),
                "peak_bytes_in_flight": self.peak_bytes, "peak_rows_in_flight": self.peak_rows,
                "bound_bytes": self.bound(), "limit_bytes": self.limit,
                "engine_busy_share": self.had_work_at_last / window if window > 0 else None,
                "trainer_wait_share": max(waits) if waits else None, "trainer_groups": self.groups,
                "held": self.held}

    def epoch_counts(self, epoch: int) -> dict:
        why = Counter(reason for (e, _), (_, reason) in self.failed.items() if e == epoch)
        return {"ok": int(self.passed[epoch].sum()), "failed": dict(why)}

    def summary(self) -> dict:
        """{"per_epoch": N, "epochs": {e: {"ok": n, "failed": {reason: n}}}, "failures": [(epoch,
        sample_id, reason)], "checked": rows checked, places computed again included,
        "figures": figures()}"""
        with self.cond:
            return {"per_epoch": self.per_epoch, "checked": self.checked,
                    "failures": [(e, sid, why) for (e, _), (sid, why) in sorted(self.failed.items())],
                    "epochs": {e: self.epoch_counts(e) for e in range(self.epochs)}, "figures": self.figures()}


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def reasons(failed: Counter) -> str:
    return "" if not failed else " (" + "; ".join(f"{n} x {why}" for why, n in failed.most_common()) + ")"


def stream_report(name: str, namespace: str | None = None) -> dict:
    """What the stream's report actor counted so far (`StreamReport.summary`); `namespace`:
    the Ray namespace of the driver that started the stream, from another driver."""
    return ray.get(ray.get_actor(name, namespace=namespace).summary.remote())


def stream_batches(shard, stream: str, *, batch_size: int, prefetch_batches: int | None = None,
                   consumed: np.ndarray | None = None, rank: int | None = None,
                   namespace: str | None = None) -> Iterator[dict]:
    """A Ray Train worker's batches of the stream named `stream` (features(report=...)):
    `shard.iter_batches(batch_size=..., batch_format="numpy", prefetch_batches=...)`, each
    batch told to the stream as taken when the loop gets it, which frees its bytes in the
    stream's bound (without it the stream is not bounded). `prefetch_batches` None: as many
    as fit the bound (at most MAX_PREFETCH). `consumed` ([epochs, per_epoch] bools, from a
    checkpoint: the places trained on before; `consumed_places` makes it): not asked again.
    The worker's waits for rows (after its first batch, which waits for the engines' start)
    go to the stream's figures. `rank`: the Ray Train world rank (by default this worker's)."""
    if rank is None:
        import ray.train

        rank = ray.train.get_context().get_world_rank()
    actor = ray.get_actor(stream, namespace=namespace)
    worker = ray.get_runtime_context().get_actor_id() or f"pid-{__import__('os').getpid()}"
    joined = ray.get(actor.join.remote(rank, worker, batch_size, prefetch_batches))
    if consumed is not None:
        ray.get(actor.resume.remote(consumed))
    batches = iter(shard.iter_batches(batch_size=batch_size, batch_format="numpy",
                                      prefetch_batches=joined["prefetch_batches"]))
    first, waited = None, 0.0
    while True:
        asked = time.monotonic()
        try:
            batch = next(batches)
        except StopIteration:
            return
        got = time.monotonic()
        if first is None:
            first = got
        else:
            waited += got - asked
        places = [(int(e), int(p)) for e, p in zip(batch["epoch"], batch["position"])]
        actor.taken.remote(rank, places, int(sum(len(ids) for ids in batch["input_ids"])), waited, got - first)
        yield batch


def consumed_places(places, epochs: int, per_epoch: int) -> np.ndarray:
    """(epoch, position) places -> the [epochs, per_epoch] bools stream_batches' `consumed` takes."""
    marks = np.zeros((epochs, per_epoch), bool)
    for epoch, position in places:
        marks[epoch, position] = True
    return marks
