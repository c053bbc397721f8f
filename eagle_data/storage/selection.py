"""Which data/ rows a reader, an export or the hidden-states phase takes: a filter over the
small columns (finish reason, source, total length), the rows it selects, and the rows a
trainer holds out for validation."""

from __future__ import annotations

import hashlib
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from eagle_data.storage.shards import shard_files


def row_filter(finish_reason: Sequence[str] | None = None, source: Sequence[str] | None = None,
               min_len: int | None = None, max_len: int | None = None) -> pc.Expression | None:
    """A pyarrow expression over the small columns; None when nothing is filtered.
    Lengths are total lengths (prompt + generated), bounds inclusive."""
    conds = []
    if finish_reason is not None:
        conds.append(pc.field("finish_reason").isin(list(finish_reason)))
    if source is not None:
        conds.append(pc.field("source").isin(list(source)))
    if min_len is not None or max_len is not None:
        total = (pc.field("num_prompt_tokens").cast(pa.int64())
                 + pc.field("num_reasoning_tokens") + pc.field("num_response_tokens"))
        if min_len is not None:
            conds.append(total >= min_len)
        if max_len is not None:
            conds.append(total <= max_len)
    if not conds:
        return None
    expr = conds[0]
    for c in conds[1:]:
        expr = expr & c
    return expr


def selected_rows(fs, data_folder: str, finish_reason: Sequence[str] | None = None,
                  source: Sequence[str] | None = None, files: Sequence[str] | None = None) -> pa.Table:
    """sample_id and num_tokens (prompt + generated) of the data/ rows these filters select
    (of `files`, the readable shards, where the caller knows some are not)."""
    files = shard_files(fs, data_folder) if files is None else files
    if not files:
        return pa.table({"sample_id": pa.array([], pa.string()), "num_tokens": pa.array([], pa.int64())})
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table(
        columns=["sample_id", "num_prompt_tokens", "num_reasoning_tokens", "num_response_tokens"],
        filter=row_filter(finish_reason, source))
    n = pc.add(pc.add(table.column("num_prompt_tokens").cast(pa.int64()), table.column("num_reasoning_tokens")),
               table.column("num_response_tokens"))
    return pa.table({"sample_id": table.column("sample_id"), "num_tokens": n})


SPLITS = ("train", "validation")


def held_out(prompt_ids: Sequence[str], fraction: float, seed: int) -> list[bool]:
    """Whether each row is a validation row: a seeded hash of its prompt_id below `fraction`.
    By prompt, not by row: every answer to a prompt and every turn of its conversations fall
    on the same side, so no validation prompt is trained on; and the same prompt is held out
    in every OUT made from it (the target's answers, the dataset's)."""
    bound = round(fraction * 2**64)
    return [int.from_bytes(hashlib.blake2b(f"{seed}:{p}".encode(), digest_size=8).digest(), "big") < bound
            for p in prompt_ids]
