"""`python -m eagle_data verify OUT`: check the invariants a finished or killed OUT must hold.

- every shard in prompts/, skipped/, data/, failed/ reads completely;
- sample_id is unique in prompts/ and in data/ (exactly-once);
- data/ and failed/ hold only sample_ids of prompts/;
- every data/ row is consistent: len(loss_mask) == len(input_ids) ==
  num_prompt_tokens + num_reasoning_tokens + num_response_tokens, no loss on the prompt;
- the prompts phase accounts for every selected row: prompts + skipped = selected;
- after a finished generate run, every prompt is in data/ or failed/, so
  ok + failed + skipped = selected.
"""

from __future__ import annotations

from collections import Counter

import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_data.output import FOLDERS, Output
from eagle_data.resume import SampleStatus
from eagle_data.sink import shard_files

DATA_CHECK_COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_prompt_tokens",
                      "num_reasoning_tokens", "num_response_tokens"]


def verify(path: str) -> tuple[list[str], dict]:
    """(problems, counts); no problems means every invariant holds."""
    out = Output(path)
    problems: list[str] = []
    ids: dict[str, Counter] = {}
    for folder in FOLDERS:
        ids[folder] = Counter()
        for f in shard_files(out.fs, out.folder(folder)):
            try:
                table = pq.read_table(f, filesystem=out.fs)  # reads every page: integrity
            except Exception as e:
                problems.append(f"{f}: unreadable shard ({type(e).__name__}: {e})")
                continue
            ids[folder].update(table.column("sample_id").to_pylist())
            if folder == "data":
                problems += _check_data_rows(f, table.select(DATA_CHECK_COLUMNS))

    prompts = ids["prompts"]
    problems += [f"sample_id {s} appears {n} times in prompts/" for s, n in prompts.items() if n > 1]
    problems += [f"sample_id {s} appears {n} times in data/ (exactly-once broken)"
                 for s, n in ids["data"].items() if n > 1]
    for folder in ("data", "failed"):
        stray = set(ids[folder]) - set(prompts)
        if stray:
            problems.append(f"{len(stray)} sample_ids in {folder}/ are not in prompts/, e.g. {sorted(stray)[0]}")

    manifest = out.manifest.data
    made = manifest.get("phases", {}).get("prompts", {})
    counts = {"prompts": sum(prompts.values()), "skipped": sum(ids["skipped"].values())}
    if made.get("status") == "complete":
        counts["selected"] = made["counts"]["selected"]
        if counts["prompts"] + counts["skipped"] != counts["selected"]:
            problems.append(f"prompts ({counts['prompts']}) + skipped ({counts['skipped']}) != "
                            f"selected ({counts['selected']}) recorded by the prompts phase")
    elif manifest:
        problems.append("the prompts phase has not finished (manifest status "
                        f"{made.get('status')!r}): rerun the job")
    else:
        problems.append(f"{out.root} has no manifest.json: not an eagle-data OUT")

    max_attempts = manifest.get("config", {}).get("output", {}).get("max_attempts", 1)
    progress = SampleStatus(set(ids["data"]), ids["failed"], max_attempts)
    failed_only = set(ids["failed"]) - progress.ok
    counts.update(ok=len(progress.ok), failed=len(failed_only), failed_final=len(progress.given_up),
                  failed_retryable=len(failed_only - progress.given_up))
    runs = manifest.get("phases", {}).get("generate", {}).get("runs", [])
    if runs and runs[-1].get("status") == "complete":
        missing = set(prompts) - progress.ok - failed_only
        if missing:
            problems.append(f"{len(missing)} prompts have neither a data/ nor a failed/ row after a "
                            f"finished generate run, e.g. {sorted(missing)[0]}")
        elif "selected" in counts and counts["ok"] + counts["failed"] + counts["skipped"] != counts["selected"]:
            problems.append(f"ok ({counts['ok']}) + failed ({counts['failed']}) + skipped "
                            f"({counts['skipped']}) != selected ({counts['selected']})")
    counts["generate_finished"] = bool(runs) and runs[-1].get("status") == "complete"
    return problems, counts


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
