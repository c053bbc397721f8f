"""The engine stage: one contract, two backends.

In: `sample_id`, `tokenized_prompt` (list[int]), `sampling_params` (dict) and carried columns.
Out: the columns of Ray's vLLM stage (`vLLMOutputData`: `prompt`, `prompt_token_ids`,
`num_input_tokens`, `generated_tokens`, `generated_text`, `num_generated_tokens`, ...) plus
`__inference_error__` ("" on success) and the carried columns. A row the engine fails on
is an error row, not a crashed job.
"""

from __future__ import annotations

import logging

import ray

from eagle_data.config import Config

# The classes whose Ray Data actors are engine replicas (vllm_backend's is a subclass of Ray's UDF).
ENGINE_CLASSES = ("TransformersEngine", "TransformersHiddenStates", "VLLMEngine")

log = logging.getLogger("eagle_data")


def apply_engine(ds: ray.data.Dataset, cfg: Config, pad_id: int) -> ray.data.Dataset:
    if cfg.engine.backend == "vllm":
        from eagle_data.job.stages.engines.vllm_backend import build_vllm_processor, describe, wait_for_replica_resources

        wait_for_replica_resources(cfg)  # before the pipeline starts: never hang on a missing GPU
        log.info("engine: %s", describe(cfg))
        return build_vllm_processor(cfg)(ds)
    from eagle_data.job.stages.engines.transformers_backend import transformers_stage

    log.info("engine: transformers generate in a Ray actor pool, %d replica(s), model %s",
             cfg.engine.replicas, cfg.model.path)
    return transformers_stage(ds, cfg, pad_id)


def apply_hidden_states_engine(ds: ray.data.Dataset, cfg: Config, layer_ids: list[int], dtype: str,
                               scratch_dir: str) -> ray.data.Dataset:
    """The hidden-states pass: each row's features written to its `hidden_states_path`."""
    if cfg.engine.backend == "vllm":
        from eagle_data.job.stages.engines.vllm_backend import describe, wait_for_replica_resources
        from eagle_data.job.stages.engines.vllm_hidden_states import vllm_hidden_states_stage

        wait_for_replica_resources(cfg)  # before the pipeline starts: never hang on a missing GPU
        log.info("engine: %s, extract_hidden_states at layer ids %s", describe(cfg), layer_ids)
        return vllm_hidden_states_stage(ds, cfg, layer_ids, dtype, scratch_dir)
    from eagle_data.job.stages.engines.transformers_hidden_states import transformers_hidden_states_stage

    log.info("engine: transformers forward in a Ray actor pool, %d replica(s), layer ids %s",
             cfg.engine.replicas, layer_ids)
    return transformers_hidden_states_stage(ds, cfg, layer_ids, dtype)
