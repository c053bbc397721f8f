"""The hidden-states phase's engine stage: the target model run prefill-only on each row's
exact tokens through Ray's vLLM stage; each ok row comes out with its EAGLE-3 aux hidden
states as columns (state_files.py).

vLLM's mechanism: the speculative method `extract_hidden_states` keeps the residual
stream of the layers in `layer_ids` in a KV-cache-like buffer, and the KV connector
(`hidden_states_connector.HiddenStatesConnector`, vLLM's example connector made to run
on CPU too) writes it, when the request finishes, to the request's
`sampling_params.extra_args.kv_transfer_params.hidden_states_path`: one safetensors file
per row, `hidden_states` [S, len(layer_ids), H] in `dtype` and `token_ids` [S] (the
row's `input_ids`), on the engine's node (`hidden_states.scratch_dir`). The engine's actor
(vllm_udf.py) reads it back there as soon as the row is answered, waiting for the
connector's asynchronous write (a `<path>.lock` it holds exclusively), and removes it.
Layer id k is the residual stream after k decoder layers (transformers' `hidden_states[k]`
for k < L); id L is the last layer's output before the final norm. Columns come in
ascending layer order whatever order vLLM is given, so `layer_ids` must be ascending.

In: `sample_id`, `input_ids` (list[int]), `hidden_states_path` (absolute, on the engine's
node; folders are made) and carried columns. Out: `sample_id`, `hidden_states_path`,
`input_ids`, `__inference_error__` ("" on success), on an ok row the hand-over columns
(`hidden_states`, `hidden_states_shape`, `hidden_token_ids`), and the carried columns; Ray's
generation and bookkeeping columns are dropped (a carried column must not share their names).

Engine settings over `engine_kwargs(cfg)`: `dtype`, `speculative_config`,
`kv_transfer_config`. Anything else comes from `cfg.engine.engine_kwargs`, prefix caching
included (vLLM's default, on: rows sharing a prefix, e.g. a conversation's turns, reuse
its cached hidden states too; on CPU a shared prefix hits only in whole blocks of
`block_size`, 128 by default there, a multiple of 32 for vLLM's CPU attention).
"""

from __future__ import annotations

import os

import pyarrow as pa
import ray

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN, VLLM_OUTPUT_DEFAULTS, VLLM_STAGE_EXTRA_COLUMNS
from eagle_data.job.stages.engines.state_files import STATE_COLUMNS, with_state_columns

CONNECTOR_MODULE = "eagle_data.job.stages.engines.hidden_states_connector"
CONNECTOR_CLASS = "HiddenStatesConnector"
DTYPES = ("bfloat16", "float16", "float32")


def hidden_states_engine_kwargs(layer_ids: list[int], dtype: str, scratch_dir: str) -> dict:
    """vLLM's settings for the pass (they go over the job's engine kwargs)."""
    if not layer_ids or list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids must be ascending and distinct (vLLM writes them in that order), got {layer_ids}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return {
        "dtype": dtype,
        "speculative_config": {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(k) for k in layer_ids]}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            # shared_storage_path: where a request without a path of its own would go (none here).
            "kv_connector_extra_config": {"shared_storage_path": scratch_dir, "allow_custom_save_path": True},
        },
    }


class ExtractRequests(Stage):
    """Each row's prefill-only request: its exact tokens, one greedy token, and its file."""

    reads = columns("sample_id", "input_ids", "hidden_states_path")
    makes = columns("sample_id", "input_ids", "hidden_states_path", "tokenized_prompt", "sampling_params")

    def apply(self, batch: pa.Table) -> pa.Table:
        paths = batch.column("hidden_states_path").to_pylist()
        relative = [p for p in paths if not os.path.isabs(p)]
        if relative:
            raise ValueError(f"hidden_states_path must be absolute, got {relative[:3]}")
        params = [{"max_tokens": 1, "temperature": 0.0, "detokenize": False,
                   "extra_args": {"kv_transfer_params": {"hidden_states_path": p}}} for p in paths]
        return (batch.append_column("tokenized_prompt", batch.column("input_ids"))
                .append_column("sampling_params", pa.array(params)))


class HiddenStatesRows(Stage):
    """Ray's output rows without its generation and bookkeeping columns (the one sampled
    token is unused)."""

    reads = columns("sample_id", "input_ids", "hidden_states_path", ENGINE_ERROR_COLUMN)
    makes = {**reads, **columns(*STATE_COLUMNS)}
    DROP = (*VLLM_OUTPUT_DEFAULTS, *VLLM_STAGE_EXTRA_COLUMNS, "tokenized_prompt", "sampling_params")

    def apply(self, batch: pa.Table) -> pa.Table:
        return with_state_columns(batch.drop_columns([c for c in self.DROP if c in batch.column_names]))


def vllm_hidden_states_stage(ds: ray.data.Dataset, cfg: Config, layer_ids: list[int], dtype: str,
                             scratch_dir: str) -> ray.data.Dataset:
    """Rows (one engine batch per block, as the phase makes them) -> vLLM -> rows whose
    files are being written."""
    from eagle_data.job.stages.engines.vllm_backend import build_vllm_processor

    extra = hidden_states_engine_kwargs(layer_ids, dtype, scratch_dir)
    ds = ds.map_batches(ExtractRequests(), batch_format="pyarrow")
    ds = build_vllm_processor(cfg, extra)(ds)
    return ds.map_batches(HiddenStatesRows(), batch_format="pyarrow")
