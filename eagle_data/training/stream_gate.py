"""The feature stream's gate (training/stream.py's `features(gate=NAME)`): one Ray actor per
stream, named NAME, that is both the stream's count and its bound, and the trainer's end of
it.

    StreamGate        the actor. Counts each epoch's rows that passed the checks and those
                      that failed (once per place of the epoch's order, whichever execution
                      computed it), and admits each chunk the stream's read tasks ask for
                      while the bytes in flight stay within the bound (docs/streaming.md,
                      "The bound"); the places a resumed trainer had trained on are left out
    stream_batches    a Ray Train worker's batches of the stream: tells the gate what it
                      joined with, what it took (the bound's other end) and, resumed, the
                      places it had trained on (`consumed_places` makes them)
    gate_summary      what a stream's gate counted so far, and `summary_line`, that as one line

The pipeline that asks the gate (read_chunk) and reports to it (Checks) is training/stream.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Iterator

import numpy as np
import ray

log = logging.getLogger("eagle_data")

# The rows a trainer's stream_batches may hold besides its prefetched batches: the one its loop
# works on, and a block on its way.
WINDOW_EXTRA_BATCHES = 2
# stream_batches' prefetch when none is given: at most this many batches, fewer where the
# trainers' windows would take more than half of the stream's bound.
MAX_PREFETCH = 4


@ray.remote(num_cpus=0, max_concurrency=64)  # threads: a read task waits in admit while rows are taken
class StreamGate:
    """The stream's count: each epoch's rows that passed the checks and those that did not,
    with their reasons, once per place in the epoch's order (a bit per place: after Ray Train
    restarts its workers, the stream runs again, and a place computed twice counts once); a
    progress line every `every_s` while rows come and one line per finished epoch.

    And its bound (`bound`: limit, world_size, chunk, replicas, max_row_bytes; none: it only
    counts): `admit` lets a chunk of places be asked of the engines while the bytes of
    the rows asked and not yet taken stay within the limit, `taken` (stream_batches) frees
    them, a failed check too. Bounded only while trainers have joined (stream_batches); the
    gate always lets `floor_rows` rows through, what the trainers' windows and Ray's equal
    split may hold back. A trainer group that joins in place of another (Ray Train started
    its workers again: a new execution) starts the gate's count afresh, and `resume` names
    the places a restored trainer had trained on, which are not asked again."""

    def __init__(self, name: str, per_epoch: int, epochs: int, every_s: float, bound: dict | None = None):
        self.name, self.per_epoch, self.epochs, self.every_s = name, per_epoch, epochs, every_s
        self.passed = np.zeros((epochs, per_epoch), bool)
        self.failed: dict[tuple[int, int], tuple[str, str]] = {}  # (epoch, position) -> (sample_id, reason)
        self.logged: set[int] = set()
        self.checked = 0  # rows checked, places computed again included
        self.started = self.last = time.monotonic()
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        bound = bound or {}
        self.limit = bound.get("limit")
        self.world_size, self.chunk = bound.get("world_size", 1), bound.get("chunk", 1)
        self.replicas, self.max_row_bytes = bound.get("replicas", 1), bound.get("max_row_bytes", 0)
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


def gate_summary(name: str, namespace: str | None = None) -> dict:
    """What the stream's gate counted so far (`StreamGate.summary`); `namespace`: the Ray
    namespace of the driver that started the stream, from another driver."""
    return ray.get(ray.get_actor(name, namespace=namespace).summary.remote())


def summary_line(summary: dict) -> str:
    """A gate's summary (gate_summary) as one line: the draft trainer's summary prints it."""
    failed = sum(sum(e["failed"].values()) for e in summary["epochs"].values())
    f = summary["figures"]
    return (f"{summary['per_epoch']} samples an epoch, {failed} failed checks; {f['rows_per_s']:.2f} rows/s, "
            f"{f['tokens_per_s']:.0f} tokens/s, peak {size(f['peak_bytes_in_flight'])} in flight (bound "
            f"{size(f['bound_bytes'] or 0)}), engines busy {percent(f['engine_busy_share'])}, trainers waited "
            f"{percent(f['trainer_wait_share'])}; {f['trainer_groups']} trainer group"
            f"{'s' if f['trainer_groups'] != 1 else ''} (more than 1: Ray Train started its workers again)")


def stream_batches(shard, stream: str, *, batch_size: int, prefetch_batches: int | None = None,
                   consumed: np.ndarray | None = None, rank: int | None = None,
                   namespace: str | None = None) -> Iterator[dict]:
    """A Ray Train worker's batches of the stream whose gate is `stream` (features(gate=...)):
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
    worker = ray.get_runtime_context().get_actor_id() or f"pid-{os.getpid()}"
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


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def reasons(failed: Counter) -> str:
    return "" if not failed else " (" + "; ".join(f"{n} x {why}" for why, n in failed.most_common()) + ")"
