"""`vocab OUT --draft-vocab-size D`: the reduced vocabulary of an EAGLE-3 draft, from the
target's own training tokens.

An EAGLE-3 draft predicts over D target token ids (usually the 32,000 most frequent); its
trainer needs `d2t` (draft id -> target id, stored as the offset target - draft) and `t2d`
(a bool mask over the target vocabulary, True at the D chosen ids). The peers build these
by counting with a Python Counter row by row; here the counts stream from OUT/data one
Parquet row group at a time (np.bincount over the flattened `input_ids` where
`loss_mask == 1`), so memory is O(V) whatever the OUT size.

Selection: ids sorted by (count desc, id asc), the first D taken; when fewer than D ids
were seen, the lowest unused ids fill the rest (SpecForge PR #76 crashed on exactly this);
the chosen ids sorted ascending; d2t = ids - arange(D); t2d[ids] = True. This is
speculators' rule (build_vocab_mappings_from_distribution) and agrees with SpecForge's
except on ties, where SpecForge keeps Counter insertion order (not reproducible).

V is the target's embedding rows (`vocab_size` in the model's config.json), not
len(tokenizer): Qwen3 has 151,936 rows for 151,669 tokens, and every peer checks `t2d`
against the model's config (speculators raises on a mismatch).

Files under DEST (default OUT/vocab/), each written aside and renamed into place:

- always: `token_freq.parquet` (token_id int64, count int64; nonzero counts only) and
  `vocab.json` (sizes, filters, row/token counts, coverage): what the mapping came from.
- specforge (sgl-project/SpecForge): `vocab_mapping.pt` = torch.save({"d2t": int64 [D],
  "t2d": bool [V]}). Passed as `model.vocab_mapping_path` (specforge/config/schema.py);
  specforge/modeling/draft/base.py `load_vocab_mapping` torch.loads it (their tests with
  weights_only=True) and `copy_`s the two keys into the buffers that
  specforge/modeling/draft/llama3_eagle.py registers as t2d = bool [vocab_size] and
  d2t = int64 [draft_vocab_size]. Their own writer: specforge/data/preprocessing.py
  (`generate_vocab_mapping_file`, `process_token_dict_to_mappings`), also
  specforge/training/assembly.py (`_install_dataset_vocab_mapping`).
- speculators (vllm-project/speculators 0.9.0): `d2t-<D>.npy` (int64 [D]) and `t2d-<D>.npy`
  (bool [V]) with np.save, which its trainer (`python -m speculators.train`,
  speculators/train/cli.py `parse_vocab_mappings`, `_load_mappings`) looks for in
  `--data-path` under those names when given `--draft-vocab-size D` (or reads from
  `--d2t-path`/`--t2d-path`), with torch.from_numpy(np.load(...)); and `token_freq.pt`
  = torch.save(dict[int, int]) (speculators/train/vocab_mapping.py
  `save_token_frequency_distribution`), loaded with torch.load(weights_only=True) to
  rebuild the mapping for another D. speculators/model.py `load_vocab_mappings`
  checks t2d.shape[0] == the verifier's config vocab_size, t2d.sum() == D and
  d2t.shape[0] == D; its buffers are t2d bool and d2t long.
- modelopt (NVIDIA/Model-Optimizer, formerly TensorRT-Model-Optimizer): `d2t.pt` =
  torch.save(int64 tensor [D]), the recipe's `data.draft_vocab_cache` path
  (modelopt/torch/speculative/plugins/hf_training_args.py).
  modelopt/torch/speculative/plugins/hf_eagle.py `load_draft_vocab_cache` loads it with
  weights_only=True and requires shape and dtype equal to the `d2t` buffer
  (modeling_eagle.py: int64 [draft_vocab_size]); the target ids are arange(D) + d2t
  (`_map_logits_to_draft_vocab`). examples/speculative_decoding/scripts/
  calibrate_draft_vocab.py writes it as <save_dir>/<model name>/d2t.pt (frequency order,
  not sorted; any order works with arange + d2t).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagle_data.config import FINISH_REASONS
from eagle_data.errors import NotWritable, VocabError
from eagle_data.storage.files import check_replaceable, filesystem, not_a_regular_file, refuse_inside_out, write_bytes
from eagle_data.storage.folder import Output
from eagle_data.storage.provenance import data_identity
from eagle_data.reader.samples import OutReader
from eagle_data.storage.report import write_report
from eagle_data.tools.token_counts import count_tokens

DEFAULT_DRAFT_VOCAB_SIZE = 32_000
COVERAGE_SIZES = (8_000, 16_000, 32_000, 64_000)
FORMATS = ("specforge", "speculators", "modelopt")
FREQ_SCHEMA = pa.schema([("token_id", pa.int64()), ("count", pa.int64())])


# ---------------------------------------------------------------------------- selection

def check_sizes(draft_vocab_size: int, vocab_size: int) -> None:
    if vocab_size <= 0:
        raise VocabError(f"vocab size must be positive, got {vocab_size}")
    if not 0 < draft_vocab_size < vocab_size:
        raise VocabError(f"--draft-vocab-size {draft_vocab_size} must be in [1, {vocab_size}) "
                         f"(the target's vocab size): a draft as large as the target "
                         "needs no mapping")


def select_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The D chosen target ids, ascending. A stable sort on -count orders ties by id, and
    puts never-seen ids (count 0) after every seen one in id order: so when fewer than D ids
    were seen the lowest unused ids fill the draft, with no special case."""
    check_sizes(draft_vocab_size, counts.size)
    order = np.argsort(-counts, kind="stable")
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def mappings(ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [D], t2d bool [V]) for the chosen ids: target = draft + d2t[draft]."""
    d2t = ids.astype(np.int64) - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[ids] = True
    return d2t, t2d


def _cumulative(counts: np.ndarray) -> np.ndarray:
    """cum[k] = share of all masked tokens covered by the k+1 most frequent ids."""
    total = counts.sum()
    if total == 0:
        raise VocabError("no masked tokens were counted: coverage is undefined")
    return np.cumsum(np.sort(counts)[::-1]) / total


def coverage(counts: np.ndarray, sizes: Sequence[int] = (),
             standard: Sequence[int] = COVERAGE_SIZES) -> dict[int, float]:
    """Share of masked tokens the top-D ids cover, for the standard draft sizes below V and
    `sizes`: how much a larger draft vocabulary would buy."""
    cum = _cumulative(counts)
    wanted = sorted({d for d in (*standard, *sizes) if 0 < d < counts.size})
    return {d: float(cum[d - 1]) for d in wanted}


def coverage_curve(counts: np.ndarray, points: int = 40) -> dict[str, list]:
    """Coverage against draft size at ~`points` sizes spaced geometrically from 1 to V, for
    a plot: {"draft_vocab_size": [...], "coverage": [...]}."""
    cum = _cumulative(counts)
    sizes = np.unique(np.geomspace(1, counts.size, points).round().astype(np.int64))
    return {"draft_vocab_size": sizes.tolist(), "coverage": cum[sizes - 1].round(6).tolist()}


# ------------------------------------------------------------------------------ writing

def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _torch_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _freq_parquet(counts: np.ndarray) -> bytes:
    ids = np.flatnonzero(counts).astype(np.int64)
    table = pa.table({"token_id": ids, "count": counts[ids]}, schema=FREQ_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _specforge(d2t, t2d, counts) -> dict[str, Callable[[], bytes]]:
    import torch

    return {"vocab_mapping.pt": lambda: _torch_bytes(
        {"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)})}


def _speculators(d2t, t2d, counts) -> dict[str, Callable[[], bytes]]:
    # Plain Python ints: torch.load(weights_only=True) accepts them, numpy scalars it does not.
    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    # The names speculators' trainer looks for in --data-path with --draft-vocab-size D.
    return {f"d2t-{d2t.size}.npy": lambda: _npy(d2t), f"t2d-{d2t.size}.npy": lambda: _npy(t2d),
            "token_freq.pt": lambda: _torch_bytes(freq)}


def _modelopt(d2t, t2d, counts) -> dict[str, Callable[[], bytes]]:
    import torch

    return {"d2t.pt": lambda: _torch_bytes(torch.from_numpy(d2t))}


WRITERS = {"specforge": _specforge, "speculators": _speculators, "modelopt": _modelopt}


def write_files(dest: str, formats: Sequence[str], d2t: np.ndarray, t2d: np.ndarray,
                counts: np.ndarray, summary: dict) -> list[str]:
    """Each format's files plus token_freq.parquet and vocab.json under DEST; returns the
    paths. Everything is serialised before the first file lands, so a failure mid-way
    (e.g. torch missing) leaves no half set."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise VocabError(f"unknown format(s) {sorted(unknown)}; choose from {', '.join(FORMATS)} or all")
    fs, folder = filesystem(dest)
    if fs.get_file_info(folder).type not in (pafs.FileType.Directory, pafs.FileType.NotFound):
        raise NotWritable(f"vocab: {dest} is {not_a_regular_file(fs, folder) or 'a regular file'}, not a folder; "
                          "give --dest a folder")
    files = {"token_freq.parquet": _freq_parquet(counts)}
    for fmt in formats:
        files.update({name: make() for name, make in WRITERS[fmt](d2t, t2d, counts).items()})
    names = sorted([*files, "vocab.json"])
    files["vocab.json"] = json.dumps({**summary, "files": names}, indent=1).encode()
    for name in names:  # a name that may not be replaced stops the set before its first file
        check_replaceable(fs, f"{folder}/{name}")
    # Written aside beside their names (DEST may be outside OUT): a reader never sees half a file.
    return [write_bytes(fs, f"{folder}/{name}", data) for name, data in files.items()]


# ------------------------------------------------------------------------- the command

def vocab_size_from_manifest(out: str) -> int | None:
    """The target's embedding rows as recorded by the generate phase, or None."""
    value = OutReader(out).tokenizer.get("model_vocab_size")
    return int(value) if value is not None else None


def build_vocab(out: str, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
                vocab_size: int | None = None, dest: str | None = None,
                formats: Sequence[str] = FORMATS, finish_reason: Sequence[str] | None = None,
                source: Sequence[str] | None = None) -> dict:
    """Count OUT's masked tokens, choose the draft vocabulary and write it for `formats`.
    vocab_size: the size of a synthetic OUT that records none (tests and benchmarks); it
    never overrides the manifest's generate.tokenizer.model_vocab_size, which a t2d of
    another length would contradict (every trainer checks it against the model). Returns
    the summary written to vocab.json (coverage keys are draft sizes)."""
    recorded = vocab_size_from_manifest(out)
    if recorded is not None and vocab_size not in (None, recorded):
        raise VocabError(f"vocab size {vocab_size} differs from the {recorded} {out}/manifest.json records "
                         "(phases.generate.tokenizer.model_vocab_size, the target's config.json vocab_size): "
                         "the draft vocabulary is built for the model that made the OUT")
    vocab_size = recorded if recorded is not None else vocab_size
    if vocab_size is None:
        raise VocabError(f"{out}/manifest.json records no phases.generate.tokenizer.model_vocab_size "
                         "(the target's config.json vocab_size, recorded since eagle-data 0.1.0): "
                         "run the generate phase on this OUT, or make it again")
    check_sizes(draft_vocab_size, vocab_size)
    if dest is not None:
        refuse_inside_out(out, dest, "vocab: --dest", allowed=f"{out.rstrip('/')}/vocab")
    made_from = data_identity(Output.existing(out))  # before counting: a vocabulary of these rows
    counted = count_tokens(out, vocab_size, finish_reason, source)
    ids = select_ids(counted.counts, draft_vocab_size)
    d2t, t2d = mappings(ids, vocab_size)
    summary = {
        "draft_vocab_size": draft_vocab_size, "vocab_size": vocab_size,
        "filters": {"finish_reason": finish_reason, "source": source},
        "rows": counted.rows, "rows_counted": counted.kept, "rows_removed": counted.removed,
        "tokens": counted.tokens, "distinct_ids": int(np.count_nonzero(counted.counts)),
        "coverage": coverage(counted.counts, [draft_vocab_size]),
        "coverage_curve": coverage_curve(counted.counts),
        "made_from": made_from,  # the report shows this coverage only while data/ is still this
    }
    summary["files"] = write_files(dest or f"{out.rstrip('/')}/vocab", formats, d2t, t2d, counted.counts, summary)
    if dest is None:  # OUT/vocab/vocab.json: the report shows the coverage curve
        try:
            write_report(Output.existing(out))
        except Exception as e:  # the vocabulary is complete: no report error fails it (as in the job)
            print(f"vocab: the files are written, but the report could not be rewritten ({type(e).__name__}: {e}); "
                  f"run `python -m eagle_data report {out}`", file=sys.stderr)
    return summary


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "vocab", help="choose an EAGLE-3 draft vocabulary (d2t/t2d) from OUT's target tokens")
    p.add_argument("out", help="the OUT folder (local path or URI)")
    p.add_argument("--draft-vocab-size", type=int, default=DEFAULT_DRAFT_VOCAB_SIZE,
                   help=f"ids in the draft vocabulary (default {DEFAULT_DRAFT_VOCAB_SIZE})")
    p.add_argument("--dest", default=None, help="folder to write (default OUT/vocab)")
    p.add_argument("--format", choices=[*FORMATS, "all"], default="all", dest="format",
                   help="whose trainer the files are for (default all)")
    p.add_argument("--finish-reason", nargs="+", choices=FINISH_REASONS, default=None,
                   help="count only these rows (default all)")
    p.add_argument("--source", nargs="+", default=None, help="count only these sources")
    p.set_defaults(run=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    formats = FORMATS if args.format == "all" else (args.format,)
    summary = build_vocab(args.out, args.draft_vocab_size, None, args.dest,
                          formats, args.finish_reason, args.source)
    shown = {k: v for k, v in summary.items() if k != "coverage_curve"}
    print(json.dumps(shown, sort_keys=True))
    for d, share in summary["coverage"].items():
        print(f"top {d:>6} ids cover {share:.2%} of {summary['tokens']} masked tokens")
    return 0
