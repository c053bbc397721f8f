"""`python -m eagle_data verify OUT`: check the invariants a finished or killed OUT must hold.

- every shard in prompts/, skipped/, data/, failed/ reads completely, and its footer names
  this OUT (out_id) and the config fingerprint the manifest records for its phase;
- sample_id is unique in prompts/ and in data/ (exactly-once, per turn under turns: all);
- data/, failed/ and stopped/ hold only conversations of prompts/;
- every data/ row is consistent: len(loss_mask) == len(input_ids) ==
  num_prompt_tokens + num_reasoning_tokens + num_response_tokens, no loss on the prompt;
  with top-k log-probabilities (sampling.logprobs), one entry per generated token in each
  of their columns, the same k in every shard, ids within the model's vocabulary, and the
  sampled tokens' log-probabilities finite and <= 0;
- the prompts phase accounts for every selected row: prompts + skipped = selected, and
  every prompt has answers_per_prompt conversations in prompts/;
- after a finished generate run, every turn that could be asked (the first, and each one
  after an ok turn) is in data/, failed/ or stopped/; under turns: first_user that means
  ok + failed = conversations.
- hidden_states/: every shard's header reads and its file has the bytes it lists; each
  sample is in one shard only, is a data/ row, has len(input_ids) rows and the recorded
  layers, H and dtype, and its bytes match their crc32; after a finished hidden-states run,
  every selected data/ row is in hidden_states/ or hidden_failed/.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections import Counter

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from eagle_data.storage.contract import FOLDERS, HIDDEN_STATES, turn_sample_id
from eagle_data.storage.folder import Output
from eagle_data.storage.provenance import foreign_reason, shard_problem
from eagle_data.storage.hidden_states import ShardHeaderError, read_bytes, read_header, shard_paths
from eagle_data.storage.status import SampleStatus
from eagle_data.storage.shards import shard_files
from eagle_data.tools.terminal import literal

DATA_CHECK_COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_prompt_tokens",
                      "num_reasoning_tokens", "num_response_tokens"]


def verify(path: str) -> tuple[list[str], dict]:
    """(problems, counts); no problems means every invariant holds."""
    out = Output.existing(path)
    problems: list[str] = []
    ids: dict[str, Counter] = {}
    logprob_k: set[int] = set()  # k of the data/ shards' log-probability columns (0: none)
    vocab = out.manifest.tokenizer.get("model_vocab_size") or out.manifest.tokenizer.get("vocab_size")
    conversations: dict[str, set] = {}  # folder -> conversation_ids
    num_turns: dict[str, int] = {}  # conversation_id -> user turns to answer
    prompt_ids: Counter = Counter()  # prompt_id -> its conversations in prompts/
    for folder in FOLDERS:
        ids[folder], conversations[folder] = Counter(), set()
        for f in shard_files(out.fs, out.folder(folder)):
            try:
                table = pq.read_table(f, filesystem=out.fs)  # reads every page: integrity
            except Exception as e:
                problems.append(f"{f}: unreadable shard ({type(e).__name__}: {e})")
                continue
            foreign = shard_problem(out, folder, f)
            if foreign:  # the next run quarantines it and redoes its samples
                problems.append(f"{f}: not this OUT's shard: {foreign}")
            ids[folder].update(table.column("sample_id").to_pylist())
            if folder in ("data", "failed", "stopped"):
                conversations[folder].update(table.column("conversation_id").to_pylist())
            if folder == "prompts":
                prompt_ids.update(table.column("prompt_id").to_pylist())
                num_turns.update(zip(table.column("sample_id").to_pylist(),
                                     pc.list_value_length(table.column("user_turns")).to_pylist()))
            if folder == "data":
                problems += _check_data_rows(f, table.select(DATA_CHECK_COLUMNS))
                problems += _check_logprobs(f, table, vocab, logprob_k)

    if len(logprob_k) > 1:
        problems.append(f"data/ shards disagree on their top-k log-probabilities: k = {sorted(logprob_k)} (0 = none)")
    prompts = ids["prompts"]
    problems += [f"sample_id {s} appears {n} times in prompts/" for s, n in prompts.items() if n > 1]
    problems += [f"sample_id {s} appears {n} times in data/ (exactly-once broken)"
                 for s, n in ids["data"].items() if n > 1]
    for folder in ("data", "failed", "stopped"):
        stray = conversations[folder] - set(prompts)
        if stray:
            problems.append(f"{len(stray)} conversations in {folder}/ are not in prompts/, e.g. {sorted(stray)[0]}")

    manifest = out.manifest
    all_turns = manifest.turns == "all"
    counts = {"prompts": len(prompt_ids), "conversations": sum(prompts.values()),
              "skipped": sum(ids["skipped"].values())}
    if manifest.prompts_complete():
        counts["selected"] = manifest.prompts_counts["selected"]
        if counts["prompts"] + counts["skipped"] != counts["selected"]:
            problems.append(f"prompts ({counts['prompts']}) + skipped ({counts['skipped']}) != "
                            f"selected ({counts['selected']}) recorded by the prompts phase")
        answers = manifest.prompts_counts.get("answers_per_prompt", 1)
        uneven = {p: n for p, n in prompt_ids.items() if n != answers}
        if uneven:
            problems.append(f"{len(uneven)} prompts have other than {answers} conversations (answers_per_prompt) "
                            f"in prompts/, e.g. {min(uneven)}")
    else:
        problems.append("the prompts phase has not finished (manifest status "
                        f"{manifest.prompts_status!r}): rerun the job")

    progress = SampleStatus.of(ids["data"], ids["failed"], ids["stopped"], manifest.max_attempts)
    failed_only = set(ids["failed"]) - progress.ok
    counts.update(ok=len(progress.ok), failed=len(failed_only), failed_final=len(progress.given_up),
                  failed_retryable=len(failed_only - progress.given_up), stopped=len(progress.stopped))
    if manifest.generate_finished:
        missing = unanswered(num_turns, progress, all_turns)
        if missing:
            problems.append(f"{len(missing)} turns that could be asked have no data/, failed/ or stopped/ "
                            f"row after a finished generate run, e.g. {sorted(missing)[0]}")
        elif not all_turns and counts["ok"] + counts["failed"] != counts["conversations"]:
            problems.append(f"ok ({counts['ok']}) + failed ({counts['failed']}) != conversations "
                            f"({counts['conversations']}) in prompts/")
    counts["generate_finished"] = manifest.generate_finished
    hidden_problems, hidden_counts = check_hidden_states(out, set(ids["hidden_failed"]))
    return problems + hidden_problems, {**counts, **hidden_counts}


def check_hidden_states(out: Output, failed: set[str]) -> tuple[list[str], dict]:
    record = out.manifest.phase("hidden_states")
    paths = shard_paths(out.fs, out.folder(HIDDEN_STATES))
    if not record and not paths:
        return [], {}
    features = record.get("features", {})
    problems, seen = [], Counter()
    lengths = data_lengths(out)
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
            seen[sample_id] += 1
            shape = (lengths.get(sample_id), len(features.get("layer_ids", ())), features.get("hidden_size"))
            if sample_id not in lengths:
                problems.append(f"{path}: sample_id {sample_id} has hidden states but no data/ row")
            elif entry.shape != shape:
                problems.append(f"{path}: sample_id {sample_id} has shape {list(entry.shape)}, expected {list(shape)}")
            elif entry.crc32 is None or zlib.crc32(read_bytes(out.fs, entry)) != entry.crc32:
                problems.append(f"{path}: sample_id {sample_id}: its bytes do not match their crc32 (damaged)")
    problems += [f"sample_id {s} appears {n} times in hidden_states/ (exactly-once broken)"
                 for s, n in seen.items() if n > 1]
    runs = record.get("runs", [])
    finished = bool(runs) and runs[-1].get("status") == "complete"
    if finished:
        selected = selected_for_hidden_states(out, record.get("hidden_states_config", {}))
        missing = selected - set(seen) - failed
        if missing:
            problems.append(f"{len(missing)} selected data/ rows have neither hidden states nor a hidden_failed/ "
                            f"row after a finished hidden-states run, e.g. {sorted(missing)[0]}")
    return problems, {"hidden_states": len(seen), "hidden_failed": len(failed - set(seen)),
                      "hidden_states_finished": finished}


def data_lengths(out: Output) -> dict[str, int]:
    files = shard_files(out.fs, out.folder("data"))
    if not files:
        return {}
    table = pads.dataset(files, filesystem=out.fs, format="parquet").to_table(
        columns=["sample_id", "num_prompt_tokens", "num_reasoning_tokens", "num_response_tokens"])
    rows = zip(*(table.column(c).to_pylist() for c in table.column_names))
    return {s: a + b + c for s, a, b, c in rows}


def selected_for_hidden_states(out: Output, config: dict) -> set[str]:
    from eagle_data.reader.samples import row_filter

    files = shard_files(out.fs, out.folder("data"))
    if not files:
        return set()
    expr = row_filter(config.get("hidden_states.finish_reason"), config.get("hidden_states.source"))
    table = pads.dataset(files, filesystem=out.fs, format="parquet").to_table(columns=["sample_id"], filter=expr)
    return set(table.column("sample_id").to_pylist())


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
