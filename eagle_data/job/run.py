"""The two phases: prompts (CPU) and generate (engine), each a streaming Ray Data pipeline
whose rows the driver publishes shard by shard (see sink.py)."""

from __future__ import annotations

import logging
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import ray

from eagle_data.out import manifest as mf
from eagle_data.config import Config
from eagle_data.model_files import check_tokenizer_path, load_tokenizer
from eagle_data.job.prompts import PROMPT_SCHEMA, PromptBuilder
from eagle_data.tools.report import write_report
from eagle_data.out.folder import Output, new_run_id
from eagle_data.job.source import read_source, select_rows

log = logging.getLogger("eagle_data")

PROMPTS_OUT = pa.schema([PROMPT_SCHEMA.field(n) for n in
                         ("sample_id", "source", "messages", "user_turns", "tokenized_prompt",
                          "num_prompt_tokens", "row_id")])
SKIPPED_OUT = pa.schema([PROMPT_SCHEMA.field(n) for n in
                         ("row_id", "sample_id", "source", "reason", "detail", "raw")])


def run_prompts(cfg: Config, out: Output) -> dict:
    """Phase 1. Reuses a finished prompts phase made with the same prompt config."""
    if out.manifest.prompts_complete():
        counts = out.manifest.phase("prompts")["counts"]
        log.info("prompts: reusing finished phase in %s (%s)", out.root, counts)
        return counts
    # An unfinished prompts phase is cheap to redo and may be partial: start it over.
    out.remove("prompts", "skipped")
    run_id = new_run_id()
    phase = out.manifest.phase("prompts")
    phase.update(status="running", started_at=mf.now(), run_id=run_id,
                 prompt_config=mf.normalised(mf.prompt_config(cfg)))
    phase["fingerprint"] = mf.fingerprint(phase["prompt_config"])
    out.manifest.data["config"] = cfg.model_dump(mode="json")
    out.manifest.data["versions"] = mf.library_versions()
    out.manifest.save()

    ds, per_source = select_rows(read_source(cfg.source), cfg.source)
    builder = PromptBuilder(
        tokenizer_path=cfg.model.tokenizer_path,
        trust_remote_code=cfg.model.trust_remote_code,
        chat_template_kwargs=cfg.prompt.chat_template_kwargs,
        max_prompt_tokens=cfg.engine.max_model_len - cfg.sampling.max_tokens,
        reasoning_markers=(cfg.model.reasoning_start, cfg.model.reasoning_end),
        turns=cfg.prompt.turns, max_turns=cfg.prompt.max_turns,
    )
    ds = ds.map_batches(builder, batch_format="pyarrow", batch_size=256)

    prompts = out.writer("prompts", PROMPTS_OUT, run_id, cfg, flush=False)
    skipped = out.writer("skipped", SKIPPED_OUT, run_id, cfg, flush=False)
    seen: set[str] = set()  # sample_ids already in prompts/, for the duplicate check
    reasons: Counter = Counter()
    tokens = turns = 0
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        good, bad = split_duplicates(batch, seen)
        prompts.add(good)
        skipped.add(bad)
        reasons.update(bad.column("reason").to_pylist())
        tokens += pc.sum(good.column("num_prompt_tokens")).as_py() or 0
        turns += pc.sum(pc.list_value_length(good.column("user_turns"))).as_py() or 0
    prompts.close()
    skipped.close()

    counts = {
        "selected": prompts.written + skipped.written,
        "prompts": prompts.written,
        "skipped": skipped.written,
        "skipped_by_reason": dict(sorted(reasons.items())),
        "prompt_tokens": tokens,
        "user_turns": turns,  # = prompts under turns: first_user
    }
    if per_source is not None:  # source.per_source: rows available and quota per source
        counts["sources"] = per_source
    phase.update(status="complete", finished_at=mf.now(), counts=counts)
    out.manifest.save()
    write_report(out)
    log.info("prompts: %s", counts)
    return counts


def split_duplicates(batch: pa.Table, seen: set[str]) -> tuple[pa.Table, pa.Table]:
    """(rows for prompts/, rows for skipped/). A usable row whose sample_id is already in
    prompts/ (`seen`, updated here) is skipped as a `duplicate`."""
    reasons = batch.column("reason").to_pylist()
    details = batch.column("detail").to_pylist()
    for i, sample_id in enumerate(batch.column("sample_id").to_pylist()):
        if reasons[i]:
            continue
        if sample_id in seen:
            reasons[i], details[i] = "duplicate", "same prompt as an earlier row with this sample_id"
        else:
            seen.add(sample_id)
    batch = batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string()))
    batch = batch.set_column(batch.schema.get_field_index("detail"), "detail", pa.array(details, pa.string()))
    ok = pc.equal(batch.column("reason"), "")
    return batch.filter(ok), batch.filter(pc.invert(ok))


def run(cfg: Config, phase: str = "all", fresh: bool = False, engine=None) -> dict:
    """Run the phases on OUT = cfg.output.path; rerunning the same command resumes.

    Everything that can be wrong with the setup (paths, OUT, config vs OUT) is checked
    before any Ray work starts."""
    out = Output(cfg.output.path)
    out.check_writable()
    if not fresh:
        out.manifest.check_prompts_config(cfg)
        if phase != "prompts":
            out.manifest.check_generate_config(cfg)
    check_model_files(cfg, need_weights=phase != "prompts")
    with out.lock():
        if fresh:
            log.warning("--fresh: deleting what earlier runs wrote in %s", out.root)
            out.wipe()
        out.clear_staging()
        out.quarantine_corrupt()
        if not ray.is_initialized():
            ray.init()  # joins the cluster when there is one, else starts a local instance
        result = {}
        if phase in ("prompts", "all"):
            result["prompts"] = run_prompts(cfg, out)
        if phase in ("generate", "all"):
            from eagle_data.job.generate_phase import run_generate

            result["generate"] = run_generate(cfg, out, engine)
    return result


def check_model_files(cfg: Config, need_weights: bool) -> None:
    check_tokenizer_path(cfg.model.tokenizer_path)
    if need_weights:
        check_tokenizer_path(cfg.model.path)
    try:
        load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"cannot load the tokenizer from model.tokenizer/model.path {cfg.model.tokenizer_path!r}: {e}. "
            "A local path must hold a tokenizer; a hub id needs the hub or a filled HF cache."
        ) from None
