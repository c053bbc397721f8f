"""`export OUT DEST --format specforge|speculators|jsonl`: data/ as a JSONL file a peer
trainer reads directly. Streams record batches, so an OUT of any size exports in bounded
memory; DEST (a local path or URI) appears only once complete (written aside, then moved).

Formats, matched against the peers' current readers (field names and types, not code):

- specforge (sgl-project/SpecForge): one conversation per line,
      {"id": str, "conversations": [{"role": str, "content": str}, ...,
                                    {"role": "assistant", "content": response,
                                     "reasoning_content": reasoning}]}
  The `id` + `conversations` contract is docs/basic_usage/data_preparation.md and
  scripts/prepare_data.py; the assistant's `reasoning_content` key is where
  scripts/regenerate_train_data.py (--reasoning save) stores the target's reasoning and
  where specforge/data/parse.py (ThinkingParser) reads it back into the chat template. It
  is written only when the sample has reasoning, as their regeneration does. No other
  keys: specforge/data/preprocessing.py passes every extra column to the chat template
  as a keyword argument. SpecForge re-renders and re-tokenizes the text with its own
  template, so the exact engine tokens are not preserved in this format.
- speculators (vllm-project/speculators): pre-tokenized rows,
      {"input_ids": [int, ...], "loss_mask": [0|1, ...]}
  src/speculators/data_generation/preprocessing.py takes rows that carry both columns as
  already masked (passthrough, no re-rendering) and loads local data only as .json/.jsonl
  (load_raw_dataset), hence JSONL, not Parquet. Its mask convention is ours (1 on target
  tokens, aligned with input_ids; src/speculators/models/eagle3/data.py shifts it by one).
- jsonl: every data/ column, one sample per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

import pyarrow.compute as pc
import pyarrow.fs as pafs

from eagle_data.errors import EagleDataError, MissingInput
from eagle_data.storage.contract import DATA_SCHEMA
from eagle_data.reader.samples import Out, row_filter
from eagle_data.storage.files import filesystem, write_atomically


def specforge_row(r: dict) -> dict:
    assistant = {"role": "assistant", "content": r["response"]}
    if r["reasoning"]:
        assistant["reasoning_content"] = r["reasoning"]
    history = [{k: v for k, v in m.items() if v is not None} for m in r["messages"]]
    return {"id": r["sample_id"], "conversations": [*history, assistant]}


def speculators_row(r: dict) -> dict:
    return {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}


# format -> (columns read, row converter, finish reasons exported by default)
FORMATS: dict[str, tuple[tuple[str, ...], Callable[[dict], dict], tuple[str, ...] | None]] = {
    # A cut-off answer re-rendered through a chat template gets an end-of-turn token the
    # model never produced, teaching the draft to stop mid-answer: only finished rows.
    "specforge": (("sample_id", "messages", "reasoning", "response"), specforge_row, ("stop",)),
    # Token-exact formats keep cut-off rows as generated (no stop token is invented).
    "speculators": (("input_ids", "loss_mask"), speculators_row, None),
    "jsonl": (tuple(DATA_SCHEMA.names), dict, None),
}


def export(out_path: str, dest: str, fmt: str, finish_reason: Sequence[str] | None = None,
           source: Sequence[str] | None = None, overwrite: bool = False, allow_empty: bool = False) -> dict:
    """Write OUT's data/ to DEST as JSONL in `fmt`. finish_reason None = the format's
    default (specforge: "stop" only; others: all rows). DEST appears only once complete;
    an existing DEST is replaced only with `overwrite`, and a result of 0 rows is an error
    (DEST untouched) unless `allow_empty`. Returns counts, with the rows each filter removed."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    columns, convert, default_finish = FORMATS[fmt]
    out = Out(out_path)
    if not out.files:
        raise MissingInput(f"{out_path} has no data/ shards to export")
    finish_reason = finish_reason if finish_reason is not None else default_finish
    removed = filter_counts(out, finish_reason, source)
    fs, path = filesystem(dest)
    check_dest(fs, path, dest, overwrite)

    rows = 0

    def write(tmp: str) -> None:
        nonlocal rows
        with fs.open_output_stream(tmp) as f:
            for batch in out.batches(columns, filter=row_filter(finish_reason, source)):
                lines = [json.dumps(convert(r), ensure_ascii=False) for r in batch.to_pylist()]
                if lines:
                    f.write(("\n".join(lines) + "\n").encode())
                rows += len(lines)
        # Raised before the move: an empty result never replaces DEST.
        if rows == 0 and not allow_empty:
            raise EagleDataError(f"export: no rows left after the filters ({describe(removed)}); "
                                 f"{dest} was not written. Change the filters, or pass --allow-empty")

    write_atomically(fs, path, write)  # beside DEST, hidden: DEST may be anywhere
    return {"format": fmt, "dest": dest, "rows": rows, "removed_by_filter": removed}


def filter_counts(out: Out, finish_reason: Sequence[str] | None, source: Sequence[str] | None) -> dict:
    """{filter: rows it removes on its own}: what a filter costs, said before it is applied."""
    removed = {}
    for name, values in (("finish_reason", finish_reason), ("source", source)):
        if values is not None:
            kept = sum(b.num_rows for b in out.batches([name], filter=pc.field(name).isin(list(values))))
            total = sum(b.num_rows for b in out.batches([name]))
            removed[f"{name} in {list(values)}"] = total - kept
    return removed


def describe(removed: dict) -> str:
    return "; ".join(f"{name} removed {n} rows" for name, n in removed.items()) or "no filter"


def check_dest(fs, path: str, dest: str, overwrite: bool) -> None:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        raise EagleDataError(f"export: {dest} is a folder; give a file name, e.g. {dest.rstrip('/')}/train.jsonl")
    if info.type == pafs.FileType.File and not overwrite:
        raise EagleDataError(f"export: {dest} exists; pass --overwrite to replace it")
    parent = path.rsplit("/", 1)[0] if "/" in path else "."
    parent_info = fs.get_file_info(parent)
    if parent_info.type == pafs.FileType.File:
        raise EagleDataError(f"export: {parent} is a file, so {dest} cannot be created under it")
    fs.create_dir(parent, recursive=True)


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write OUT/data as JSONL for a peer trainer (SpecForge, speculators)")
    p.add_argument("out", help="the OUT folder (local path or URI)")
    p.add_argument("dest", help="the JSONL file to write (local path or URI); speculators "
                                "needs a name ending in .jsonl")
    p.add_argument("--format", required=True, choices=sorted(FORMATS), dest="format")
    p.add_argument("--finish-reason", nargs="+", choices=["stop", "length"], default=None,
                   help="rows to keep (default: specforge 'stop', other formats all)")
    p.add_argument("--source", nargs="+", default=None, help="keep only these sources")
    p.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    p.add_argument("--allow-empty", action="store_true", help="write DEST even when no row is left")
    return p


def run_cli(args: argparse.Namespace) -> int:
    counts = export(args.out, args.dest, args.format, args.finish_reason, args.source,
                    args.overwrite, args.allow_empty)
    if counts["removed_by_filter"]:
        print(f"export: filters: {describe(counts['removed_by_filter'])}", file=sys.stderr)
    print(json.dumps(counts, sort_keys=True))
    return 0
