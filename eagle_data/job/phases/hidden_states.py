"""Phase 3, hidden states: OUT/data rows -> the target again, prefill only, over their exact
`input_ids` -> OUT/hidden_states (+ OUT/hidden_failed), for trainers that train offline.

    data/ rows (selected, not done) -> requests (a file path per row, for vLLM's connector,
      under hidden_states.scratch_dir on the engine's node)
      -> engine (vLLM's extract_hidden_states + connector, or transformers): the row's
         states as columns (vLLM's file read back on its node and removed)
      -> pack (worker): checks, one shard per batch under OUT/.staging/, each byte written once
      -> driver: moves the shard into hidden_states/ (the commit point); failed rows to
         hidden_failed/

The same guarantees as data/: a sample is done once a shard holding it is published, so a
kill at any moment leaves published shards (kept) and staging files (deleted by the next
run); a rerun does what is not done, and a sample that failed `output.max_attempts` times
is given up. Features go engine -> packer -> OUT's storage, written there once and never read
back; only the small rows reach the driver.
"""

from __future__ import annotations

import logging
import shutil
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import ray

from eagle_data.config import Config
from eagle_data.errors import MissingInput, NotEnoughSpace, NotWritable
from eagle_data.feature_shape import layer_ids, target_shape
from eagle_data.job.fingerprints import hidden_states_config
from eagle_data.job.phases.phase import Phase
from eagle_data.job.progress import EngineWatch, PeriodicLine
from eagle_data.job.ray_internals import one_batch_per_block, read_parquet_in_small_tasks
from eagle_data.job.stages.engines import ENGINE_CLASSES, apply_hidden_states_engine, engine_start_errors
from eagle_data.job.stages.engines.state_files import scratch_folder
from eagle_data.job.stages.pack_hidden_states import HiddenStatesPacker
from eagle_data.job.stages.requests import HiddenStatesRequests
from eagle_data.storage.contract import FAILED_SCHEMA, HIDDEN_FAILED, HIDDEN_STATES, IDS
from eagle_data.storage.folder import Output
from eagle_data.storage.hidden_states import layer_bytes
from eagle_data.storage.selection import selected_rows
from eagle_data.storage.shards import shard_files
from eagle_data.storage.status import SampleStatus
from eagle_data.storage.damage import missing_data_rows, quarantine_hidden_states

log = logging.getLogger("eagle_data")


def run_hidden_states(cfg: Config, out: Output, engine=None) -> dict:
    """`engine(ds, cfg, layer_ids, dtype, scratch_dir) -> ds` replaces the configured engine
    (benchmarks put another one there)."""
    data_files = shard_files(out.fs, out.folder("data"))
    if not data_files:
        raise MissingInput(f"{out.root}/data holds no rows: run the generate phase first")
    missing = missing_data_rows(out, data_files)
    if missing:
        raise MissingInput(f"{missing}: their samples would get no hidden states. Run the generate phase first "
                           f"(`--phase generate` or `all`: it answers them again); `python -m eagle_data verify "
                           f"{out.root}` names them")
    if not isinstance(out.fs, pafs.LocalFileSystem):
        raise NotWritable(f"the hidden-states phase needs output.path on a local or mounted filesystem "
                          f"(every node's engine writes its files there), not {cfg.output.path!r}")
    if not out.manifest.finished("generate"):
        log.warning("hidden states: the latest generate run did not finish; rows it adds later get their "
                    "hidden states on the next run of this phase")
    num_layers, hidden_size = target_shape(cfg)
    ids, dtype = layer_ids(cfg, num_layers), cfg.hidden_states.dtype
    quarantine_hidden_states(out)  # damaged or stale entries: their shards' samples are redone
    selected = selected_rows(out.fs, out.folder("data"), cfg.hidden_states.finish_reason, cfg.hidden_states.source)
    status = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts, "hidden_states")
    todo = selected.filter(pc.invert(pc.is_in(selected.column("sample_id"),
                                              pa.array(sorted(status.finished()), pa.string()))))
    tokens = pc.sum(todo.column("num_tokens")).as_py() or 0
    estimate = layer_bytes(tokens, len(ids), hidden_size, dtype)
    log.info("hidden states: %d rows selected, %d done, %d given up, %d to do; layer ids %s of %d, H %d, %s: "
             "%d tokens -> %s", selected.num_rows, len(status.ok & set(selected.column("sample_id").to_pylist())),
             len(status.given_up), todo.num_rows, ids, num_layers, hidden_size, dtype, tokens, gib(estimate))
    check_space(out, estimate)
    run = out.manifest.start_run("hidden_states", cfg.model_dump(mode="json"), {
        "hidden_states_config": hidden_states_config(cfg),
        "features": {"layer_ids": ids, "final_norm": "pre", "dtype": dtype, "hidden_size": hidden_size,
                     "num_layers": num_layers},
    }, todo=todo.num_rows, estimate_bytes=estimate)
    failed = out.writer(HIDDEN_FAILED, FAILED_SCHEMA, run["run_id"], cfg.output.rows_per_shard, cfg.output.flush_seconds)
    publisher = Publisher(out, run["run_id"], failed, total=todo.num_rows, every_s=cfg.output.log_every_s)
    if todo.num_rows:  # starting the engine replicas alone is a model load
        scratch = scratch_folder(cfg.hidden_states.scratch_dir, out.manifest.out_id, run["run_id"])
        ds = read_parquet_in_small_tasks(data_files, out.fs, [*IDS, "input_ids"])
        ds = ds.map_batches(HiddenStatesRequests(ray.put(todo.column("sample_id").combine_chunks()), scratch),
                            batch_format="pyarrow")
        ds = one_batch_per_block(ds, cfg.engine.batch_size)
        ds = (engine or apply_hidden_states_engine)(ds, cfg, ids, dtype, scratch)
        ds = ds.map_batches(HiddenStatesPacker(out.root, run["run_id"], ids, hidden_size, dtype,
                                               out.manifest.shard_metadata(HIDDEN_STATES, run["run_id"])),
                            batch_size=cfg.hidden_states.rows_per_shard, batch_format="pyarrow")
        with publisher, engine_start_errors(cfg):
            publisher.publish(ds)
    failed.close()
    counts = phase_counts(out, cfg)
    out.manifest.finish_run("hidden_states", run, counts, ok=publisher.ok, failed=failed.written,
                            tokens=publisher.tokens, bytes=publisher.bytes,
                            wall_s=round(time.monotonic() - publisher.started, 1),
                            engine_load_s=[round(t, 1) for t in publisher.engine.load_s])
    log.info("hidden states: run %s published %d rows (%d tokens, %s), %d failed; OUT totals %s",
             run["run_id"], publisher.ok, publisher.tokens, gib(publisher.bytes), failed.written, counts)
    return counts


def phase_counts(out: Output, cfg: Config) -> dict:
    """The phase's counts over every run so far, from the shards."""
    status = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts, "hidden_states")
    selected = set(selected_rows(out.fs, out.folder("data"), cfg.hidden_states.finish_reason,
                                 cfg.hidden_states.source).column("sample_id").to_pylist())
    return {"selected": len(selected), "ok": len(status.ok & selected), "failed_final": len(status.given_up),
            "pending_retry": len(status.retryable), "failed_rows": sum(status.failures.values())}


def check_space(out: Output, estimate: int) -> None:
    free = shutil.disk_usage(out.root).free
    if estimate > free:
        raise NotEnoughSpace(f"the hidden-states phase needs about {gib(estimate)} (tokens x layers x H x dtype "
                             f"bytes) and {out.root} has {gib(free)} free: free space, choose fewer rows "
                             "(hidden_states.finish_reason / source), fewer layers, or another output.path")


def gib(n: int) -> str:
    """A byte count for a log line: 1000 B, 3.2 MiB, 2.07 TiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class Publisher:
    """The driver's side: moves each packed shard into hidden_states/ and records failures;
    the progress line every `every_s`, with what the engine is doing (loading the model,
    rows in it), also while no row arrives."""

    def __init__(self, out: Output, run_id: str, failed, total: int, every_s: float):
        self.out, self.run_id, self.failed, self.total, self.every_s = out, run_id, failed, total, every_s
        self.ok = self.tokens = self.bytes = self.shards = 0
        self.published: set[str] = set()
        self.started = time.monotonic()
        self.engine = EngineWatch(ENGINE_CLASSES)
        self._periodic = PeriodicLine(every_s, self.line, poll=self.engine.poll, name="eagle-hidden-progress")

    def publish(self, ds: ray.data.Dataset) -> None:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            bad = pc.not_equal(batch.column("error"), "")
            rows = batch.filter(bad)
            self.failed.add(rows.select(list(IDS)).append_column("error", rows.column("error")).append_column(
                "run_id", pa.array([self.run_id] * rows.num_rows, pa.string())))
            good = batch.filter(pc.invert(bad))
            for shard in pc.unique(good.column("shard")).to_pylist():
                self._commit(shard, good.filter(pc.equal(good.column("shard"), shard)))

    def _commit(self, shard: str, rows: pa.Table) -> None:
        ids = rows.column("sample_id").to_pylist()
        if self.published & set(ids):  # a retried task's second copy: never publish a sample twice
            log.warning("hidden states: dropping a repeated shard of %d rows", len(ids))
            self.out.fs.delete_file(shard)
            return
        size = self.out.fs.get_file_info(shard).size
        self.out.fs.create_dir(self.out.folder(HIDDEN_STATES), recursive=True)
        self.out.fs.move(shard, f"{self.out.folder(HIDDEN_STATES)}/part-{self.run_id}-{self.shards:05d}.safetensors")
        self.shards += 1
        self.published.update(ids)
        self.ok += len(ids)
        self.tokens += pc.sum(rows.column("num_tokens")).as_py() or 0
        self.bytes += size

    def line(self) -> str:
        rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
        return (f"hidden states: {self.ok}/{self.total} rows published | {self.engine.line()} | "
                f"{self.failed.written + self.failed.buffered} failed attempts | {self.tokens} tokens, "
                f"{rate:.0f} prefill tok/s | {gib(self.bytes)} written")

    def __enter__(self) -> "Publisher":
        self._periodic.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._periodic.__exit__(*exc)


def summary(out: str, counts: dict) -> list[str]:
    return [f"  hidden_states/ {counts['ok']} of {counts['selected']} selected samples; {counts['failed_rows']} "
            f"failed attempts, {counts['failed_final']} gave up, {counts['pending_retry']} to retry"]


def empty(cfg: Config, out: Output) -> str | None:
    """Why a finished hidden-states phase selected no data/ row, or None."""
    counts = out.manifest.counts("hidden_states")
    if not out.manifest.finished("hidden_states") or counts.get("selected") != 0:
        return None
    hs = cfg.hidden_states
    return (f"0 rows selected for hidden states: no data/ row has hidden_states.source {hs.source} and "
            f"hidden_states.finish_reason {hs.finish_reason} (null: any). Correct the filter and rerun "
            "(a run that published no rows binds no config), or pass --allow-empty to accept an empty result")


PHASE = Phase("hidden_states", hidden_states_config, run_hidden_states, summary,
              in_all=lambda cfg: cfg.hidden_states.enabled, empty=empty)
