"""The engine stage: one contract, two backends.

In: `sample_id`, `tokenized_prompt` (list[int]), `sampling_params` (dict) and carried columns.
Out: the columns of Ray's vLLM stage (`vLLMOutputData`: `prompt`, `prompt_token_ids`,
`num_input_tokens`, `generated_tokens`, `generated_text`, `num_generated_tokens`, ...) plus
`__inference_error__` ("" on success) and the carried columns. A row the engine fails on
is an error row, not a crashed job.

Log-probabilities (`sampling_params["logprobs"]` = k > 0, from `sampling.logprobs`): each ok
row also carries, per generated token in order (T = num_generated_tokens),
`top_logprob_ids` [T, k] int32 (the target's k most likely ids at that step, by rank, best
first), `top_logprobs` [T, k] float32 (their log-probabilities) and `token_logprobs` [T]
float32 (the sampled token's own, which is one of the top k or not). Each column holds one
value per row: the array's bytes (little-endian, C order; `logprob_values`), which the
postprocess stage turns into data/'s fixed-size lists without a Python object per token.
Bytes, not list<list<...>>: Ray's processor passes every row through Python (its
postprocess `map`), where nested lists cost a Python object per value: 5-12 us per
generated token at k = 1..20 against 0.2-0.4 us for bytes (benchmarks/
postprocess_throughput.py --logprobs, docs/performance.md, section 8). vLLM's
own `logprobs` column (Ray's list of per-token dicts) stays null: ray_internals.py takes the
values from vLLM's output directly. The values are vLLM's default `logprobs_mode`,
`raw_logprobs`: log_softmax of the model's raw logits in float32, before temperature,
top-p and penalties (a property of the target, not of the sampling); the transformers
backend computes the same from `generate`'s raw logits. Ties among equal log-probabilities
are ordered as torch.topk orders them, which both backends use (no lowest-id-first rule).
"""

from __future__ import annotations

import logging
import re
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import ray

from eagle_data.config import Config
from eagle_data.errors import ConfigError, EngineStartFailed
from eagle_data.storage.contract import LOGPROB_COLUMNS

# The classes whose Ray Data actors are engine replicas (vllm_backend's is a subclass of Ray's UDF).
ENGINE_CLASSES = ("TransformersEngine", "TransformersHiddenStates", "VLLMEngine")

log = logging.getLogger("eagle_data")

LOGPROB_DTYPES = ("<i4", "<f4", "<f4")  # how each of LOGPROB_COLUMNS' bytes are read back


def logprob_values(top_ids: np.ndarray, top_logprobs: np.ndarray, token_logprobs: np.ndarray) -> dict:
    """One row's log-probability columns as the engine stage emits them (module docstring)."""
    arrays = (top_ids, top_logprobs, token_logprobs)
    return {name: np.ascontiguousarray(a, dtype).tobytes()
            for name, a, dtype in zip(LOGPROB_COLUMNS, arrays, LOGPROB_DTYPES)}


def refuse_owned(typed: dict[str, tuple[str, Any]], passed: dict) -> None:
    """A pass-through engine kwarg that a typed key owns is refused: it would go over the
    typed value, which the prompts phase and the tokenizer use (`typed` is what the
    backend's builder sets, {kwarg: (owning key, value)}, so the two cannot drift)."""
    for kwarg in passed:
        if kwarg in typed:
            raise ConfigError(f"engine.engine_kwargs.{kwarg}: set {typed[kwarg][0]} instead "
                              "(the job uses that value elsewhere too)")


def with_passed(typed: dict[str, tuple[str, Any]], passed: dict) -> dict:
    """A builder's kwargs: what the typed keys set (None: not passed, the library's default),
    then the pass-through ones, none of which may be one a typed key owns."""
    refuse_owned(typed, passed)
    return {**{k: v for k, (_, v) in typed.items() if v is not None}, **passed}


def check_engine_kwargs(cfg: Config) -> None:
    """At start, before any work: refuse_owned against the configured backend's builder."""
    if cfg.engine.backend == "vllm":
        from eagle_data.job.stages.engines.vllm_backend import typed_engine_kwargs

        refuse_owned(typed_engine_kwargs(cfg), cfg.engine.engine_kwargs)
    else:
        from eagle_data.job.stages.engines.transformers_backend import typed_from_pretrained

        refuse_owned(typed_from_pretrained(cfg.model.path, cfg.model.trust_remote_code), cfg.engine.engine_kwargs)


@contextmanager
def engine_start_errors(cfg: Config) -> Iterator[None]:
    """Around a pass that runs the engine: a replica that cannot start is one line, its
    root cause and the settings to check (exit 2). Ray raises an ActorDiedError after ~40 s
    whose cause is only on the last line of a 60-line traceback."""
    ray_data_errors = logging.getLogger("ray.data.exceptions")  # Ray 2.60's omit_traceback_stdout
    hide = HideEngineStartTrace()
    ray_data_errors.addFilter(hide)
    try:
        yield
    except ray.exceptions.RayActorError as e:
        cause = start_failure(str(e))
        if cause is None:
            raise
        raise EngineStartFailed(f"the engine could not start: {cause} (check {start_settings(cfg, cause)})") from None
    finally:
        ray_data_errors.removeFilter(hide)


class HideEngineStartTrace(logging.Filter):
    """Ray Data logs an actor that died as a Ray bug ("please open an issue"), with its full
    traceback, while it raises it; an engine's start failure is said in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]  # logged in its except block
        return not (isinstance(error, ray.exceptions.RayActorError) and start_failure(str(error)))


def start_failure(message: str) -> str | None:
    """The root cause (the traceback's last line) of an engine actor whose creation task
    raised; None for any other actor error."""
    message = re.sub(r"\x1b\[[0-9;]*m", "", message)  # Ray colours the actor's name
    if "creation task" not in message or not any(f"({name})" in message for name in ENGINE_CLASSES):
        return None
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else None


def start_settings(cfg: Config, cause: str) -> str:
    """The keys to check: the pass-through ones the cause names, else what reaches the engine."""
    named = [f"engine.engine_kwargs.{k}" for k in cfg.engine.engine_kwargs if str(k) in cause]
    if named:
        return ", ".join(named)
    if cfg.engine.backend == "vllm":
        return ("model.path, engine.max_model_len, engine.tensor_parallel_size, engine.engine_kwargs; "
                "the engine replica's log has vLLM's own messages")
    return "model.path, model.trust_remote_code, engine.engine_kwargs (transformers' from_pretrained)"


def apply_engine(ds: ray.data.Dataset, cfg: Config, pad_id: int) -> ray.data.Dataset:
    if cfg.engine.backend == "vllm":
        from eagle_data.job.stages.engines.vllm_backend import engine_summary, vllm_stage, wait_for_replica_resources

        wait_for_replica_resources(cfg)  # before the pipeline starts: never hang on a missing GPU
        log.info("engine: %s", engine_summary(cfg))
        return vllm_stage(ds, cfg)
    from eagle_data.job.stages.engines.transformers_backend import transformers_stage

    log.info("engine: transformers generate in a Ray actor pool, %d replica(s), model %s",
             cfg.engine.replicas, cfg.model.path)
    return transformers_stage(ds, cfg, pad_id)


def apply_hidden_states_engine(ds: ray.data.Dataset, cfg: Config, layer_ids: list[int], dtype: str,
                               scratch_dir: str) -> ray.data.Dataset:
    """The hidden-states pass: each row's features written to its `hidden_states_path`."""
    if cfg.engine.backend == "vllm":
        from eagle_data.job.stages.engines.vllm_backend import engine_summary, wait_for_replica_resources
        from eagle_data.job.stages.engines.vllm_hidden_states import vllm_hidden_states_stage

        wait_for_replica_resources(cfg)  # before the pipeline starts: never hang on a missing GPU
        log.info("engine: %s, extract_hidden_states at layer ids %s", engine_summary(cfg), layer_ids)
        return vllm_hidden_states_stage(ds, cfg, layer_ids, dtype, scratch_dir)
    from eagle_data.job.stages.engines.transformers_hidden_states import transformers_hidden_states_stage

    log.info("engine: transformers forward in a Ray actor pool, %d replica(s), layer ids %s",
             cfg.engine.replicas, layer_ids)
    return transformers_hidden_states_stage(ds, cfg, layer_ids, dtype)
