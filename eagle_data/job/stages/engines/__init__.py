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

import numpy as np
import ray

from eagle_data.config import Config
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
