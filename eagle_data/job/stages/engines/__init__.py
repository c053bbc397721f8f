"""The engine stage: one contract, two backends (and the dataset's own answers).

In: `sample_id`, `tokenized_prompt` (list[int]), `sampling_params` (dict) and carried columns.
Out: the columns of Ray's vLLM stage (`vLLMOutputData`: `prompt`, `prompt_token_ids`,
`num_input_tokens`, `generated_tokens`, `generated_text`, `num_generated_tokens`, ...) plus
`__inference_error__` (outputs.py `ENGINE_ERROR_COLUMN`, "" on success) and the carried
columns. A row the engine fails on is an error row, not a crashed job.

With `sampling_params["logprobs"]` = k > 0 each ok row also carries the log-probability
columns (logprobs.py). The modules: vllm_backend.py (Ray's vLLM stage, its UDF in
vllm_udf.py), transformers_backend.py, their hidden-states passes, outputs.py (the output
columns), kwargs.py (typed and passed-through engine kwargs), stats.py (vLLM's counters for
the progress line), processes.py and exit_noise.py (a quiet exit). With prompt.answers=dataset
no engine runs: dataset_answers.py gives the dataset's answers back in the same columns.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from contextlib import contextmanager
from typing import Iterator

import ray

from eagle_data.config import Config
from eagle_data.errors import EngineStartFailed
from eagle_data.job.stages.engines.kwargs import refuse_owned

# The classes whose Ray Data actors are engine replicas (vllm_backend's is a subclass of Ray's UDF).
ENGINE_CLASSES = ("TransformersEngine", "TransformersHiddenStates", "VLLMEngine")

log = logging.getLogger("eagle_data")

def check_engine_kwargs(cfg: Config) -> None:
    """At start, before any work: refuse_owned against the configured backend's builder."""
    if cfg.engine.backend == "vllm":
        from eagle_data.job.stages.engines.vllm_backend import check_cpu_binding, typed_engine_kwargs

        refuse_owned(typed_engine_kwargs(cfg), cfg.engine.engine_kwargs)
        check_cpu_binding(cfg)
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
    if "VLLM_CPU_OMP_THREADS_BIND" in cause:  # a replica's own refusal (vllm_udf.check_threads_bind)
        return "VLLM_CPU_OMP_THREADS_BIND, set in the environment"
    named = [f"engine.engine_kwargs.{k}" for k in cfg.engine.engine_kwargs if str(k) in cause]
    if named:
        return ", ".join(named)
    if cfg.engine.backend == "vllm":
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        # vLLM's binding fails as `Failed core proc(s): {}`, naming nothing (`auto` on one NUMA node)
        bound = (f", VLLM_CPU_OMP_THREADS_BIND={bind!r} (set in the environment: one group of cores per rank, "
                 "`|`-separated, e.g. `0|1` for 2 ranks; or unset)") if bind is not None and cfg.engine.device == "cpu" \
            else ""
        return (f"model.path, engine.max_model_len, engine.tensor_parallel_size, engine.engine_kwargs{bound}; "
                "the engine replica's log has vLLM's own messages")
    return "model.path, model.trust_remote_code, engine.engine_kwargs (transformers' from_pretrained)"


def apply_engine(ds: ray.data.Dataset, cfg: Config, pad_id: int) -> ray.data.Dataset:
    if cfg.prompt.answers == "dataset":
        from eagle_data.job.stages.engines.dataset_answers import dataset_answers_stage

        log.info("engine: none; the answers are the dataset's own (prompt.answers=dataset)")
        return dataset_answers_stage(ds)
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
    """The hidden-states pass: each row's features handed on as columns of the row
    (state_files.py's STATE_COLUMNS; vLLM's file under `scratch_dir` is read back and removed
    on the engine's node)."""
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
