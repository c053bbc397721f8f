"""Phase 2: OUT/prompts minus what is done -> engine -> postprocess -> OUT/data + OUT/failed."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import ray
from ray.data.expressions import col, lit

from eagle_data.out import manifest as mf
from eagle_data.config import Config, SamplingConfig
from eagle_data.job.engines import apply_engine
from eagle_data.model_files import generation_eos_ids, load_tokenizer, special_tokens
from eagle_data.out.folder import Output, new_run_id
from eagle_data.job.postprocess import DATA_SCHEMA, IDS, OUT_SCHEMA, Postprocessor
from eagle_data.job.progress import Progress
from eagle_data.job.ray_internals import bound_queues, read_prompts
from eagle_data.tools.report import write_report
from eagle_data.out.status import SampleStatus
from eagle_data.out.shards import ShardWriter, shard_files
from eagle_data.job.turns import PREVIOUS_COLUMNS, STOPPED_SCHEMA, TurnBuilder, next_user_texts, turn_sample_ids

log = logging.getLogger("eagle_data")

FAILED_SCHEMA = pa.schema([OUT_SCHEMA.field(n) for n in (*IDS, "error")]).append(pa.field("run_id", pa.string()))
PROMPT_COLUMNS = ["sample_id", "source", "messages", "tokenized_prompt"]


def row_seed(seed: int, sample_id: str) -> int:
    """Per-sample seed: reruns reproduce a sample whatever batch it lands in (on vLLM). The
    whole id is hashed: the turns of a conversation share its prefix."""
    digest = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=4).digest(), "big")
    return (seed * 1_000_003 + digest) % (2**31 - 1)


def requests(batch: pa.Table, sampling: dict, stop_ids: list[int]) -> pa.Table:
    """Attach the engine's per-row sampling_params."""
    params = [
        {**sampling, "seed": row_seed(sampling["seed"], sid), "stop_token_ids": stop_ids,
         # We decode in postprocess; the engine need not.
         "detokenize": False}
        for sid in batch.column("sample_id").to_pylist()
    ]
    return batch.append_column("sampling_params", pa.array(params))


def turn_requests(cfg: Config, out: Output, turn: int, finished: ray.ObjectRef,
                  stopped: ShardWriter, run_id: str) -> tuple[ray.data.Dataset | None, int]:
    """(the prompts of turn `turn`, how many there are to ask); (None, 0) when no
    conversation has such a turn. Turns that cannot be asked (the conversation stops there)
    are written to stopped/ here. The count lets the caller skip a pass with nothing to
    ask: starting the engine replicas alone is a model load."""
    if turn == 0:
        files = shard_files(out.fs, out.folder("prompts"))
        if not files:
            return None, 0
        turn0 = {"policy": cfg.prompt.turns, "finished": finished}
        ids = pads.dataset(files, filesystem=out.fs, format="parquet").to_table(columns=["sample_id"])
        ds = read_prompts(files, out.fs, PROMPT_COLUMNS)
        return ds.map_batches(first_turn, batch_format="pyarrow", fn_kwargs=turn0), first_turn(ids, **turn0).num_rows
    users = next_user_texts(out.fs, out.folder("prompts"), turn)
    previous = shard_files(out.fs, out.folder("data"))
    if not users.num_rows or not previous:
        return None, 0
    ds = ray.data.read_parquet(previous, filesystem=out.fs).select_columns(PREVIOUS_COLUMNS)
    ds = ds.filter(expr=col("turn") == lit(turn - 1))
    ds = ds.map_batches(TurnBuilder(
        tokenizer_path=cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code,
        chat_template_kwargs=cfg.prompt.chat_template_kwargs,
        max_prompt_tokens=cfg.engine.max_model_len - cfg.sampling.max_tokens,
        turn=turn, next_users=ray.put(users), finished=finished,
    ), batch_format="pyarrow")
    # A first pass over the small columns records the stops and counts the rest; rendering
    # then runs again for the engine pass: cheap next to generating.
    todo = 0
    for batch in ds.select_columns(STOPPED_SCHEMA.names[:-1]).iter_batches(batch_format="pyarrow", batch_size=None):
        ok = pc.equal(batch.column("reason"), "")
        todo += pc.sum(ok).as_py() or 0
        stopped.add(with_run_id(batch.filter(pc.invert(ok)), run_id))
    return ds.map_batches(askable, batch_format="pyarrow"), todo


def first_turn(batch: pa.Table, policy: str, finished: ray.ObjectRef) -> pa.Table:
    """prompts/ rows (one per conversation) -> turn 0's rows not finished yet."""
    conversation_ids = batch.column("sample_id")
    if policy == "all":
        batch = batch.set_column(0, "sample_id", turn_sample_ids(conversation_ids, 0))
    batch = (batch.append_column("conversation_id", conversation_ids)
             .append_column("turn", pa.array([0] * batch.num_rows, pa.int32())))
    # `finished` is put once by the driver and shared by every task.
    return batch.filter(pc.invert(pc.is_in(batch.column("sample_id"), value_set=ray.get(finished))))


def askable(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.equal(batch.column("reason"), ""))


def with_run_id(batch: pa.Table, run_id: str) -> pa.Table:
    return batch.append_column("run_id", pa.array([run_id] * batch.num_rows, pa.string()))


def engine_sampling(s: SamplingConfig) -> dict:
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}


def run_generate(cfg: Config, out: Output, engine=None) -> dict:
    """`engine(ds, cfg, pad_id) -> ds` replaces the configured engine stage (benchmarks put
    a simulated one there)."""
    engine = engine or apply_engine
    if not out.manifest.prompts_complete():
        raise FileNotFoundError(f"{out.root} has no finished prompts phase: run with --phase prompts (or all) first")
    tokenizer = load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code)
    special = special_tokens(tokenizer, cfg.model.reasoning_start, cfg.model.reasoning_end,
                             generation_eos_ids(cfg.model.path, cfg.model.trust_remote_code))
    if special.reasoning_end_id is None:
        log.warning("%r is not one token of this tokenizer: every generated token counts as response",
                    cfg.model.reasoning_end)
    prompt_counts = out.manifest.phase("prompts")["counts"]
    total = prompt_counts["user_turns"]  # turns to answer (= prompts under first_user)
    before = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts)
    finished = before.finished()
    run_id = new_run_id()
    phase = out.manifest.phase("generate")
    phase["generate_config"] = mf.normalised(mf.generate_config(cfg))
    phase["tokenizer"] = {"path": cfg.model.tokenizer_path, "vocab_size": len(tokenizer),
                          **special.to_dict()}
    run_info = {"run_id": run_id, "started_at": mf.now(), "status": "running",
                "todo": total - len(finished)}
    phase.setdefault("runs", []).append(run_info)
    out.manifest.save()
    log.info("generate: %d turns to answer, %d already done, %d to do", total, len(finished), run_info["todo"])

    data = out.writer("data", DATA_SCHEMA, run_id, cfg, flush=True)
    failed = out.writer("failed", FAILED_SCHEMA, run_id, cfg, flush=True)
    stopped = out.writer("stopped", STOPPED_SCHEMA, run_id, cfg, flush=True)
    progress = Progress(total=total, done_before=len(finished), todo=run_info["todo"],
                        max_tokens=cfg.sampling.max_tokens, every_s=cfg.output.log_every_s,
                        data_writer=data, failed_writer=failed)
    finished_ref = ray.put(pa.array(sorted(finished), pa.string()))
    with progress:
        # One engine pass per turn depth (turns: all): turn d is asked once turn d-1's
        # answers are published (eagle_data/turns.py). first_user has only turn 0.
        for turn in itertools.count() if cfg.prompt.turns == "all" else [0]:
            ds, todo = turn_requests(cfg, out, turn, finished_ref, stopped, run_id)
            if ds is None:
                break
            log.info("generate: turn %d: %d to ask", turn, todo)
            if not todo:
                continue
            ds = ds.map_batches(requests, batch_format="pyarrow", fn_kwargs=dict(
                sampling=engine_sampling(cfg.sampling), stop_ids=list(special.eos_ids)))
            # One engine batch per block: an engine task's output reaches the driver (and a
            # shard) when the task ends, so a block of 1,000 prompts would hold back 1,000
            # finished rows.
            ds = ds.repartition(target_num_rows_per_block=cfg.engine.batch_size)
            ds = engine(ds, cfg, special.pad_id)
            ds = ds.map_batches(Postprocessor(
                tokenizer_path=cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code,
                eos_ids=special.eos_ids, reasoning_start_id=special.reasoning_start_id,
                reasoning_end_id=special.reasoning_end_id, train_on=cfg.mask.train_on,
            ), batch_format="pyarrow")
            # Queued blocks live in the driver: at most the engine's in-flight batches between two steps.
            bound_queues(ds, max_blocks=2 * cfg.engine.max_concurrent_batches * cfg.engine.replicas)
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                ok = pc.equal(batch.column("error"), "")
                good = batch.filter(ok)
                bad = batch.filter(pc.invert(ok))
                data.add(good)
                failed.add(with_run_id(bad, run_id))
                progress.update(good)
            # Publish the rest now: the next turn's pass reads this one's answers.
            for writer in (data, failed, stopped):
                writer.close()
        stopped.close()  # stops found in a pass that then had nothing to ask

    after = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts)
    counts = {
        "prompts": prompt_counts["prompts"],
        "user_turns": total,
        "ok": len(after.ok),
        "failed_final": len(after.given_up),
        "pending_retry": len(after.retryable),
        "failed_rows": sum(after.failures.values()),
        "stopped": len(after.stopped),  # conversations that stopped before their last turn
    }
    run_info.update(status="complete", finished_at=mf.now(), ok=data.written, failed=failed.written,
                    generated_tokens=progress.generated_tokens,
                    wall_s=round(time.monotonic() - progress.started, 1))
    phase["counts"] = counts
    out.manifest.save()
    write_report(out)
    log.info("generate: run %s wrote %d ok, %d failed; OUT totals %s", run_id, data.written,
             failed.written, counts)
    return counts
