"""Damaged OUT shards: found before a run starts, moved aside, and their work redone."""

from __future__ import annotations

import logging
import os

import pyarrow.parquet as pq

from eagle_data.errors import DamagedShard
from eagle_data.storage.contract import HIDDEN_STATES, PROMPTS_ROW_COUNTS, QUARANTINE
from eagle_data.storage.hidden_states import (Index, ShardHeaderError, damaged, input_ids_digests, read_bytes,
                                             read_header, stale)
from eagle_data.storage.folder import Output
from eagle_data.storage.provenance import all_shards, shard_problem
from eagle_data.storage.shards import read_checked, shard_files

log = logging.getLogger("eagle_data")


def quarantine_corrupt(out: Output) -> list[str]:
    """Move shards that do not read back whole (truncated, overwritten, a byte flipped in
    a page: every page is read and its checksum checked) out of the folders that are
    read, into OUT/quarantine/, so that resume and readers never take them as data. Their
    samples are then simply not done and get generated again; a damaged prompts/ or
    skipped/ shard makes the prompts phase run again. Cost: one read of OUT's Parquet per
    run; of hidden-states shards only the headers and sizes (hidden_problem). A Parquet shard
    whose footer (a hidden-states shard: header) names another OUT or config than the manifest (copied in from another OUT,
    or made by an older eagle-data) is quarantined the same way (storage/provenance.py)."""
    moved = []
    for folder, path in all_shards(out):
        problem_of = hidden_problem if folder == HIDDEN_STATES else read_problem
        problem = problem_of(out.fs, path) or shard_problem(out, folder, path)
        if problem:
            _quarantine(out, folder, path, problem)
            moved.append(path)
            if folder in ("prompts", "skipped"):
                out.manifest.mark("prompts", "damaged")
    if moved:
        out.manifest.save()
    return moved


def quarantine_hidden_states(out: Output) -> list[str]:
    """Before the hidden-states phase runs: move aside each hidden-states shard with an
    entry that is damaged (its bytes do not match their crc32: every byte is read, one
    tensor at a time) or no longer its data/ row's (computed from other tokens: the row was
    answered again; or written before shards recorded which tokens). The phase then redoes
    every sample of that shard. An entry with no data/ row is left (verify names it)."""
    digests = input_ids_digests(out.fs, shard_files(out.fs, out.folder("data")))
    moved = []
    for sample_id, entry in Index.read(out.fs, out.folder(HIDDEN_STATES)).entries.items():
        if entry.shard in moved:
            continue
        problem = (sample_id in digests and stale(entry, digests[sample_id])) or damaged(entry, read_bytes(out.fs, entry))
        if problem:
            _quarantine(out, HIDDEN_STATES, entry.shard, f"sample_id {sample_id}: {problem}")
            moved.append(entry.shard)
    return moved


def _quarantine(out: Output, folder: str, path: str, problem: str) -> None:
    dest = f"{out.folder(QUARANTINE)}/{folder}/{os.path.basename(path)}"
    out.fs.create_dir(os.path.dirname(dest), recursive=True)
    out.fs.move(path, dest)
    log.warning("quarantined shard %s -> %s (%s)", path, dest, problem)

def check_prompts_record(out: Output) -> None:
    """A finished prompts phase whose prompts/ or skipped/ no longer hold the rows it
    recorded (a shard deleted) is made again: prompts are deterministic, so the ids
    already in data/ stay valid. prompts/ rows are conversations (PROMPTS_ROW_COUNTS)."""
    if not out.manifest.finished("prompts"):
        return
    counts = out.manifest.counts("prompts")
    for folder, key in PROMPTS_ROW_COUNTS.items():
        rows = sum(_rows(out.fs, f) for f in shard_files(out.fs, out.folder(folder)))
        if rows != counts.get(key):
            log.warning("%s/ holds %d rows, the prompts phase recorded %s %s: making the prompts again",
                        folder, rows, counts.get(key), key)
            out.manifest.mark("prompts", "damaged")
            out.manifest.save()
            return


def missing_data_rows(out: Output, files: list[str]) -> str | None:
    """Why data/ (its shards `files`) cannot be read as the generate phase left it: it holds
    fewer rows than that phase recorded ok (counts over every run, at its last finish) -- a
    shard deleted or moved out since, or quarantined by a run that has not answered its
    samples again yet --, or None. More rows than recorded is a later run adding rows (one
    may still be running); an OUT with no recorded count (no finished generate run) is not
    checked. A consumer reading on would silently train on fewer samples."""
    recorded = out.manifest.counts("generate").get("ok")
    if not recorded:
        return None
    rows = sum(_rows(out.fs, f) for f in files)
    if rows >= recorded:
        return None
    return (f"{out.root}/data holds {rows} rows, fewer than the {recorded} ok rows the generate phase recorded "
            "(a shard deleted or moved out of data/ since, or quarantined as damaged by a run)")


def read_problem(fs, path: str) -> str | None:
    """Why a shard does not read back whole, or None."""
    try:
        read_checked(fs, path)
    except DamagedShard as e:
        return e.why
    return None


def hidden_problem(fs, path: str) -> str | None:
    """Why a hidden-states shard is damaged (its header, or fewer bytes than it lists), or
    None. Its values are checked by `verify` (crc32), not here: that reads every byte."""
    try:
        _, entries = read_header(fs, path)
    except (ShardHeaderError, OSError) as e:
        return str(e)
    end = max((e.end for e in entries.values()), default=0)
    size = fs.get_file_info(path).size
    return None if size == end else f"{size} bytes, its header lists {end}"


def _rows(fs, path: str) -> int:
    with fs.open_input_file(path) as f:
        return pq.read_metadata(f).num_rows
