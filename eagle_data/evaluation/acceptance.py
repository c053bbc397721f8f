"""The acceptance job (`python -m ray_jobs.acceptance`, docs/acceptance.md): how many tokens
per step of the target each draft gets accepted, on prompts it never saw.

    output.path's prompts/ (the prompts phase's: made if missing, reused if its config
    matches; each conversation's first turn)
      -> one request a prompt: greedy, sampling.max_tokens, the target's stop tokens
      -> the target alone (acceptance.compare_target): its outputs and tokens/s
      -> each draft of acceptance.drafts as vLLM's EAGLE-3 speculator of the target,
         k = acceptance.num_speculative_tokens: each prompt's output and vLLM's counts of the
         draft tokens accepted and proposed at each step of the target
      -> acceptance_report.py: tau and acceptance by position, per source with 95% intervals,
         the lossless check, tokens/s; report.json, per_prompt.jsonl, acceptance.png in
         acceptance.path, and the table for the job log

Each pass is the generate phase's vLLM engine stage (ray.data.llm's, `engine.replicas`
replicas as Ray actors: one per 8-GPU node in production), loading the target (and the
draft) once; the rows come back to the driver, nothing is written to OUT.
"""

from __future__ import annotations

import json
import logging
import os

import pyarrow as pa
import pyarrow.dataset as pads

from eagle_data.config import Config
from eagle_data.errors import ConfigError, EmptyResult, ForeignFiles, MissingInput, NotWritable
from eagle_data.evaluation import acceptance_report
from eagle_data.feature_shape import target_shape
from eagle_data.job.phases.generate import target_tokens
from eagle_data.job.phases.run import run
from eagle_data.job.stages.engines import engine_start_errors
from eagle_data.job.stages.engines.vllm_backend import vllm_stage
from eagle_data.model_files import load_tokenizer, model_vocab_size
from eagle_data.storage.files import filesystem
from eagle_data.storage.shards import shard_files

log = logging.getLogger("eagle_data")

REPORT_FILES = ("report.json", "per_prompt.jsonl", "acceptance.png")
COLUMNS = ("sample_id", "source", "generated_tokens", "engine_started", "engine_finished", "spec_accepted",
           "spec_drafted")


def check(cfg: Config) -> None:
    """What the job needs, before anything starts: the vLLM engine, a report folder of its
    own, and each draft a speculators EAGLE-3 draft for this target."""
    settings = cfg.acceptance
    if cfg.engine.backend != "vllm":
        raise ConfigError(f"engine.backend {cfg.engine.backend}: the acceptance job runs vLLM's speculative decoding "
                          "(engine.backend: vllm)")
    if not settings.drafts:
        raise ConfigError("acceptance.drafts is empty: name the drafts to measure, e.g. "
                          "{mine: /drafts/run/final} (the draft trainer's final/ folder)")
    if settings.path is None:
        raise ConfigError("acceptance.path is not set: give an absolute folder for the report")
    check_report_folder(settings.path)
    num_layers, hidden_size = target_shape(cfg)
    vocab, _ = model_vocab_size(cfg.model.path, cfg.model.trust_remote_code)
    for name, folder in settings.drafts.items():
        check_draft(name, folder, num_layers, hidden_size, vocab)


def check_report_folder(folder: str) -> None:
    """The report goes in a folder that is new, empty or holds only an earlier report."""
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise NotWritable(f"acceptance.path {folder} is a file: give a folder")
        foreign = sorted(set(os.listdir(folder)) - set(REPORT_FILES))
        if foreign:
            raise ForeignFiles(f"acceptance.path {folder} holds files the acceptance job did not write "
                               f"({', '.join(foreign[:5])}): choose an empty or new folder")


def check_draft(name: str, folder: str, num_layers: int, hidden_size: int, vocab: int | None) -> None:
    """A speculators EAGLE-3 draft (config.json, model.safetensors) whose shape fits this
    target: its hidden size, its aux layers among the target's, its vocabulary mapped onto
    the target's."""
    where = f"acceptance.drafts.{name} {folder}"
    config_file = os.path.join(folder, "config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise MissingInput(f"{where}: not a draft folder ({type(e).__name__} reading config.json): give a folder in "
                           "speculators' format, such as the draft trainer's final/") from None
    if config.get("speculators_model_type") != "eagle3" or not os.path.exists(os.path.join(folder, "model.safetensors")):
        raise MissingInput(f"{where}: not a speculators EAGLE-3 draft (its config.json says speculators_model_type "
                           f"{config.get('speculators_model_type')!r}; model.safetensors "
                           f"{'present' if os.path.exists(os.path.join(folder, 'model.safetensors')) else 'missing'})")
    layer = config.get("transformer_layer_config") or {}
    layers = config.get("eagle_aux_hidden_state_layer_ids") or []
    t2d = draft_tensor_shape(folder, "t2d")
    problems = []
    if layer.get("hidden_size") not in (None, hidden_size):
        problems.append(f"its hidden size is {layer.get('hidden_size')}, the target's {hidden_size}")
    if any(not 0 <= i < num_layers for i in layers):
        problems.append(f"its aux layers {layers} are not all among the target's {num_layers}")
    if t2d and vocab and t2d[0] != vocab:
        problems.append(f"its vocabulary maps a target of {t2d[0]} tokens, this one has {vocab}")
    if problems:
        raise ConfigError(f"{where} is a draft for another target than model.path: {'; '.join(problems)}")


def draft_tensor_shape(folder: str, name: str) -> list[int] | None:
    """A tensor's shape in the draft's model.safetensors header (no tensor read)."""
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return header.get(name, {}).get("shape")


def prompts(cfg: Config) -> pa.Table:
    """output.path's prompts (the prompts phase run first, or reused): sample_id, source and
    the tokens of each conversation's first turn."""
    run(cfg, phase="prompts")
    fs, root = filesystem(cfg.output.path)
    files = shard_files(fs, f"{root}/prompts")
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table(
        columns=["sample_id", "source", "tokenized_prompt"]) if files else None
    if table is None or not table.num_rows:
        raise EmptyResult(f"{cfg.output.path}: no prompt to measure the drafts on")
    return table.sort_by("sample_id")


def requests(table: pa.Table, cfg: Config) -> pa.Table:
    """Each prompt's request: greedy, sampling.max_tokens, the target's stop tokens, measured."""
    special = target_tokens(cfg, load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code))
    params = {"max_tokens": cfg.sampling.max_tokens, "temperature": 0.0, "stop_token_ids": list(special.eos_ids),
              "detokenize": False, "extra_args": {"measure": True}}
    return table.append_column("sampling_params", pa.array([params] * table.num_rows))


def answer(table: pa.Table, cfg: Config, draft: str | None) -> list[dict]:
    """One pass of the engine over the requests: the target, with `draft` as its EAGLE-3
    speculator when given; each prompt's row of COLUMNS."""
    import ray

    extra = {}
    if draft:  # vLLM refuses per-request counts without a speculator
        extra = {"speculative_config": {"model": draft, "method": "eagle3",
                                        "num_speculative_tokens": cfg.acceptance.num_speculative_tokens},
                 "per_request_spec_decode_metrics": "detailed"}
    blocks = max(1, -(-table.num_rows // cfg.engine.batch_size))
    ds = ray.data.from_arrow(table).repartition(blocks)
    with engine_start_errors(cfg):  # a replica that cannot start (a draft vLLM refuses): one line
        rows = vllm_stage(ds, cfg, extra).select_columns(list(COLUMNS)).take_all()
    failed = [r for r in rows if r.get("engine_started") is None]
    if failed or len(rows) != table.num_rows:
        raise MissingInput(f"the engine{' with draft ' + draft if draft else ''} answered {len(rows) - len(failed)} of "
                           f"{table.num_rows} prompts (see the replicas' log above)")
    return rows


def measure(cfg: Config) -> tuple[dict, str]:
    """The whole job once `check` passed: every pass, then the report, written to
    acceptance.path; the report and its table."""
    table = requests(prompts(cfg), cfg)
    settings = cfg.acceptance
    log.info("acceptance: %d prompts, k = %d, %d draft(s): %s", table.num_rows, settings.num_speculative_tokens,
             len(settings.drafts), ", ".join(settings.drafts))
    target = answer(table, cfg, None) if settings.compare_target else None
    passes = {name: answer(table, cfg, folder) for name, folder in settings.drafts.items()}
    figures = acceptance_report.report(passes, target, settings.num_speculative_tokens, settings.bootstrap,
                                       settings.seed)
    acceptance_report.write(figures, passes, settings.path)
    return figures, acceptance_report.table(figures)
