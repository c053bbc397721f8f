"""The progress lines of the engine phases, logged every `output.log_every_s` seconds
(`PeriodicLine`), and the generate phase's (`Progress`).

Its counts are exact: done/ok/failed are the rows published to OUT (the shard writers'
counts), and the driver receives every row whichever node produced it. Work of earlier runs on the same OUT
is included. A background thread logs on time even while no row arrives (long stragglers).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle_data.job.ray_internals import engine_pool
from eagle_data.job.stages.engines.stats import engine_stats

log = logging.getLogger("eagle_data")

RECENT_WINDOW_S = 300


class Progress:
    def __init__(self, total: int, done_before: int, todo: int, max_tokens: int, every_s: float,
                 data_writer, failed_writer, on_line=None, engine=None):
        """`on_line()` is called before each line, from the logging thread; `engine` (an
        EngineWatch) is polled every second and says what the engine is doing."""
        self.total, self.done_before, self.todo, self.every_s = total, done_before, todo, every_s
        self.on_line = on_line or (lambda: None)
        self.engine = engine
        self.data_writer, self.failed_writer = data_writer, failed_writer
        self.received = self.generated_tokens = self.length_finishes = 0
        # Completion lengths as a histogram: exact mean/p95 in memory independent of row count.
        self.lengths = np.zeros(max_tokens + 1, dtype=np.int64)
        self.started = time.monotonic()
        self.samples = collections.deque([(self.started, 0, 0)])  # (time, rows, tokens)
        self._lock = threading.Lock()
        self._periodic = PeriodicLine(every_s, self._logged_line, poll=engine.poll if engine else None)

    def update(self, ok: pa.Table) -> None:
        """Token statistics of the ok rows the driver received."""
        completion = (pc.add(ok.column("num_reasoning_tokens"), ok.column("num_response_tokens"))
                      .to_numpy(zero_copy_only=False)) if ok.num_rows else np.empty(0, int)
        with self._lock:
            self.received += ok.num_rows
            self.generated_tokens += int(completion.sum())
            np.add.at(self.lengths, np.minimum(completion, len(self.lengths) - 1), 1)
            if ok.num_rows:
                self.length_finishes += pc.sum(pc.equal(ok.column("finish_reason"), "length")).as_py() or 0

    def line(self) -> str:
        engine = f"{self.engine.line()} | " if self.engine else ""
        with self._lock:
            now = time.monotonic()
            ok, failed = self.data_writer.written, self.failed_writer.written
            rows = ok + failed
            self.samples.append((now, rows, self.generated_tokens))
            while len(self.samples) > 2 and now - self.samples[1][0] > RECENT_WINDOW_S:
                self.samples.popleft()
            t0, rows0, tokens0 = self.samples[0]
            elapsed, window = max(now - self.started, 1e-9), max(now - t0, 1e-9)
            rate, recent_rate = rows / elapsed, (rows - rows0) / window
            n = int(self.lengths.sum())
            mean = float((self.lengths * np.arange(len(self.lengths))).sum() / n) if n else 0.0
            p95 = int(np.searchsorted(np.cumsum(self.lengths), 0.95 * n)) if n else 0
            done = self.done_before + rows
            eta_rate = recent_rate or rate
            eta = (self.todo - rows) / eta_rate if eta_rate > 0 else float("inf")
            return (
                f"progress: {done}/{self.total} done ({100 * done / max(self.total, 1):.1f}%) | {engine}"
                f"this run ok {ok} failed {failed} | "
                f"rows/s {recent_rate:.2f} recent, {rate:.2f} run | "
                f"gen tok/s {(self.generated_tokens - tokens0) / window:.0f} recent, "
                f"{self.generated_tokens / elapsed:.0f} run | "
                f"completion tokens mean {mean:.0f} p95 {p95} | "
                f"length-finished {100 * self.length_finishes / max(self.received, 1):.1f}% | "
                f"ETA {_duration(eta)}"
            )

    def _logged_line(self) -> str:
        self.on_line()
        return self.line()

    def __enter__(self) -> "Progress":
        self._periodic.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._periodic.__exit__(*exc)


class PeriodicLine:
    """Logs `line()` every `every_s` seconds from a background thread, on time also while no
    row arrives (long stragglers), and once more at the end; `poll()` (what the engine is
    doing) is called every second in between."""

    def __init__(self, every_s: float, line, poll=None, name: str = "eagle-progress"):
        self.every_s, self.line, self.poll = every_s, line, poll or (lambda: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def _run(self) -> None:
        due = time.monotonic() + self.every_s
        while not self._stop.wait(min(1.0, self.every_s)):
            self.poll()
            if time.monotonic() >= due:
                due += self.every_s
                log.info(self.line())

    def __enter__(self) -> "PeriodicLine":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        log.info(self.line())


class EngineWatch:
    """What the engine is doing, for the progress line, from Ray Data's operator state and
    the replicas' own counters (vLLM's): replicas loading the model (a replica loads it in
    its constructor) or restarting (its node was lost), rows in the engine, and vLLM's
    running/waiting requests and generated tokens/s. Rows reach OUT only when a whole
    engine batch is done, so this is what moves while the done count does not."""

    def __init__(self, class_names: tuple[str, ...]):
        self.class_names = class_names
        self.pool: dict | None = None
        self.starting_since: float | None = None
        self.load_s: list[float] = []  # how long each spell of loading the model lasted
        self.last_tokens: tuple[float, int] | None = None  # (time, generated tokens) at the last line

    def poll(self) -> None:
        """Poll the engine operator (in-process, cheap): called every second."""
        self.pool = engine_pool(self.class_names)
        now = time.monotonic()
        if self.pool and self.pool["starting"]:
            self.starting_since = self.starting_since or now
        elif self.starting_since is not None:
            self.load_s.append(now - self.starting_since)
            self.starting_since = None

    def line(self) -> str:
        """The engine's part of the progress line."""
        pool = self.pool
        if pool is None:
            return "engine: not started"
        now = time.monotonic()
        parts = []
        if self.starting_since is not None:
            parts.append(f"{pool['starting']} replica(s) loading the model ({_duration(now - self.starting_since)})")
        if pool["restarting"]:
            parts.append(f"{pool['restarting']} replica(s) restarting")
        parts.append(f"{pool['running']} replica(s) up, {pool['rows_in_engine']} rows in the engine")
        stats = engine_stats()
        if stats:
            tokens = sum(s["generated_tokens"] for s in stats)
            then, before = self.last_tokens or (now, tokens)
            self.last_tokens = (now, tokens)
            # a replica's counters leave the sum when it stops publishing: never a negative rate
            rate = max(tokens - before, 0) / (now - then) if now > then else 0.0
            parts.append(f"vLLM {sum(s['running'] for s in stats)} running {sum(s['waiting'] for s in stats)} "
                         f"waiting, {rate:.0f} tok/s")
        return "engine: " + ", ".join(parts)


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "unknown"
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s"
