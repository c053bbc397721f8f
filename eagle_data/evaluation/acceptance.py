"""The acceptance job (`python -m ray_jobs.acceptance`, docs/acceptance.md): how many tokens
per step of the target each draft gets accepted, on prompts it never saw.

    output.path's prompts/ (the prompts phase's: made if missing, reused if its config
    matches; each conversation's first turn)
      -> one request per prompt and temperature (acceptance.temperatures): sampling.max_tokens,
         the target's stop tokens; above 0, top_p 1 and a seed per prompt (paired: the same
         for every pass)
      -> the target alone (acceptance.compare_target): its outputs and tokens/s
      -> each draft of acceptance.drafts as vLLM's EAGLE-3 speculator of the target,
         k = acceptance.num_speculative_tokens: each request's output and vLLM's counts of
         the draft tokens accepted and proposed at each step of the target
      -> each finished pass kept in acceptance.path/passes/ (passes.py): a rerun of the same
         command reuses it
      -> acceptance_report.py: tau and acceptance by position per temperature, per source
         with 95% intervals, the lossless check (greedy), tokens/s; report.json,
         per_prompt.jsonl, acceptance.png in acceptance.path, and the table for the job log

Each pass is the generate phase's vLLM engine stage (ray.data.llm's, `engine.replicas`
replicas as Ray actors: one per 8-GPU node in production), loading the target (and the
draft) once whatever the number of temperatures; the rows come back to the driver, nothing
is written to OUT.
"""

from __future__ import annotations

import hashlib
import logging
import time

import pyarrow as pa
import pyarrow.dataset as pads

from eagle_data.config import Config
from eagle_data.draft_files import check_draft_folder
from eagle_data.errors import ConfigError, EmptyResult, MissingInput
from eagle_data.evaluation import acceptance_report, passes, report_folder
from eagle_data.feature_shape import target_shape
from eagle_data.job.phases.generate import target_tokens
from eagle_data.job.phases.run import run
from eagle_data.job.stages.engines import engine_start_errors
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.job.stages.engines.vllm_backend import vllm_stage
from eagle_data.model_files import load_tokenizer, model_vocab_size
from eagle_data.storage.files import filesystem
from eagle_data.storage.shards import shard_files

log = logging.getLogger("eagle_data")

# vLLM's own default step budget (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS), the floor of
# the budget set for sampled passes on CPU (sampled_on_cpu).
DEFAULT_STEP_TOKENS = 2048
SAMPLED_SPEC_DECODE = "eagle_data.job.stages.engines.cpu_spec_decode.SampledSpecDecode"


def check(cfg: Config) -> None:
    """What the job needs, before anything starts: the vLLM engine, room for a draft to
    propose, a report folder of its own that it can write, and each draft a whole
    speculators EAGLE-3 draft for this target."""
    settings = cfg.acceptance
    if cfg.engine.backend != "vllm":
        raise ConfigError(f"engine.backend {cfg.engine.backend}: the acceptance job runs vLLM's speculative decoding "
                          "(engine.backend: vllm)")
    if not settings.drafts:
        raise ConfigError("acceptance.drafts is empty: name the drafts to measure, e.g. "
                          "{mine: /drafts/run/final} (the draft trainer's final/ folder)")
    if settings.path is None:
        raise ConfigError("acceptance.path is not set: give an absolute folder for the report")
    if cfg.sampling.max_tokens < 2:
        raise ConfigError(f"sampling.max_tokens {cfg.sampling.max_tokens} leaves a draft nothing to propose: an "
                          "answer's first token comes from the prompt's prefill, and a draft proposes only at the "
                          "steps after it; give 2 or more (k + 1 lets a draft propose all its k tokens at once)")
    sampled_on_cpu(cfg)  # refuses engine kwargs that would undo what sampled passes need on CPU
    num_layers, hidden_size = target_shape(cfg)
    vocab, _ = model_vocab_size(cfg.model.path, cfg.model.trust_remote_code)
    for name, folder in settings.drafts.items():
        check_draft(name, folder, num_layers, hidden_size, vocab)
    report_folder.prepare(settings.path)  # last: a run refused above makes no folder


def check_draft(name: str, folder: str, num_layers: int, hidden_size: int, vocab: int | None) -> None:
    """A speculators EAGLE-3 draft whose files are whole (draft_files.check_draft_folder) and
    whose shape fits this target: its hidden size, its aux layers among the target's, its
    vocabulary mapped onto the target's."""
    where = f"acceptance.drafts.{name} {folder}"
    draft = check_draft_folder(folder, where)
    layer = draft.config.get("transformer_layer_config") or {}
    layers = draft.config.get("eagle_aux_hidden_state_layer_ids") or []
    t2d = draft.shape("t2d")
    problems = []
    if layer.get("hidden_size") not in (None, hidden_size):
        problems.append(f"its hidden size is {layer.get('hidden_size')}, the target's {hidden_size}")
    if any(not 0 <= i < num_layers for i in layers):
        problems.append(f"its aux layers {layers} are not all among the target's {num_layers}")
    if t2d and vocab and t2d[0] != vocab:
        problems.append(f"its vocabulary maps a target of {t2d[0]} tokens, this one has {vocab}")
    if problems:
        raise ConfigError(f"{where} is a draft for another target than model.path: {'; '.join(problems)}")


def sampled_on_cpu(cfg: Config) -> dict:
    """The engine kwargs sampled passes need on vLLM's CPU build (where they are
    {}: no temperature above 0, or not on CPU); settings of engine.engine_kwargs that would
    undo them are refused (ConfigError).

    - Every prompt's prefill in one engine step: there a seeded request whose prefill is split
      across steps crashes the engine (`CPU Generator does not use offset`, vLLM 0.29's CPU
      model runner), and Ray restarts the replica without end, so the job would hang.
      Chunked prefill off, a step budget of at least max_model_len (vLLM's own choice for its
      CPU MLA models); a prompt that does not fit a step waits for the next.
    - The rejection sampler's expansion of each request's temperature made right
      (engines/cpu_spec_decode.py, as vLLM's worker extension): vLLM's CPU replacement of it
      leaves the temperatures uninitialized, and every output of a batch holding a sampled
      request, greedy ones too, came out wrong."""
    if cfg.engine.device != "cpu" or not any(t > 0 for t in cfg.acceptance.temperatures):
        return {}
    given = cfg.engine.engine_kwargs
    why = "with acceptance.temperatures above 0 on engine.device=cpu (docs/acceptance.md, \"Passes\")"
    if given.get("enable_chunked_prefill", False) is not False:
        raise ConfigError(f"engine.engine_kwargs.enable_chunked_prefill {given['enable_chunked_prefill']!r} {why}: vLLM's "
                          "CPU build crashes on a seeded request whose prefill is split across engine steps (the job "
                          "would hang), so the acceptance job turns chunked prefill off; leave it unset")
    budget = given.get("max_num_batched_tokens", max(DEFAULT_STEP_TOKENS, cfg.engine.max_model_len))
    if not isinstance(budget, int) or budget < cfg.engine.max_model_len:
        raise ConfigError(f"engine.engine_kwargs.max_num_batched_tokens {budget!r} {why}: with chunked prefill off a "
                          f"step must hold a whole prompt, so give at least engine.max_model_len "
                          f"({cfg.engine.max_model_len}), or leave it unset")
    if given.get("worker_extension_cls") not in (None, SAMPLED_SPEC_DECODE):
        raise ConfigError(f"engine.engine_kwargs.worker_extension_cls {given['worker_extension_cls']!r} {why}: the "
                          f"acceptance job sets it to {SAMPLED_SPEC_DECODE} (vLLM's CPU rejection sampler made right); "
                          "leave it unset")
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget,
            "worker_extension_cls": SAMPLED_SPEC_DECODE}


def prompts(cfg: Config, fresh: bool = False, keep_prompts: bool = False, allow_empty: bool = False) -> pa.Table | None:
    """output.path's prompts (the prompts phase run first, or reused; `fresh`, `keep_prompts`
    and `allow_empty` as the generate job's flags for it): sample_id, source and the tokens
    of each conversation's first turn. None when there is none and `allow_empty`."""
    run(cfg, phase="prompts", fresh=fresh, keep_prompts=keep_prompts, allow_empty=allow_empty)
    fs, root = filesystem(cfg.output.path)
    files = shard_files(fs, f"{root}/prompts")
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table(
        columns=["sample_id", "source", "tokenized_prompt"]) if files else None
    if table is None or not table.num_rows:
        if allow_empty:
            return None
        raise EmptyResult(f"{cfg.output.path}: no prompt to measure the drafts on (--allow-empty: exit 0 then)")
    return table.sort_by("sample_id")


def request_seed(seed: int, sample_id: str) -> int:
    """A sampled request's seed: from acceptance.seed and the prompt's sample_id, so the same
    for the target and every draft (their differences are paired), and for every run."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def requests(table: pa.Table, cfg: Config, stop_token_ids: list[int]) -> pa.Table:
    """Each prompt's request at each temperature: sampling.max_tokens, the target's stop
    tokens, measured; above 0, top_p 1 and the prompt's seed."""
    base = {"max_tokens": cfg.sampling.max_tokens, "stop_token_ids": stop_token_ids, "detokenize": False,
            "top_p": 1.0, "extra_args": {"measure": True}}
    parts = []
    for temperature in cfg.acceptance.temperatures:
        # Every request has the same keys (one Arrow struct: a key missing in one is null in all).
        params = [{**base, "temperature": temperature,
                   "seed": request_seed(cfg.acceptance.seed, sid) if temperature > 0 else None}
                  for sid in table.column("sample_id").to_pylist()]
        parts.append(table.append_column("temperature", pa.array([temperature] * table.num_rows, pa.float64()))
                     .append_column("sampling_params", pa.array(params)))
    return pa.concat_tables(parts, promote_options="default")


def answer(table: pa.Table, cfg: Config, draft: str | None) -> list[dict]:
    """One pass of the engine over the requests: the target, with `draft` as its EAGLE-3
    speculator when given; each request's row (passes.ROW_KEYS)."""
    import ray

    extra = sampled_on_cpu(cfg)
    if draft:  # vLLM refuses per-request counts without a speculator
        extra.update({"speculative_config": {"model": draft, "method": "eagle3",
                                             "num_speculative_tokens": cfg.acceptance.num_speculative_tokens},
                      "per_request_spec_decode_metrics": "detailed"})
    blocks = max(1, -(-table.num_rows // cfg.engine.batch_size))
    ds = ray.data.from_arrow(table).repartition(blocks)
    with engine_start_errors(cfg):  # a replica that cannot start (a draft vLLM refuses): one line
        rows = vllm_stage(ds, cfg, extra).take_all()  # every column: a failed row has no measurement
    failed = [r for r in rows if r.get(ENGINE_ERROR_COLUMN) or r.get("engine_started") is None]
    if failed or len(rows) != table.num_rows:
        first = f": {failed[0].get(ENGINE_ERROR_COLUMN)}" if failed and failed[0].get(ENGINE_ERROR_COLUMN) else ""
        raise MissingInput(f"the engine{' with draft ' + draft if draft else ''} answered {len(rows) - len(failed)} of "
                           f"{table.num_rows} requests{first} (see the replicas' log above)")
    return [passes.plain(r) for r in rows]


def measured(cfg: Config, table: pa.Table, stop_token_ids: list[int], draft_name: str | None, fresh: bool) -> list[dict]:
    """One pass's rows: kept from an earlier run of the same settings (passes.py), or measured
    now and kept before the next pass starts."""
    folder = cfg.acceptance.path
    draft = cfg.acceptance.drafts[draft_name] if draft_name is not None else None
    label = "the target alone" if draft_name is None else f"draft {draft_name}"
    name = passes.pass_name(draft_name)
    decided = passes.settings(cfg, passes.prompts_digest(table.column("sample_id").to_pylist(),
                                                          table.column("tokenized_prompt").to_pylist()),
                              stop_token_ids, draft)
    rows = None if fresh else passes.kept(folder, name, decided, label)
    if rows is None:
        log.info("acceptance: %s: measuring %d requests", label, table.num_rows)
        started = time.monotonic()
        rows = answer(table, cfg, draft)
        passes.keep(folder, name, decided, rows, time.monotonic() - started)
    return rows


def measure(cfg: Config, fresh: bool = False, keep_prompts: bool = False,
            allow_empty: bool = False) -> tuple[dict, str] | None:
    """The whole job once `check` passed: every pass (each kept as it finishes; with `fresh`
    none reused), then the report, written to acceptance.path; the report and its table.
    None when there is no prompt and `allow_empty`."""
    table = prompts(cfg, fresh, keep_prompts, allow_empty)
    if table is None:
        return None
    stop_token_ids = list(target_tokens(cfg, load_tokenizer(cfg.model.tokenizer_path,
                                                            cfg.model.trust_remote_code)).eos_ids)
    settings = cfg.acceptance
    asked = requests(table, cfg, stop_token_ids)
    log.info("acceptance: %d prompts at temperature %s, k = %d, %d draft(s): %s", table.num_rows,
             ", ".join(map(acceptance_report.temperature_key, settings.temperatures)), settings.num_speculative_tokens,
             len(settings.drafts), ", ".join(settings.drafts))
    target = measured(cfg, asked, stop_token_ids, None, fresh) if settings.compare_target else None
    drafts = {name: measured(cfg, asked, stop_token_ids, name, fresh) for name in settings.drafts}
    figures = acceptance_report.report(drafts, target, settings.num_speculative_tokens, settings.temperatures,
                                       settings.bootstrap, settings.seed)
    acceptance_report.write(figures, drafts, settings.path)
    return figures, acceptance_report.table(figures)
