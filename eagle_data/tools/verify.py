"""`python -m eagle_data verify OUT`: check the invariants a finished or killed OUT must hold.

- every shard in prompts/, skipped/, data/, failed/ reads completely;
- sample_id is unique in prompts/ and in data/ (exactly-once, per turn under turns: all);
- data/, failed/ and stopped/ hold only conversations of prompts/;
- every data/ row is consistent: len(loss_mask) == len(input_ids) ==
  num_prompt_tokens + num_reasoning_tokens + num_response_tokens, no loss on the prompt;
- the prompts phase accounts for every selected row: prompts + skipped = selected;
- after a finished generate run, every turn that could be asked (the first, and each one
  after an ok turn) is in data/, failed/ or stopped/; under turns: first_user that means
  ok + failed + skipped = selected.
"""

from __future__ import annotations

from collections import Counter

import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_data.storage.contract import FOLDERS, turn_sample_id
from eagle_data.storage.folder import Output
from eagle_data.storage.status import SampleStatus
from eagle_data.storage.shards import shard_files

DATA_CHECK_COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_prompt_tokens",
                      "num_reasoning_tokens", "num_response_tokens"]


def verify(path: str) -> tuple[list[str], dict]:
    """(problems, counts); no problems means every invariant holds."""
    out = Output.existing(path)
    problems: list[str] = []
    ids: dict[str, Counter] = {}
    conversations: dict[str, set] = {}  # folder -> conversation_ids
    num_turns: dict[str, int] = {}  # conversation_id -> user turns to answer
    for folder in FOLDERS:
        ids[folder], conversations[folder] = Counter(), set()
        for f in shard_files(out.fs, out.folder(folder)):
            try:
                table = pq.read_table(f, filesystem=out.fs)  # reads every page: integrity
            except Exception as e:
                problems.append(f"{f}: unreadable shard ({type(e).__name__}: {e})")
                continue
            ids[folder].update(table.column("sample_id").to_pylist())
            if folder in ("data", "failed", "stopped"):
                conversations[folder].update(table.column("conversation_id").to_pylist())
            if folder == "prompts":
                num_turns.update(zip(table.column("sample_id").to_pylist(),
                                     pc.list_value_length(table.column("user_turns")).to_pylist()))
            if folder == "data":
                problems += _check_data_rows(f, table.select(DATA_CHECK_COLUMNS))

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
    counts = {"prompts": sum(prompts.values()), "skipped": sum(ids["skipped"].values())}
    if manifest.prompts_complete():
        counts["selected"] = manifest.prompts_counts["selected"]
        if counts["prompts"] + counts["skipped"] != counts["selected"]:
            problems.append(f"prompts ({counts['prompts']}) + skipped ({counts['skipped']}) != "
                            f"selected ({counts['selected']}) recorded by the prompts phase")
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
        elif not all_turns and "selected" in counts and counts["ok"] + counts["failed"] + counts["skipped"] != counts["selected"]:
            problems.append(f"ok ({counts['ok']}) + failed ({counts['failed']}) + skipped "
                            f"({counts['skipped']}) != selected ({counts['selected']})")
    counts["generate_finished"] = manifest.generate_finished
    return problems, counts


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
