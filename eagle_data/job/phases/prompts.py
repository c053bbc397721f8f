"""Phase 1, prompts (CPU): dataset -> seeded sample -> prompts stage -> OUT/prompts + OUT/skipped.

A finished prompts phase made with the same prompt config is reused; an unfinished one is
cheap to redo and may be partial, so it starts over.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle_data.config import Config
from eagle_data.job.stages.prompts import PromptBuilder
from eagle_data.job.stages.sample import select_rows
from eagle_data.job.stages.source import content_stamp, locate, read_source
from eagle_data.job.fingerprints import prompt_config
from eagle_data.job.phases.phase import Phase
from eagle_data.storage.contract import PROMPTS_SCHEMA, SKIPPED_SCHEMA
from eagle_data.storage.folder import Output

log = logging.getLogger("eagle_data")


def run_prompts(cfg: Config, out: Output, engine=None) -> dict:
    if out.manifest.finished("prompts"):
        counts = out.manifest.counts("prompts")
        log.info("prompts: reusing finished phase in %s (%s)", out.root, counts)
        return counts
    builder = PromptBuilder.from_config(cfg)
    builder.check_variants_render_apart()  # a variant the template cannot tell apart: refused before any work
    stamp = content_stamp(locate(cfg.source))  # before the read: a file changed during it is noticed next time
    rows = read_source(cfg.source)  # a dataset that cannot be read fails before the phase is recorded
    out.remove("prompts", "skipped")
    run = out.manifest.start_run("prompts", cfg.model_dump(mode="json"),
                                 {"prompt_config": prompt_config(cfg), "dataset_stamp": stamp})
    ds, per_source = select_rows(rows, cfg.source)
    ds = ds.map_batches(builder, batch_format="pyarrow", batch_size=256)
    counts = write_prompts(ds, out, cfg, run["run_id"])
    if per_source is not None:  # source.per_source: rows available and quota per source
        counts["sources"] = per_source
    out.manifest.finish_run("prompts", run, counts)
    log.info("prompts: %s", counts)
    return counts


def write_prompts(ds, out: Output, cfg: Config, run_id: str) -> dict:
    """Drain the prompts stage into prompts/ and skipped/; the phase's counts."""
    prompts = out.writer("prompts", PROMPTS_SCHEMA, run_id, cfg.output.rows_per_shard)
    skipped = out.writer("skipped", SKIPPED_SCHEMA, run_id, cfg.output.rows_per_shard)
    seen = SeenPrompts()  # prompt_ids already in prompts/, for the duplicate check
    reasons: Counter = Counter()
    per_variant: Counter = Counter()
    tokens = turns = 0
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        good, bad = split_duplicates(batch, seen)
        prompts.add(good)
        skipped.add(bad)
        reasons.update(bad.column("reason").to_pylist())
        per_variant.update(good.column("variant").to_pylist())
        tokens += pc.sum(good.column("num_prompt_tokens")).as_py() or 0
        turns += pc.sum(pc.list_value_length(good.column("user_turns"))).as_py() or 0
    prompts.close()
    skipped.close()
    answers = cfg.sampling.answers_per_prompt
    return {
        "selected": prompts.written // answers + skipped.written,  # dataset rows
        "prompts": prompts.written // answers,  # dataset rows that became a prompt
        "skipped": skipped.written,
        "skipped_by_reason": dict(sorted(reasons.items())),
        "answers_per_prompt": answers,
        "conversations": prompts.written,  # prompts/ rows: prompts x answers_per_prompt
        "conversations_by_variant": dict(sorted(per_variant.items())),
        "prompt_tokens": tokens,
        "user_turns": turns,  # turns to answer (= conversations under turns: first_user)
    }


class SeenPrompts:
    """The prompt_ids already in prompts/ (a set that only grows), kept as 10-byte digests
    (a prompt_id is 20 hex digits) in sorted numpy runs: 10 bytes a dataset row, where a
    Python set of the strings took about 100 (1.4M rows: ~14 MiB instead of ~140).
    A run is merged with the one before it when that one is not larger (a binary counter):
    a lookup searches O(log rows) runs and each digest is re-sorted O(log rows) times."""

    def __init__(self):
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(run.size for run in self.runs)

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    def add(self, prompt_ids: list[str]) -> np.ndarray:
        """Add the ids; for each one, whether it is new (not seen before, nor earlier in
        `prompt_ids`)."""
        keys = np.frombuffer(bytes.fromhex("".join(prompt_ids)), dtype="S10")
        if keys.size * 20 != sum(map(len, prompt_ids)):
            raise ValueError("a prompt_id is not 20 hex digits")
        unique, first = np.unique(keys, return_index=True)  # sorted; the first of equal keys in the batch
        fresh = np.ones(unique.size, dtype=bool)
        for run in self.runs:  # (sorted needles: numpy's search reuses its last position)
            at = np.minimum(np.searchsorted(run, unique), run.size - 1)
            fresh &= run[at] != unique
        if fresh.any():
            self.runs.append(unique[fresh])
        new = np.zeros(keys.size, dtype=bool)
        new[first[fresh]] = True
        while len(self.runs) > 1 and self.runs[-2].size <= self.runs[-1].size:
            last = self.runs.pop()
            # stable (timsort) finds the two sorted runs: a linear merge
            self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]), kind="stable")
        return new


def split_duplicates(batch: pa.Table, seen: SeenPrompts) -> tuple[pa.Table, pa.Table]:
    """(rows for prompts/, rows for skipped/). A dataset row whose prompt_id an earlier row
    already had (`seen`, updated here) is skipped as one `duplicate` row. The stage emits a
    row's conversations together, answer 0 first: the later ones share its fate."""
    reasons = batch.column("reason").to_pylist()
    details = batch.column("detail").to_pylist()
    prompt_ids, answers = batch.column("prompt_id").to_pylist(), batch.column("answer").to_pylist()
    firsts = [i for i, (reason, answer) in enumerate(zip(reasons, answers)) if not reason and answer == 0]
    new = dict(zip(firsts, seen.add([prompt_ids[i] for i in firsts]).tolist()))
    keep = [True] * batch.num_rows
    duplicate = False
    for i, answer in enumerate(answers):
        if reasons[i]:
            continue
        if answer == 0:
            duplicate = not new[i]
        if duplicate:
            reasons[i], details[i] = "duplicate", "same prompt as an earlier row with this prompt_id"
            keep[i] = answer == 0  # one skipped/ row per dataset row
    batch = batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string()))
    batch = batch.set_column(batch.schema.get_field_index("detail"), "detail", pa.array(details, pa.string()))
    batch = batch.filter(pa.array(keep))
    ok = pc.equal(batch.column("reason"), "")
    bad = batch.filter(pc.invert(ok))
    bad = bad.set_column(bad.schema.get_field_index("sample_id"), "sample_id", bad.column("prompt_id"))
    return batch.filter(ok), bad


def empty(cfg: Config, out: Output) -> str | None:
    """Why a finished prompts phase left no prompt, or None."""
    counts = out.manifest.counts("prompts")
    if not out.manifest.finished("prompts") or counts.get("prompts") != 0:
        return None
    if not counts.get("selected"):
        why = f"source.dataset {cfg.source.dataset!r} holds no rows"
    else:
        reasons = ", ".join(f"{k} {v}" for k, v in counts.get("skipped_by_reason", {}).items())
        why = (f"all {counts['selected']} selected rows of {cfg.source.dataset!r} were skipped ({reasons}); "
               f"see {out.root}/skipped/ (reason, detail)")
    return f"0 prompts: {why}. Nothing to generate; pass --allow-empty to accept an empty result"


def summary(out: str, counts: dict) -> list[str]:
    reasons = ", ".join(f"{k} {v}" for k, v in counts["skipped_by_reason"].items()) or "none"
    answers = (f", {counts['conversations']} conversations ({counts['answers_per_prompt']} answers each)"
               if counts.get("answers_per_prompt", 1) > 1 else "")
    variants = counts.get("conversations_by_variant", {})
    by_variant = ("; variants " + ", ".join(f"{k} {v}" for k, v in variants.items())) if len(variants) > 1 else ""
    return [f"  prompts/  {counts['prompts']} prompts ({counts['prompt_tokens']} tokens) of "
            f"{counts['selected']} selected rows{answers}{by_variant}",
            f"  skipped/  {counts['skipped']} rows ({reasons})"]


PHASE = Phase("prompts", prompt_config, run_prompts, summary, reads_dataset=True, needs_model_weights=False,
              empty=empty)
