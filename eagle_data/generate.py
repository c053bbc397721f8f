"""Phase 2: OUT/prompts minus what is done -> engine -> postprocess -> OUT/data + OUT/failed."""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pyarrow.compute as pc
import ray

from eagle_data import manifest as mf
from eagle_data.config import Config, SamplingConfig
from eagle_data.engines import apply_engine
from eagle_data.model_files import generation_eos_ids, load_tokenizer, special_tokens
from eagle_data.output import Output, new_run_id
from eagle_data.postprocess import DATA_SCHEMA, OUT_SCHEMA, Postprocessor
from eagle_data.progress import Progress
from eagle_data.queues import bound_queues, read_prompts
from eagle_data.report import write_report
from eagle_data.resume import SampleStatus
from eagle_data.sink import shard_files

log = logging.getLogger("eagle_data")

FAILED_SCHEMA = pa.schema([OUT_SCHEMA.field("sample_id"), OUT_SCHEMA.field("source"),
                           OUT_SCHEMA.field("error"), pa.field("run_id", pa.string())])
PROMPT_COLUMNS = ["sample_id", "source", "messages", "tokenized_prompt"]


def row_seed(seed: int, sample_id: str) -> int:
    """Per-sample seed: reruns reproduce a sample whatever batch it lands in (on vLLM)."""
    return (seed * 1_000_003 + int(sample_id[:8], 16)) % (2**31 - 1)


def requests(batch: pa.Table, finished: ray.ObjectRef, sampling: dict, stop_ids: list[int]) -> pa.Table:
    """Drop finished samples; attach the engine's per-row sampling_params."""
    finished = ray.get(finished)  # put once by the driver, shared by every task
    batch = batch.filter(pc.invert(pc.is_in(batch.column("sample_id"), value_set=finished)))
    params = [
        {**sampling, "seed": row_seed(sampling["seed"], sid), "stop_token_ids": stop_ids,
         # We decode in postprocess; the engine need not.
         "detokenize": False}
        for sid in batch.column("sample_id").to_pylist()
    ]
    return batch.append_column("sampling_params", pa.array(params))


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
    total = out.manifest.phase("prompts")["counts"]["prompts"]
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
    log.info("generate: %d prompts, %d already done, %d to do", total, len(finished), run_info["todo"])

    ds = read_prompts(shard_files(out.fs, out.folder("prompts")), out.fs, PROMPT_COLUMNS)
    ds = ds.map_batches(requests, batch_format="pyarrow", fn_kwargs=dict(
        finished=ray.put(pa.array(sorted(finished), pa.string())),
        sampling=engine_sampling(cfg.sampling), stop_ids=list(special.eos_ids),
    ))
    # One engine batch per block: an engine task's output reaches the driver (and a shard)
    # when the task ends, so a block of 1,000 prompts would hold back 1,000 finished rows.
    ds = ds.repartition(target_num_rows_per_block=cfg.engine.batch_size)
    ds = engine(ds, cfg, special.pad_id)
    ds = ds.map_batches(Postprocessor(
        tokenizer_path=cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code,
        eos_ids=special.eos_ids, reasoning_start_id=special.reasoning_start_id,
        reasoning_end_id=special.reasoning_end_id, train_on=cfg.mask.train_on,
    ), batch_format="pyarrow")
    # Queued blocks live in the driver: at most the engine's in-flight batches between two steps.
    bound_queues(ds, max_blocks=2 * cfg.engine.max_concurrent_batches * cfg.engine.replicas)

    data = out.writer("data", DATA_SCHEMA, run_id, cfg, flush=True)
    failed = out.writer("failed", FAILED_SCHEMA, run_id, cfg, flush=True)
    progress = Progress(total=total, done_before=len(finished), todo=run_info["todo"],
                           max_tokens=cfg.sampling.max_tokens, every_s=cfg.output.log_every_s,
                           data_writer=data, failed_writer=failed)
    with progress:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            ok = pc.equal(batch.column("error"), "")
            good = batch.filter(ok)
            bad = batch.filter(pc.invert(ok))
            data.add(good)
            failed.add(bad.append_column("run_id", pa.array([run_id] * bad.num_rows, pa.string())))
            progress.update(good)
        data.close()
        failed.close()

    after = SampleStatus.read(out.fs, out.root, cfg.output.max_attempts)
    counts = {
        "prompts": total,
        "ok": len(after.ok),
        "failed_final": len(after.given_up),
        "pending_retry": total - len(after.ok) - len(after.given_up),
        "failed_rows": sum(after.failures.values()),
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
