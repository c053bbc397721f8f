"""Reading the chat dataset (the sample is picked in job/sample.py).

Every row becomes `row_id` (hash of its content), `source` and `raw` (the row as JSON text).
Keeping the row as text until the prompts stage parses it means a malformed row (wrong
types, missing keys, a line that is not JSON) cannot break Arrow's schema inference or
crash a reader: it reaches the prompts stage and is skipped there with a reason.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os

import pyarrow as pa
import ray

from eagle_data.config import SourceConfig
from eagle_data.errors import MissingInput

log = logging.getLogger("eagle_data")

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
RAW_SCHEMA = pa.schema([("row_id", pa.string()), ("source", pa.string()), ("raw", pa.string())])


def local_files(dataset: str) -> list[str] | None:
    """The data files a local path or glob names, or None when `dataset` is a hub id."""
    if glob.has_magic(dataset):
        files = sorted(glob.glob(dataset, recursive=True))
    elif os.path.isdir(dataset):
        files = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(dataset)
            for f in names
            if f.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)
        )
    elif os.path.isfile(dataset):
        files = [dataset]
    elif dataset.startswith((".", "/", "~")):
        raise MissingInput(f"source.dataset {dataset!r} does not exist")
    else:
        return None
    if not files:
        raise MissingInput(f"source.dataset {dataset!r} matches no parquet/jsonl files")
    other = [f for f in files if not f.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)]
    if other:
        raise MissingInput(f"source.dataset {dataset!r}: unsupported file type(s) {other[:3]}; "
                           "use parquet or jsonl")
    return [os.path.abspath(f) for f in files]


def read_source(cfg: SourceConfig) -> ray.data.Dataset:
    files = local_files(cfg.dataset)
    if files is None:
        import datasets  # hub id: datasets downloads (or reuses its cache), Ray reads it

        try:
            hf = datasets.load_dataset(cfg.dataset, split=cfg.split)
        except Exception as e:  # network, cache miss, unknown id or split: all the user's to fix
            raise MissingInput(f"source.dataset {cfg.dataset!r} (split {cfg.split!r}) cannot be loaded "
                               f"from the hub or its local cache: {type(e).__name__}: {e}") from None
        return ray.data.from_huggingface(hf).map_batches(table_to_raw, batch_format="pyarrow")
    parquet = [f for f in files if f.endswith(PARQUET_SUFFIXES)]
    jsonl = [f for f in files if f.endswith(JSON_SUFFIXES)]
    parts = []
    if parquet:
        parts.append(ray.data.read_parquet(parquet).map_batches(table_to_raw, batch_format="pyarrow"))
    if jsonl:
        parts.append(ray.data.read_text(jsonl).map_batches(lines_to_raw, batch_format="pyarrow"))
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def _row_id(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _source_of(row) -> str:
    source = row.get("source") if isinstance(row, dict) else None
    return source if isinstance(source, str) else ""


def table_to_raw(table: pa.Table) -> pa.Table:
    rows = []
    for row in table.to_pylist():
        raw = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
        rows.append((_row_id(raw), _source_of(row), raw))
    return _raw_table(rows)


def lines_to_raw(table: pa.Table) -> pa.Table:
    rows = []
    for line in table.column("text").to_pylist():
        line = line.strip()
        if not line:
            continue  # blank lines are not rows
        try:
            source = _source_of(json.loads(line))
        except ValueError:
            source = ""  # not JSON: skipped later as bad_json
        rows.append((_row_id(line), source, line))
    return _raw_table(rows)


def _raw_table(rows: list[tuple[str, str, str]]) -> pa.Table:
    columns = list(zip(*rows)) if rows else [[], [], []]
    return pa.Table.from_arrays([pa.array(c, pa.string()) for c in columns], schema=RAW_SCHEMA)
