"""`export OUT DEST --format ...`: OUT as a peer trainer reads it directly.

JSONL formats (specforge, speculators, jsonl) write data/ as one JSONL file; offline
formats (specforge-offline, speculators-offline, modelopt-offline) write data/ together with
OUT/hidden_states/ as each peer's OFFLINE training folder. Both stream: record batches for
JSONL, one sample's tensors at a time for the offline formats (read by byte range through
eagle_data.reader), so an OUT of any size exports in bounded memory. DEST (a local path or
URI for JSONL, a local folder for the offline formats) appears only once complete; only a
regular file (JSONL) or a folder this tool wrote (offline) is ever replaced, and only with
--overwrite: a symlink, a FIFO or a device is refused, named.

JSONL formats, matched against the peers' current readers (field names and types, not code):

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
- jsonl: every data/ column, one sample per line; with the top-k log-probabilities
  (sampling.logprobs) also `top_logprob_ids`, `top_logprobs` ([[...k] per generated token])
  and `token_logprobs` as stored (one entry per generated token, not padded to input_ids).

Offline (hidden-states) formats. OUT stores, per sample, [T, n_layers, H] at ascending vLLM
layer ids (id k = the residual stream after k decoder layers; the last, L, the final state
BEFORE the final norm). All three peers' EAGLE-3 defaults are the same states: aux layers
at vLLM ids [2, L/2, L-3] (SpecForge's SGLang ids [1, L/2-1, L-4] are captured before
layer id+1 runs; Model-Optimizer's 0-based decoder indices [1, L/2-1, L-4] are HF
hidden_states[id+1]) plus the final state, which is what the hidden-states phase stores by
default. Each format needs the final state (id L) among the OUT's layer ids; the aux
states are the others, in ascending order, concatenated along the hidden dim where the
peer concatenates. input_ids and loss_mask are data/'s, exactly (the target's tokens, mask
1 on generated target tokens, aligned with input_ids, which is also how each peer's own
capture script stores its mask); every tensor has the sample's T rows (no padding).
Hidden-state dtype: the OUT's (hidden_states.dtype). Files are numbered in export order
(data/ file order, then row order); DEST/.eagle-data-export.json records the format, the
counts and the sample_id of every file in that order.

- specforge-offline (sgl-project/SpecForge, scripts/prepare_hidden_states.py output, read
  by specforge/data/preprocessing.py OfflineEagle3Dataset / list_local_files, and by
  specforge/runtime/data_plane/offline_reader.py OfflineManifestReader):
      DEST/rows_<g>-<g+2000>/data_<i>.ckpt  (g = i rounded down to 2000: HiddenStatesGenerator
      _get_file_path, file_group_size 2000), torch.save of
      {"input_ids": int64 [T], "loss_mask": int64 [T],
       "aux_hidden_state": [1, T, 3H]  (the 3 aux states concatenated, ascending),
       "hidden_state": [1, T, H]        (the final state AFTER the final norm)}
  The keys are the eagle3 OfflineCaptureLayout (specforge/algorithms/eagle3/providers.py,
  specforge/algorithms/common/providers.py materialize); the leading 1 is the batch dim
  their capture adds (`.unsqueeze(0)`) and their loader squeezes (process_data:
  `data["aux_hidden_state"].squeeze(0)[:max_len]`). `hidden_state` is POST-norm: their
  capture stores SGLang's logits-processor input (specforge/offline_capture/sglang_backend/
  utils.py: `last_hidden_states=pruned_states`, after the model's norm), which their trainer
  feeds to the target lm_head. Exactly 3 aux states are required
  (specforge/algorithms/model_providers.py resolve_eagle_capture_layers). Train with
  `data.hidden_states_path: DEST`; write the vocab with `vocab --format specforge`.
- speculators-offline (vllm-project/speculators 0.9.0, `python -m speculators.train` with
  speculators/train/data.py ArrowDataset + hs_connectors FileTransfer):
      DEST/                    a datasets.save_to_disk folder, torch format, columns
                               input_ids (int64 list), loss_mask (int64 list), seq_len (int64),
                               as src/speculators/data_generation/preprocessing.py
                               build_speculator_training_dataset / scripts/prepare_data.py write
      DEST/hidden_states/hs_<i>.safetensors   i = the dataset row (ArrowDataset._map_to_file_idx,
                               FileTransfer.get_cached), holding
          {"hidden_states": [T, n_layers, H], "token_ids": int64 [T]}
  as vLLM's ExampleHiddenStatesConnector writes them (vllm/distributed/kv_transfer/
  kv_connector/v1/example_hidden_states_connector.py: `token_ids` from torch.tensor(prompt
  ids)) and scripts/data_generation_offline.py names them. The layers are OUT's as stored:
  the final one PRE-norm, as vLLM's extract_hidden_states gives it (ArrowDataset takes
  `hidden_states[:, :-1].flatten(1)` as the aux input and `hidden_states[:, -1]` as
  verifier_last_hidden_states); `token_ids` equals the row's input_ids, which ArrowDataset
  checks with torch.equal. Train with `--data-path DEST` and the same target layer ids;
  `vocab --format speculators --dest DEST` puts d2t-<D>.npy/t2d-<D>.npy where it looks
  (with `--draft-vocab-size D`).
- modelopt-offline (NVIDIA/Model-Optimizer, examples/speculative_decoding/
  collect_hidden_states/compute_hidden_states_hf.py output, read by
  modelopt/torch/speculative/eagle/utils.py OfflineSupervisedDataset, files found by
  examples/speculative_decoding/eagle_utils.py `rglob("*.pt")`):
      DEST/<sample_id>.pt, torch.save of
      {"input_ids": int64 [T], "hidden_states": [T, H] (final state AFTER the final norm:
       HF `hidden_states[-1]`), "aux_hidden_states": [T, n_aux*H] (concatenated, ascending),
       "loss_mask": int64 [T], "conversation_id": sample_id}
  `conversation_id` names the file, as in theirs (`{conversation_id}.pt`), so it is the
  sample_id (unique; under turns: all one conversation has several rows). The loader uses
  the stored loss_mask only with `training.answer_only_loss: true` (else all ones): set it.
  No `hidden_states_prenorm` key: absent means post-norm there, which this is.

Pre/post norm: OUT keeps the final state pre-norm; specforge-offline and modelopt-offline
apply the target's final RMSNorm, x * rsqrt(mean(x^2) + eps) * weight computed in float32
and cast to the OUT's dtype, with `model.norm.weight` (or the text model's) read from the
target's safetensors and `rms_norm_eps` from its config.json (the hidden-states run's
model.path, or --model). The conversion is exact up to the dtype's rounding (float32 OUT:
float32 rounding; bfloat16: one bf16 rounding of the float32 result, where HF's Qwen3/Llama
RMSNorm rounds to bf16 before the weight multiply, so values may differ by one bf16 ulp).
When the weight or eps cannot be found, or the norm is not a plain RMSNorm (Gemma's
1 + weight), the export refuses rather than guess.

DEST of an offline format is a local folder written as a hidden sibling
(`.<name>.<id>.tmp`) and renamed into place once complete. An existing DEST is refused
unless --overwrite, and even then replaced only when it is a real folder this tool wrote
(it holds .eagle-data-export.json): never a file, a symlink, a device or another folder.
Only samples with published hidden states are exported; the counts say how many of the
filtered rows had none (`without_hidden_states`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import sys
import uuid
from typing import Callable, Iterator, Sequence

import pyarrow.compute as pc
import pyarrow.fs as pafs

from eagle_data.config import FINISH_REASONS
from eagle_data.errors import EagleDataError, MissingInput, NotWritable
from eagle_data.storage.contract import DATA_SCHEMA, LOGPROB_COLUMNS
from eagle_data.model_files import is_hub_id, model_config, resolve_model_path, text_config_value
from eagle_data.reader.samples import OutReader, Samples
from eagle_data.storage.selection import row_filter
from eagle_data.storage.files import filesystem, not_a_regular_file, refuse_inside_out, write_atomically


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
           source: Sequence[str] | None = None, overwrite: bool = False, allow_empty: bool = False,
           model: str | None = None) -> dict:
    """Write OUT's data/ to DEST as JSONL in `fmt`, or with its hidden states as a peer's
    offline folder (OFFLINE_FORMATS). finish_reason None = the format's default
    (specforge: "stop" only; others: all rows). DEST appears only once complete; an
    existing DEST is replaced only with `overwrite`, and a result of 0 rows is an error
    (DEST untouched) unless `allow_empty`. `model` (offline formats) overrides the target
    path the final norm is read from. Returns counts, with the rows each filter removed."""
    if fmt in OFFLINE_FORMATS:
        return export_offline(out_path, dest, fmt, finish_reason, source, overwrite, allow_empty, model)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join([*FORMATS, *OFFLINE_FORMATS])}")
    columns, convert, default_finish = FORMATS[fmt]
    out = OutReader(out_path)
    refuse_inside_out(out_path, dest, "export:")
    if not out.files:
        raise MissingInput(f"{out_path} has no data/ shards to export")
    if fmt == "jsonl":  # every column its shards hold: the log-probabilities too, when the OUT has them;
        held = out.dataset().schema.names  # no answered_by in shards written before it
        columns = (*(c for c in columns if c in held), *(c for c in LOGPROB_COLUMNS if c in held))
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


def filter_counts(out: OutReader, finish_reason: Sequence[str] | None, source: Sequence[str] | None) -> dict:
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
    """Refuse a DEST that cannot or may not be replaced, before any row is read. Only a
    regular file is ever replaced (and only with --overwrite): a symlink, a FIFO or a device
    is refused whatever the options (write_atomically checks again before its move)."""
    kind = not_a_regular_file(fs, path)
    if kind == "a folder":
        raise EagleDataError(f"export: {dest} is a folder; give a file name, e.g. {dest.rstrip('/')}/train.jsonl")
    if kind is not None:
        raise NotWritable(f"export: {dest} is {kind}, not a regular file: refusing to replace it, even with "
                          "--overwrite (export writes only regular files); give another DEST")
    if fs.get_file_info(path).type == pafs.FileType.File and not overwrite:
        raise EagleDataError(f"export: {dest} exists; pass --overwrite to replace it")
    parent = path.rsplit("/", 1)[0] if "/" in path else "."
    parent_info = fs.get_file_info(parent)
    if parent_info.type == pafs.FileType.File:
        raise EagleDataError(f"export: {parent} is a file, so {dest} cannot be created under it")
    fs.create_dir(parent, recursive=True)


# ------------------------------------------------------------------ offline formats

MARKER = ".eagle-data-export.json"  # in every offline DEST: what wrote it, and the sample order
SPECFORGE_GROUP = 2000  # SpecForge HiddenStatesGenerator file_group_size default
# Where a final norm's weight lives, for text models and the text model of multimodal ones.
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
             "model.text_model.norm.weight", "text_model.norm.weight", "model.model.norm.weight")


class OfflineSample:
    """One exported sample: data/'s tokens and the OUT's stored states [T, layers, H]."""

    def __init__(self, item: dict, aux: list[int], final: int):
        import torch

        self.sample_id = item["sample_id"]
        self.input_ids = torch.from_numpy(item["input_ids"]).to(torch.int64)  # the reader's int64 arrays
        self.loss_mask = torch.from_numpy(item["loss_mask"]).to(torch.int64)
        self.states = item["hidden_states"]
        self.aux, self.final = aux, final

    def aux_concat(self):
        """[T, n_aux * H]: the aux states concatenated along the hidden dim, ascending ids."""
        return self.states[:, self.aux].reshape(self.states.shape[0], -1)


class FinalNorm:
    """The target's final RMSNorm, applied in float32 and cast back."""

    def __init__(self, weight, eps: float, where: str):
        self.weight, self.eps, self.where = weight.float(), float(eps), where

    def __call__(self, x):
        import torch

        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return h.to(x.dtype)


def final_norm(model_path: str, trust_remote_code: bool = False) -> FinalNorm:
    """The final norm of the target at `model_path`: weight from its safetensors, eps from
    its config. Refuses (EagleDataError) when either cannot be found."""
    path = resolve_model_path(model_path)
    folder = path if os.path.isdir(path) else _hub_snapshot(path) if is_hub_id(path) else None
    if folder is None:
        raise EagleDataError(f"export: the final norm's weight is needed and {model_path!r} is not a model folder "
                             "with safetensors; pass --model PATH (the target's local folder)")
    config, where = model_config(folder, trust_remote_code)
    if config is None:
        raise EagleDataError(f"export: {folder}: no config.json ({where}); pass --model PATH")
    model_type = str(text_config_value(config, "model_type") or config.get("model_type") or "")
    if model_type.startswith("gemma"):
        raise EagleDataError(f"export: {folder} is a {model_type} model, whose final norm multiplies by "
                             "(1 + weight); this export applies plain RMSNorm only")
    eps = text_config_value(config, "rms_norm_eps")
    if eps is None:
        raise EagleDataError(f"export: {where} has no rms_norm_eps: cannot apply the final norm")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    index_file = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [weight_map[k] for k in NORM_KEYS if k in weight_map][:1] or files
    from safetensors import safe_open

    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            keys = set(f.keys())
            for key in NORM_KEYS:
                if key in keys:
                    return FinalNorm(f.get_tensor(key), eps, f"{folder}/{name}:{key}, rms_norm_eps {eps}")
    raise EagleDataError(f"export: no final-norm weight ({' / '.join(NORM_KEYS)}) in the safetensors of "
                         f"{folder}: cannot convert the final state to post-norm; pass --model PATH")


def _hub_snapshot(repo_id: str) -> str | None:
    """A hub model's local snapshot (cache only: the export downloads nothing)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"], local_files_only=True)
    except Exception:  # not cached, no hub library: the caller says what to do
        return None


def _save_torch(obj: dict, path: str) -> None:
    import torch

    torch.save(obj, path)


def write_specforge(dest: str, i: int, s: OfflineSample, norm: FinalNorm) -> None:
    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    folder = os.path.join(dest, f"rows_{g}-{g + SPECFORGE_GROUP}")
    os.makedirs(folder, exist_ok=True)
    _save_torch({"input_ids": s.input_ids.clone(), "loss_mask": s.loss_mask.clone(),
                 "aux_hidden_state": s.aux_concat().unsqueeze(0).clone(),
                 "hidden_state": norm(s.states[:, s.final]).unsqueeze(0).contiguous()},
                os.path.join(folder, f"data_{i}.ckpt"))


def write_modelopt(dest: str, i: int, s: OfflineSample, norm: FinalNorm) -> None:
    _save_torch({"input_ids": s.input_ids.clone(), "hidden_states": norm(s.states[:, s.final]).contiguous(),
                 "aux_hidden_states": s.aux_concat().clone(), "loss_mask": s.loss_mask.clone(),
                 "conversation_id": s.sample_id}, os.path.join(dest, f"{s.sample_id}.pt"))


def write_speculators_hs(dest: str, i: int, s: OfflineSample, norm: None) -> None:
    from safetensors.torch import save_file

    folder = os.path.join(dest, "hidden_states")
    os.makedirs(folder, exist_ok=True)
    save_file({"hidden_states": s.states.contiguous(), "token_ids": s.input_ids.clone()},
              os.path.join(folder, f"hs_{i}.safetensors"))


# format -> (writer of one sample, needs the post-norm final state, exactly this many aux states or None)
OFFLINE_FORMATS: dict[str, tuple[Callable, bool, int | None]] = {
    "specforge-offline": (write_specforge, True, 3),
    "speculators-offline": (write_speculators_hs, False, None),
    "modelopt-offline": (write_modelopt, True, None),
}


def export_offline(out_path: str, dest: str, fmt: str, finish_reason: Sequence[str] | None,
                   source: Sequence[str] | None, overwrite: bool, allow_empty: bool,
                   model: str | None = None) -> dict:
    writer, post_norm, n_aux = OFFLINE_FORMATS[fmt]
    if "://" in dest and not dest.startswith("file://"):
        raise EagleDataError(f"export: --format {fmt} writes a local folder (the peer's trainer reads local "
                             f"files); {dest} is not a local path")
    dest_path = os.path.abspath(os.path.expanduser(dest.removeprefix("file://")))
    out = OutReader(out_path)
    refuse_inside_out(out_path, dest, "export:")
    if not out.files:
        raise MissingInput(f"{out_path} has no data/ shards to export")
    features = out.manifest.phase("hidden_states").get("features")
    if not features:
        raise MissingInput(f"{out_path} has no hidden states: run the job's hidden-states phase "
                           "(hidden_states.enabled) first")
    num_layers = int(features["num_layers"])
    check_offline_dest(dest_path, dest, overwrite)
    removed = filter_counts(out, finish_reason, source)
    samples = Samples(out, finish_reason=finish_reason, source=source, shuffle=False, hidden_states=True,
                      columns=["sample_id"])
    layer_ids = samples.hidden_layer_ids
    if num_layers not in layer_ids:
        raise EagleDataError(f"export: {fmt} needs the final state (layer id {num_layers}) and the OUT's "
                             f"hidden states have layer ids {layer_ids}; rerun the phase with it")
    aux = [slot for slot, k in enumerate(layer_ids) if k != num_layers]
    final = layer_ids.index(num_layers)
    if fmt == "speculators-offline" and final != len(layer_ids) - 1:
        raise EagleDataError(f"export: speculators reads the last layer as the final state; layer ids {layer_ids}")
    if n_aux is not None and len(aux) != n_aux:
        raise EagleDataError(f"export: {fmt} takes exactly {n_aux} aux layers besides the final one; the OUT has "
                             f"layer ids {layer_ids} (final {num_layers})")
    norm = None
    if post_norm:
        norm = final_norm(model or hidden_states_model(out), out.manifest.trust_remote_code)

    parent, name = os.path.split(dest_path)
    tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex}.tmp")
    os.makedirs(tmp)
    rows = 0
    try:
        with open(os.path.join(tmp, ".sample_ids"), "w") as ids:
            def each() -> Iterator[OfflineSample]:
                nonlocal rows
                for item in samples:
                    s = OfflineSample(item, aux, final)
                    writer(tmp, rows, s, norm)
                    ids.write(s.sample_id + "\n")
                    rows += 1
                    yield s

            if fmt == "speculators-offline":
                write_speculators_dataset(tmp, each(), f"{tmp}.cache")
            else:
                for _ in each():
                    pass
        if rows == 0 and not allow_empty:
            raise EagleDataError(f"export: no samples with hidden states left after the filters ({describe(removed)}; "
                                 f"{samples.missing_hidden_states} without hidden states); {dest} was not written. "
                                 "Change the filters, or pass --allow-empty")
        if rows == 0 and fmt == "speculators-offline":
            raise EagleDataError(f"export: speculators-offline cannot hold 0 samples (datasets cannot load an "
                                 f"empty saved dataset, so speculators could not read it); {dest} was not "
                                 "written. Change the filters")
        counts = {"format": fmt, "dest": dest, "rows": rows, "removed_by_filter": removed,
                  "without_hidden_states": samples.missing_hidden_states, "layer_ids": layer_ids,
                  "aux_layer_ids": [layer_ids[a] for a in aux], "final_layer_id": num_layers,
                  "final_norm": "post" if post_norm else "pre", "dtype": samples.hidden_dtype}
        if norm is not None:
            counts["final_norm_from"] = norm.where
        with open(os.path.join(tmp, ".sample_ids")) as f:
            order = f.read().split()
        os.remove(os.path.join(tmp, ".sample_ids"))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({**counts, "out": out.root, "sample_ids": order}, f)
        replace_dir(tmp, dest_path, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(f"{tmp}.cache", ignore_errors=True)
    return counts


def write_speculators_dataset(dest: str, samples: Iterator[OfflineSample], cache: str) -> None:
    """The datasets.save_to_disk folder speculators' ArrowDataset loads: input_ids,
    loss_mask (int64 lists) and seq_len (int64), torch format, one row per hs_<i> file.
    Rows stream through a Parquet file in `cache` (memory: one row group of tokens).
    No rows: nothing is written (datasets cannot load an empty saved dataset)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(cache, exist_ok=True)
    schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                        ("seq_len", pa.int64())])
    staged = os.path.join(cache, "rows.parquet")
    with pq.ParquetWriter(staged, schema) as w:
        batch, rows = [], 0
        for s in samples:
            batch.append({"input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist(),
                          "seq_len": len(s.input_ids)})
            rows += 1
            if len(batch) == 256:
                w.write_table(pa.Table.from_pylist(batch, schema))
                batch = []
        if batch:
            w.write_table(pa.Table.from_pylist(batch, schema))
    if rows == 0:
        return
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the command prints its counts; no bars from datasets
    try:
        ds = datasets.Dataset.from_parquet(staged, features=features, cache_dir=os.path.join(cache, "hf"))
        ds.set_format(type="torch")
        ds.save_to_disk(dest)
    finally:
        if bars:
            datasets.enable_progress_bars()


def hidden_states_model(out: OutReader) -> str:
    """The target that made the hidden states: the latest hidden-states run's model.path."""
    runs = out.manifest.phase("hidden_states").get("runs", [])
    config = runs[-1].get("config", {}) if runs else out.manifest.config
    path = config.get("model", {}).get("path")
    if not path:
        raise EagleDataError(f"export: {out.root}/manifest.json records no model.path; pass --model PATH")
    return path


def is_export_folder(path: str) -> bool:
    """A folder this tool wrote: a real folder (not a symlink) holding its marker file."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and os.path.isfile(os.path.join(path, MARKER)) \
            and not os.path.islink(os.path.join(path, MARKER))
    except OSError:
        return False


def check_offline_dest(path: str, dest: str, overwrite: bool) -> None:
    """Refuse an offline DEST that may not be replaced, before any sample is read: what is
    at `path` is named (lstat: a symlink is not followed) and refused whatever the options,
    unless it is a real folder this tool wrote; that one needs --overwrite."""
    parent = os.path.dirname(path)
    above = parent
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise EagleDataError(f"export: {above} is not a folder, so {dest} cannot be created under it")
    if os.path.lexists(path):
        kind = not_a_regular_file(pafs.LocalFileSystem(), path) or "a regular file"
        if kind != "a folder":
            raise NotWritable(f"export: {dest} is {kind}, not a folder: refusing to replace it, even with "
                              "--overwrite; give another DEST")
        if not is_export_folder(path):
            raise EagleDataError(f"export: {dest} is a folder this tool did not write (no {MARKER}); "
                                 "refusing to replace it: give another DEST, or remove it yourself")
        if not overwrite:
            raise EagleDataError(f"export: {dest} exists; pass --overwrite to replace it")
    os.makedirs(parent, exist_ok=True)


def replace_dir(tmp: str, path: str, dest: str) -> None:
    """Move the finished `tmp` to `path`. An existing `path` (an export folder: checked before
    the export, and again now) is first moved aside to a hidden sibling, then deleted."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    if not is_export_folder(path):
        raise EagleDataError(f"export: {dest} changed during the export and is no longer a folder this tool "
                             "wrote; refusing to replace it")
    parent, name = os.path.split(path)
    old = os.path.join(parent, f".{name}.{uuid.uuid4().hex}.old")
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old)


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write OUT/data as JSONL, or with its hidden states as an offline training "
                       "folder, for a peer trainer (SpecForge, speculators, Model-Optimizer)")
    p.add_argument("out", help="the OUT folder (local path or URI)")
    p.add_argument("dest", help="the JSONL file to write (local path or URI; speculators needs a name ending "
                                "in .jsonl), or for a *-offline format the local folder to write")
    p.add_argument("--format", required=True, choices=sorted([*FORMATS, *OFFLINE_FORMATS]), dest="format")
    p.add_argument("--finish-reason", nargs="+", choices=FINISH_REASONS, default=None,
                   help="rows to keep (default: specforge 'stop', other formats all)")
    p.add_argument("--source", nargs="+", default=None, help="keep only these sources")
    p.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    p.add_argument("--allow-empty", action="store_true",
                   help="write DEST even when no row is left (not speculators-offline: datasets cannot load it)")
    p.add_argument("--model", default=None,
                   help="*-offline formats that store the final state post-norm (specforge, modelopt): the "
                        "target's local folder to read the final norm from (default: the model.path the "
                        "hidden-states phase ran with)")
    p.set_defaults(run=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    counts = export(args.out, args.dest, args.format, args.finish_reason, args.source,
                    args.overwrite, args.allow_empty, args.model)
    if counts["removed_by_filter"]:
        print(f"export: filters: {describe(counts['removed_by_filter'])}", file=sys.stderr)
    print(json.dumps(counts, sort_keys=True))
    return 0
