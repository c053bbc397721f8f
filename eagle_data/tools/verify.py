"""`python -m eagle_data verify OUT`: check the invariants a finished or killed OUT must hold.

- every shard in prompts/, skipped/, data/, failed/ reads completely, and its footer names
  this OUT (out_id) and the config fingerprint the manifest records for its phase;
- sample_id is unique in prompts/ and in data/ (exactly-once, per turn under turns: all);
- data/, failed/ and stopped/ hold only conversations of prompts/;
- every data/ row is consistent: len(loss_mask) == len(input_ids) ==
  num_prompt_tokens + num_reasoning_tokens + num_response_tokens, no loss on the prompt;
  with top-k log-probabilities (sampling.logprobs), one entry per generated token in each
  of their columns, the same k in every shard, ids within the model's vocabulary, and the
  sampled tokens' log-probabilities finite and <= 0; every row's `answered_by` is the one
  the generate phase records (target, or dataset: the dataset's own answers);
- the prompts phase accounts for every selected row: prompts + skipped = selected, and
  every prompt has answers_per_prompt conversations in prompts/;
- after a finished generate run, every turn that could be asked (the first, and each one
  after an ok turn) is in data/, failed/ or stopped/; under turns: first_user that means
  ok + failed = conversations.
- hidden_states/: every shard's header reads and its file has the bytes it lists; each
  sample is in one shard only, is a data/ row, has len(input_ids) rows and the recorded
  layers, H and dtype, was computed from its row's input_ids (their crc32 in the header),
  and its bytes match their crc32; after a finished hidden-states run,
  every selected data/ row is in hidden_states/ or hidden_failed/.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads

from eagle_data.errors import DamagedShard
from eagle_data.storage.contract import FOLDERS, HIDDEN_FAILED, HIDDEN_STATES, PHASES, turn_sample_id
from eagle_data.storage.folder import Output
from eagle_data.storage.provenance import foreign_reason, shard_problem
from eagle_data.storage.hidden_states import (ShardHeaderError, damaged, input_ids_digests, read_bytes, read_header,
                                             shard_paths, stale)
from eagle_data.storage.selection import selected_rows
from eagle_data.storage.status import SampleStatus
from eagle_data.storage.shards import read_checked, shard_files
from eagle_data.tools.terminal import literal

DATA_CHECK_COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_prompt_tokens",
                      "num_reasoning_tokens", "num_response_tokens"]


@dataclass
class Seen:
    """What one read of every Parquet shard found, for the phases' checks."""

    ids: dict[str, Counter] = field(default_factory=dict)  # folder -> sample_id -> rows
    conversations: dict[str, set] = field(default_factory=dict)  # folder -> conversation_ids
    prompt_ids: Counter = field(default_factory=Counter)  # prompt_id -> its conversations in prompts/
    num_turns: dict[str, int] = field(default_factory=dict)  # conversation_id -> user turns to answer
    logprob_k: set[int] = field(default_factory=set)  # k of data/'s log-probability columns (0: none)
    unreadable: set[str] = field(default_factory=set)  # shards named as unreadable: read no further


def verify(path: str) -> tuple[list[str], dict]:
    """(problems, counts); no problems means every invariant holds."""
    out = Output.existing(path)
    problems, seen = read_every_shard(out)
    counts: dict = {}
    for phase in PHASES:
        found, phase_counts = PHASE_CHECKS[phase.name](out, seen)
        problems += found
        counts.update(phase_counts)
    return problems, counts


def read_every_shard(out: Output) -> tuple[list[str], Seen]:
    """Every Parquet shard read whole (integrity) and its footer checked; the rows' own
    checks of its folder (SHARD_CHECKS) while it is in memory."""
    problems, seen = [], Seen()
    for folder in FOLDERS:
        seen.ids[folder], seen.conversations[folder] = Counter(), set()
        for f in shard_files(out.fs, out.folder(folder)):
            try:  # every page read and checked against its checksum: integrity
                table = read_checked(out.fs, f)
            except DamagedShard as e:
                problems.append(f"{f}: unreadable shard ({e.why})")
                seen.unreadable.add(f)
                continue
            foreign = shard_problem(out, folder, f)
            if foreign:  # the next run quarantines it and redoes its samples
                problems.append(f"{f}: not this OUT's shard: {foreign}")
            seen.ids[folder].update(table.column("sample_id").to_pylist())
            if "conversation_id" in table.column_names:
                seen.conversations[folder].update(table.column("conversation_id").to_pylist())
            if folder in SHARD_CHECKS:
                problems += SHARD_CHECKS[folder](out, f, table, seen)
    return problems, seen


def prompts_shard(out: Output, path: str, table, seen: Seen) -> list[str]:
    seen.prompt_ids.update(table.column("prompt_id").to_pylist())
    seen.num_turns.update(zip(table.column("sample_id").to_pylist(),
                              pc.list_value_length(table.column("user_turns")).to_pylist()))
    return []


def data_shard(out: Output, path: str, table, seen: Seen) -> list[str]:
    tokenizer = out.manifest.tokenizer
    vocab = tokenizer.get("model_vocab_size") or tokenizer.get("vocab_size")
    return (_check_data_rows(path, table.select(DATA_CHECK_COLUMNS)) + _check_logprobs(path, table, vocab, seen.logprob_k)
            + _check_answered_by(path, table, out.manifest.phase("generate").get("answered_by", "target")))


def _check_answered_by(path: str, table, recorded: str) -> list[str]:
    """Rows of one OUT are answered one way: the one its generate phase records (a shard
    written before the column existed has none: the target's)."""
    if "answered_by" not in table.column_names:
        return []
    other = table.filter(pc.not_equal(table.column("answered_by"), recorded))  # (null: not recorded)
    return [f"{path}: sample_id {s}: answered_by {v!r}, the generate phase records {recorded!r}"
            for s, v in zip(other.column("sample_id").to_pylist(), other.column("answered_by").to_pylist())]


def check_prompts(out: Output, seen: Seen) -> tuple[list[str], dict]:
    """sample_id unique in prompts/; prompts + skipped = selected; answers_per_prompt
    conversations per prompt."""
    prompts, manifest = seen.ids["prompts"], out.manifest
    problems = [f"sample_id {s} appears {n} times in prompts/" for s, n in prompts.items() if n > 1]
    counts = {"prompts": len(seen.prompt_ids), "conversations": sum(prompts.values()),
              "skipped": sum(seen.ids["skipped"].values())}
    if manifest.finished("prompts"):
        counts["selected"] = manifest.counts("prompts")["selected"]
        if counts["prompts"] + counts["skipped"] != counts["selected"]:
            problems.append(f"prompts ({counts['prompts']}) + skipped ({counts['skipped']}) != "
                            f"selected ({counts['selected']}) recorded by the prompts phase")
        answers = manifest.counts("prompts").get("answers_per_prompt", 1)
        uneven = {p: n for p, n in seen.prompt_ids.items() if n != answers}
        if uneven:
            problems.append(f"{len(uneven)} prompts have other than {answers} conversations (answers_per_prompt) "
                            f"in prompts/, e.g. {min(uneven)}")
    else:
        problems.append("the prompts phase has not finished (manifest status "
                        f"{manifest.status('prompts')!r}): rerun the job")
    return problems, counts


def check_answers(out: Output, seen: Seen) -> tuple[list[str], dict]:
    """Exactly-once in data/; answers only of prompts/ conversations; after a finished
    run, every turn that could be asked has a row."""
    ids, manifest = seen.ids, out.manifest
    problems = []
    if len(seen.logprob_k) > 1:
        problems.append(f"data/ shards disagree on their top-k log-probabilities: k = {sorted(seen.logprob_k)} (0 = none)")
    problems += [f"sample_id {s} appears {n} times in data/ (exactly-once broken)"
                 for s, n in ids["data"].items() if n > 1]
    for folder in ("data", "failed", "stopped"):
        stray = seen.conversations[folder] - set(ids["prompts"])
        if stray:
            problems.append(f"{len(stray)} conversations in {folder}/ are not in prompts/, e.g. {sorted(stray)[0]}")
    all_turns = manifest.turns == "all"
    progress = SampleStatus.of(ids["data"], ids["failed"], ids["stopped"], manifest.max_attempts)
    failed_only = set(ids["failed"]) - progress.ok
    counts = {"ok": len(progress.ok), "failed": len(failed_only), "failed_final": len(progress.given_up),
              "failed_retryable": len(failed_only - progress.given_up), "stopped": len(progress.stopped)}
    if manifest.finished("generate"):
        missing = unanswered(seen.num_turns, progress, all_turns)
        conversations = sum(ids["prompts"].values())
        if missing:
            problems.append(f"{len(missing)} turns that could be asked have no data/, failed/ or stopped/ "
                            f"row after a finished generate run, e.g. {sorted(missing)[0]}")
        elif not all_turns and counts["ok"] + counts["failed"] != conversations:
            problems.append(f"ok ({counts['ok']}) + failed ({counts['failed']}) != conversations "
                            f"({conversations}) in prompts/")
    counts["generate_finished"] = manifest.finished("generate")
    return problems, counts


def check_hidden_states(out: Output, seen: Seen) -> tuple[list[str], dict]:
    """Every shard's header reads and matches its bytes and the recorded features; each
    sample once, a data/ row, of its length and crc32; after a finished run, every selected
    row has states or a hidden_failed/ row."""
    failed = set(seen.ids[HIDDEN_FAILED])
    record = out.manifest.phase("hidden_states")
    paths = shard_paths(out.fs, out.folder(HIDDEN_STATES))
    if not record and not paths:
        return [], {}
    features = record.get("features", {})
    problems, published = [], Counter()
    data_files = [f for f in shard_files(out.fs, out.folder("data")) if f not in seen.unreadable]
    lengths = data_lengths(out, data_files)
    digests = input_ids_digests(out.fs, data_files)
    for path in paths:
        try:
            meta, entries = read_header(out.fs, path)
        except (ShardHeaderError, OSError) as e:
            problems.append(f"{path}: unreadable hidden-states shard ({e})")
            continue
        end = max((e.end for e in entries.values()), default=0)
        if out.fs.get_file_info(path).size != end:
            problems.append(f"{path}: {out.fs.get_file_info(path).size} bytes, its header lists {end}")
            continue
        recorded = {"layer_ids": json.loads(meta.get("layer_ids", "null")), "dtype": meta.get("dtype")}
        expected = {k: features.get(k) for k in recorded}
        if recorded != expected:
            problems.append(f"{path}: holds {recorded}, the manifest records {expected}")
        foreign = foreign_reason(out.manifest, HIDDEN_STATES, meta)
        if foreign:  # the next run quarantines it and redoes its samples
            problems.append(f"{path}: not this OUT's shard: {foreign}")
        for sample_id, entry in entries.items():
            published[sample_id] += 1
            shape = (lengths.get(sample_id), len(features.get("layer_ids", ())), features.get("hidden_size"))
            if sample_id not in lengths:
                problems.append(f"{path}: sample_id {sample_id} has hidden states but no data/ row")
            elif entry.shape != shape:
                problems.append(f"{path}: sample_id {sample_id} has shape {list(entry.shape)}, expected {list(shape)}")
            elif why := stale(entry, digests.get(sample_id)) or damaged(entry, read_bytes(out.fs, entry)):
                problems.append(f"{path}: sample_id {sample_id}: {why} (the next run of the phase redoes it)")
    problems += [f"sample_id {s} appears {n} times in hidden_states/ (exactly-once broken)"
                 for s, n in published.items() if n > 1]
    finished = out.manifest.finished("hidden_states")
    if finished:
        config = record.get("hidden_states_config", {})
        selected = set(selected_rows(out.fs, out.folder("data"), config.get("hidden_states.finish_reason"),
                                     config.get("hidden_states.source"), data_files).column("sample_id").to_pylist())
        missing = selected - set(published) - failed
        if missing:
            problems.append(f"{len(missing)} selected data/ rows have neither hidden states nor a hidden_failed/ "
                            f"row after a finished hidden-states run, e.g. {sorted(missing)[0]}")
    return problems, {"hidden_states": len(published), "hidden_failed": len(failed - set(published)),
                      "hidden_states_finished": finished}


def data_lengths(out: Output, files: list[str]) -> dict[str, int]:
    """Tokens per sample_id of these (readable) data/ shards."""
    if not files:
        return {}
    table = pads.dataset(files, filesystem=out.fs, format="parquet").to_table(
        columns=["sample_id", "num_prompt_tokens", "num_reasoning_tokens", "num_response_tokens"])
    rows = zip(*(table.column(c).to_pylist() for c in table.column_names))
    return {s: a + b + c for s, a, b, c in rows}


def unanswered(num_turns: dict[str, int], progress: SampleStatus, all_turns: bool) -> set[str]:
    """sample_ids of turns with no row: the first turn of every conversation, and each
    later turn whose previous turn is ok."""
    answered = progress.ok | set(progress.failures) | progress.stopped
    missing = set()
    for conversation, n in num_turns.items():
        for turn in range(n if all_turns else 1):
            if turn and turn_sample_id(conversation, turn - 1) not in progress.ok:
                break
            sample_id = turn_sample_id(conversation, turn) if all_turns else conversation
            if sample_id not in answered:
                missing.add(sample_id)
    return missing


def _check_logprobs(path: str, table, vocab: int | None, seen_k: set[int]) -> list[str]:
    if "top_logprob_ids" not in table.column_names:
        seen_k.add(0)
        return []
    seen_k.add(table.schema.field("top_logprob_ids").type.value_type.list_size)
    generated = pc.add(table.column("num_reasoning_tokens"), table.column("num_response_tokens"))
    bad = pc.or_(pc.or_(pc.not_equal(pc.list_value_length(table.column("top_logprob_ids")), generated),
                        pc.not_equal(pc.list_value_length(table.column("top_logprobs")), generated)),
                 pc.not_equal(pc.list_value_length(table.column("token_logprobs")), generated))
    problems = [f"{path}: sample_id {s}: its log-probabilities are not one entry per generated token"
                for s in table.filter(bad).column("sample_id").to_pylist()]
    top_ids = pc.list_flatten(pc.list_flatten(table.column("top_logprob_ids")))
    bounds = pc.min_max(top_ids)
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if low is not None and (low < 0 or (vocab and high >= vocab)):
        problems.append(f"{path}: top_logprob_ids outside the vocabulary [0, {vocab}): {low}..{high}")
    own = pc.list_flatten(table.column("token_logprobs")).to_numpy(zero_copy_only=False)
    if not (np.isfinite(own) & (own <= 0)).all():
        problems.append(f"{path}: token_logprobs holds values that are not finite log-probabilities <= 0")
    return problems


def _check_data_rows(path: str, table) -> list[str]:
    n_ids = pc.list_value_length(table.column("input_ids"))
    n_mask = pc.list_value_length(table.column("loss_mask"))
    parts = pc.add(pc.add(table.column("num_prompt_tokens"), table.column("num_reasoning_tokens")),
                   table.column("num_response_tokens"))
    bad = pc.or_(pc.not_equal(n_ids, n_mask), pc.not_equal(n_ids, pc.cast(parts, n_ids.type)))
    problems = [f"{path}: sample_id {s}: input_ids, loss_mask and token counts disagree"
                for s in table.filter(bad).column("sample_id").to_pylist()]
    for row in table.select(["sample_id", "loss_mask", "num_prompt_tokens"]).to_pylist():
        if any(row["loss_mask"][:row["num_prompt_tokens"]]):
            problems.append(f"{path}: sample_id {row['sample_id']}: loss_mask is 1 on a prompt token")
    return problems


# Each phase's invariants (every phase of storage.contract.PHASES has one), and the checks of
# a folder's rows made while its shard is read.
PHASE_CHECKS = {"prompts": check_prompts, "generate": check_answers, "hidden_states": check_hidden_states}
SHARD_CHECKS = {"prompts": prompts_shard, "data": data_shard}


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("verify", help="check the exactly-once and accounting invariants of OUT")
    p.add_argument("out")
    p.set_defaults(run=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    """Exit 1 when a problem is found: a result rather than an error."""
    problems, counts = verify(args.out)
    print(json.dumps(counts, sort_keys=True))
    for p in problems:  # they name sample ids and files: data text, shown literally
        print(f"FAIL: {literal(p)}", file=sys.stderr)
    if not problems:
        print(f"OK: {literal(args.out)} holds every invariant")
    return 1 if problems else 0
