"""Phase 2, generate (engine): OUT/prompts minus what is done -> engine -> postprocess ->
OUT/data + OUT/failed (+ OUT/stopped under turns: all).

Every turn depth (turns: all) goes through one pipeline, so the engine replicas load once
per run; turn d is asked once turn d-1's answers are published (job/stages/feed.py,
job/stages/turns.py). first_user has only turn 0.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import ray
from ray.data.expressions import col, lit

from eagle_data.config import Config
from eagle_data.errors import MissingInput
from eagle_data.job.stages.engines import ENGINE_CLASSES, apply_engine, engine_start_errors
from eagle_data.job.fingerprints import generate_config
from eagle_data.job.phases.phase import Phase
from eagle_data.job.stages.feed import drive
from eagle_data.job.stages.postprocess import Postprocessor
from eagle_data.job.stages.requests import DropStoppedTurns, Requests, UnfinishedFirstTurns, engine_sampling
from eagle_data.job.progress import EngineWatch, Progress
from eagle_data.job.ray_internals import actor_nodes, bound_queues, one_batch_per_block, read_parquet_in_small_tasks
from eagle_data.job.stages.turns import PREVIOUS_COLUMNS, TurnBuilder, next_user_texts
from eagle_data.model_files import SpecialTokens, generation_eos_ids, load_tokenizer, model_vocab_size, special_tokens
from eagle_data.storage.contract import ERROR, FAILED_SCHEMA, STOPPED_SCHEMA, data_schema
from eagle_data.storage.files import filesystem
from eagle_data.storage.folder import Output
from eagle_data.storage.manifest import Manifest
from eagle_data.storage.shards import ShardWriter, shard_files
from eagle_data.storage.status import SampleStatus

log = logging.getLogger("eagle_data")

PROMPT_COLUMNS = ["sample_id", "source", "prompt_id", "answer", "variant", "messages", "tokenized_prompt"]


def run_generate(cfg: Config, out: Output, engine=None) -> dict:
    """Record the run, answer every turn depth, record the totals. `engine(ds, cfg, pad_id)
    -> ds` replaces the configured engine stage (benchmarks put a simulated one there); like
    it, it must take each block as one batch (map_batches' batch_size=None): the blocks are
    engine batches, and one held back for more rows would wait forever (job/stages/feed.py)."""
    if not out.manifest.finished("prompts"):
        raise MissingInput(f"{out.root} has no finished prompts phase: run with --phase prompts (or all) first")
    special, run, total, finished = start_run(cfg, out)
    shard = (cfg.output.rows_per_shard, cfg.output.flush_seconds)
    data = data_schema(cfg.sampling.logprobs, cfg.sampling.logprobs_dtype)
    writers = {name: out.writer(name, schema, run["run_id"], *shard)
               for name, schema in (("data", data), ("failed", FAILED_SCHEMA), ("stopped", STOPPED_SCHEMA))}
    replicas = ReplicaNodes()
    by_engine = cfg.prompt.answers == "target"  # the dataset's own answers start no engine
    progress = Progress(total=total, done_before=len(finished), todo=total - len(finished),
                        max_tokens=cfg.sampling.max_tokens, every_s=cfg.output.log_every_s,
                        data_writer=writers["data"], failed_writer=writers["failed"],
                        on_line=replicas.poll if by_engine else None,
                        engine=EngineWatch(ENGINE_CLASSES) if by_engine else None)
    with progress:
        answer_turns(cfg, out, special, finished, writers, progress, run["run_id"], engine or apply_engine)
    return finish_run(cfg, out, run, total, writers, progress, replicas)


def start_run(cfg: Config, out: Output) -> tuple[SpecialTokens, dict, int, set[str]]:
    """The target's token ids, the run's record, the turns to answer and those already finished."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code)
    special = target_tokens(cfg, tokenizer)
    total = out.manifest.counts("prompts")["user_turns"]  # turns to answer (= prompts under first_user)
    finished = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts).finished()
    run = out.manifest.start_run("generate", cfg.model_dump(mode="json"), {
        "generate_config": generate_config(cfg),
        "answered_by": cfg.prompt.answers,
        "tokenizer": {"path": cfg.model.tokenizer_path, "vocab_size": len(tokenizer), **special.to_dict(),
                      **target_vocab(cfg)},
    }, todo=total - len(finished), answered_by=cfg.prompt.answers)
    log.info("generate: %d turns to answer, %d already done, %d to do", total, len(finished), total - len(finished))
    return special, run, total, finished


def answer_turns(cfg: Config, out: Output, special: SpecialTokens, finished: set[str], writers: dict,
                 progress: Progress, run_id: str, engine) -> None:
    """Every turn depth (turns: all) through one pipeline, so the engine replicas load once:
    depth d is sent to it once depth d-1's answers are all published (job/stages/feed.py)."""
    finished_ref = ray.put(pa.array(sorted(finished), pa.string()))  # shared by every task
    depths = depths_to_ask(cfg, out, special, finished_ref, writers, run_id)
    with engine_start_errors(cfg):
        drive(depths, lambda source: answers(source, cfg, special, engine),
              lambda batch: publish(batch, writers["data"], writers["failed"], progress, run_id),
              single_depth=cfg.prompt.turns != "all")  # first_user: its only depth


def depths_to_ask(cfg: Config, out: Output, special: SpecialTokens, finished: ray.ObjectRef, writers: dict,
                  run_id: str) -> Iterator[tuple[ray.data.Dataset, int]]:
    """(engine requests, how many) of each turn depth that has any to ask (first_user: turn
    0 only), in blocks of one engine batch. Each depth is built once every earlier answer is
    published: its prompts hold those answers."""
    for turn in itertools.count() if cfg.prompt.turns == "all" else [0]:
        publish_the_rest(writers)  # this depth reads these answers
        if turn == 0:
            ds, to_ask = first_turn_prompts(cfg, out, finished)
        else:
            ds = later_turn_prompts(cfg, out, turn, finished)
            if ds is not None:
                to_ask = record_stops(ds, writers["stopped"], run_id)
                ds = ds.map_batches(DropStoppedTurns(), batch_format="pyarrow")
        if ds is None:
            break
        log.info("generate: turn %d: %d to ask", turn, to_ask)
        if to_ask:  # starting the engine replicas alone is a model load
            yield engine_requests(ds, cfg, special), to_ask
    publish_the_rest(writers)  # the last depth's


def publish_the_rest(writers: dict) -> None:
    for writer in writers.values():
        writer.close()


def finish_run(cfg: Config, out: Output, run: dict, total: int, writers: dict, progress: Progress,
               replicas: "ReplicaNodes") -> dict:
    counts = phase_counts(out, cfg, total)
    nodes = replicas.report() if cfg.prompt.answers == "target" else None  # no engine, no replicas
    data, failed = writers["data"], writers["failed"]
    out.manifest.finish_run("generate", run, counts, ok=data.written, failed=failed.written,
                            generated_tokens=progress.generated_tokens,
                            wall_s=round(time.monotonic() - progress.started, 1),
                            engine_load_s=[round(s, 1) for s in progress.engine.load_s] if progress.engine else [],
                            **({"replica_nodes": nodes} if nodes is not None else {}))
    log.info("generate: run %s wrote %d ok, %d failed; OUT totals %s", run["run_id"], data.written,
             failed.written, counts)
    return counts


class ReplicaNodes:
    """The Ray nodes this run's engine replicas ran on, looked up at every progress line
    and at the end: a replica restarted on another node after its node died is seen on
    both (Ray's state API knows only its latest node)."""

    def __init__(self):
        self.seen: set[str] | None = None  # None: the state API never answered

    def poll(self) -> None:
        nodes = actor_nodes(ENGINE_CLASSES)
        if nodes is not None:
            self.seen = (self.seen or set()) | set(nodes)

    def report(self) -> list[str] | None:
        if self.seen is None:
            log.info("generate: engine replica nodes not recorded (Ray's state API needs the dashboard)")
            return None
        log.info("generate: engine replicas ran on %d node(s): %s", len(self.seen), ", ".join(sorted(self.seen)) or "none")
        return sorted(self.seen)


def target_tokens(cfg: Config, tokenizer) -> SpecialTokens:
    special = special_tokens(tokenizer, cfg.model.reasoning_start, cfg.model.reasoning_end,
                             generation_eos_ids(cfg.model.path, cfg.model.trust_remote_code))
    if special.reasoning_end_id is None:
        log.warning("%r is not one token of this tokenizer: every generated token counts as response",
                    cfg.model.reasoning_end)
    return special


def target_vocab(cfg: Config) -> dict:
    """The model's embedding rows, for the draft vocabulary tool (t2d has this length)."""
    size, where = model_vocab_size(cfg.model.path, cfg.model.trust_remote_code)
    return {"model_vocab_size": size, "model_vocab_size_from": where}


def first_turn_prompts(cfg: Config, out: Output, finished: ray.ObjectRef) -> tuple[ray.data.Dataset | None, int]:
    """(prompts/ rows as turn 0 requests not finished yet, how many); (None, 0) without prompts."""
    files = shard_files(out.fs, out.folder("prompts"))
    if not files:
        return None, 0
    first_turn = UnfinishedFirstTurns(cfg.prompt.turns, finished)
    ids = pads.dataset(files, filesystem=out.fs, format="parquet").to_table(columns=["sample_id"])
    # The dataset's own answers, tokenized by the prompts phase (prompt.answers=dataset).
    answers = ["answer_ids"] if cfg.prompt.answers == "dataset" else []
    ds = read_parquet_in_small_tasks(files, out.fs, PROMPT_COLUMNS + answers)
    return ds.map_batches(first_turn, batch_format="pyarrow"), first_turn.unfinished(ids).num_rows


def later_turn_prompts(cfg: Config, out: Output, turn: int, finished: ray.ObjectRef) -> ray.data.Dataset | None:
    """Turn `turn`'s prompts built from turn `turn - 1`'s answers in data/, with `reason`
    set where the conversation stops; None when no conversation has such a turn."""
    users = next_user_texts(out.fs, out.folder("prompts"), turn)
    previous = shard_files(out.fs, out.folder("data"))
    if not users.num_rows or not previous:
        return None
    ds = ray.data.read_parquet(previous, filesystem=out.fs).select_columns(PREVIOUS_COLUMNS)
    ds = ds.filter(expr=col("turn") == lit(turn - 1))
    return ds.map_batches(TurnBuilder.from_config(cfg, turn, ray.put(users), finished), batch_format="pyarrow")


def record_stops(ds: ray.data.Dataset, stopped: ShardWriter, run_id: str) -> int:
    """Write the turns that cannot be asked to stopped/; the number that can. A pass over
    the small columns: rendering then runs again for the engine pass, cheap next to generating."""
    to_ask = 0
    for batch in ds.select_columns(STOPPED_SCHEMA.names[:-1]).iter_batches(batch_format="pyarrow", batch_size=None):
        ok = pc.equal(batch.column("reason"), "")
        to_ask += pc.sum(ok).as_py() or 0
        stopped.add(with_run_id(batch.filter(pc.invert(ok)), run_id))
    return to_ask


def engine_requests(ds: ray.data.Dataset, cfg: Config, special: SpecialTokens) -> ray.data.Dataset:
    """Prompts -> engine requests, one engine batch per block: finished rows leave the
    engine batch by batch, and the engine stage takes each block as one batch."""
    ds = ds.map_batches(Requests(engine_sampling(cfg), cfg.sampling.seed, list(special.eos_ids),
                                 sampled=cfg.prompt.answers == "target"), batch_format="pyarrow")
    return one_batch_per_block(ds, cfg.engine.batch_size)


def answers(ds: ray.data.Dataset, cfg: Config, special: SpecialTokens, engine) -> ray.data.Dataset:
    """Requests -> engine -> postprocess: rows for data/ and failed/."""
    ds = engine(ds, cfg, special.pad_id)
    ds = ds.map_batches(Postprocessor.from_config(cfg, special), batch_format="pyarrow")
    # Queued blocks live in the driver: at most the engine's in-flight batches between two steps.
    bound_queues(ds, max_blocks=2 * cfg.engine.max_concurrent_batches * cfg.engine.replicas)
    # Ray Data reserves CPUs per operator and frees an operator's share when its inputs end;
    # this source ends only after the last depth, so on a 2-CPU node the idle preprocess map
    # kept the CPU the postprocess needed, and the pipeline stopped (tests/vllm, turns: all).
    ds.context.op_resource_reservation_enabled = False
    return ds


def publish(batch: pa.Table, data: ShardWriter, failed: ShardWriter, progress: Progress, run_id: str) -> None:
    ok = pc.equal(batch.column(ERROR), "")
    good = batch.filter(ok)
    data.add(good)
    failed.add(with_run_id(batch.filter(pc.invert(ok)), run_id))
    progress.update(good)


def with_run_id(batch: pa.Table, run_id: str) -> pa.Table:
    return batch.append_column("run_id", pa.array([run_id] * batch.num_rows, pa.string()))


def phase_counts(out: Output, cfg: Config, user_turns: int) -> dict:
    """The phase's counts over every run so far, from the shards."""
    status = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts)
    return {
        "prompts": out.manifest.counts("prompts")["prompts"],
        "conversations": out.manifest.counts("prompts")["conversations"],  # prompts x answers_per_prompt
        "user_turns": user_turns,
        "ok": len(status.ok),
        "failed_final": len(status.given_up),
        "pending_retry": len(status.retryable),
        "failed_rows": sum(status.failures.values()),
        "stopped": len(status.stopped),  # conversations that stopped before their last turn
    }


def summary(out: str, counts: dict) -> list[str]:
    turns = f" of {counts['user_turns']} user turns" if counts["user_turns"] != counts["conversations"] else ""
    fs, root = filesystem(out)
    by = " (the dataset's own answers)" if Manifest(fs, root).phase("generate").get("answered_by") == "dataset" else ""
    lines = [f"  data/     {counts['ok']} ok samples{turns}{by}",
             f"  failed/   {counts['failed_rows']} failed attempts; {counts['failed_final']} samples gave up, "
             f"{counts['pending_retry']} to retry (rerun the same command)"]
    if counts["stopped"]:
        lines.append(f"  stopped/  {counts['stopped']} conversations stopped before their last turn")
    example = first_sample(out)
    if example:
        lines.append(f"  example:  Q: {example['messages'][-1]['content'][:200]!r}")
        lines.append(f"            A: {example['response'][:300]!r}")
    return lines


def first_sample(out: str) -> dict | None:
    fs, root = filesystem(out)
    files = shard_files(fs, f"{root}/data")
    if not files:
        return None
    table = pq.read_table(files[0], filesystem=fs, columns=["messages", "response"])
    return table.slice(0, 1).to_pylist()[0]


PHASE = Phase("generate", generate_config, run_generate, summary, reads=("prompts",))
