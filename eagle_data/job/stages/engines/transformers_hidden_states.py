"""The hidden-states pass on transformers: a Ray actor pool running the model's forward over
each row's exact `input_ids`; each row comes out with the states at the chosen layers, with
vLLM's layer semantics, in the hand-over columns vLLM's pass gives too (state_files.py), so
the packing stage after either engine is the same. No file is written.

Layer id k < L is HF's `hidden_states[k]` (the residual stream after k decoder layers).
Id L is the last decoder layer's output before the final norm, taken with a forward hook:
HF's `hidden_states[L]` is after the norm (Qwen3, Llama under transformers 5).

The model is loaded as the generate pass loads it: `engine.engine_kwargs` go to
`from_pretrained` (a `revision`, `subfolder`, `variant`, `attn_implementation`, ...: the
same weights the answers came from), except the dtype, which is the pass's own
(`hidden_states.dtype`), as vLLM's pass sets it over the engine's.
"""

from __future__ import annotations

import pyarrow as pa
import ray

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.job.stages.engines.state_files import STATE_COLUMNS, as_columns
from eagle_data.job.stages.engines.transformers_backend import actor_pool, load_model


def decoder_layers(model):
    """The model's decoder layers (model.model.layers for Llama/Qwen-style models)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None) or getattr(getattr(inner, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers (model.model.layers)")
    return layers


DTYPE_KWARGS = ("dtype", "torch_dtype")  # transformers' two spellings of the dtype


def from_pretrained_kwargs(engine_kwargs: dict, dtype: str) -> dict:
    """`from_pretrained`'s pass-through kwargs for the pass: `engine.engine_kwargs` (what the
    generate pass passes), with `dtype` (a torch dtype's name) instead of theirs."""
    import torch

    return {**{k: v for k, v in engine_kwargs.items() if k not in DTYPE_KWARGS}, "dtype": getattr(torch, dtype)}


class TransformersHiddenStates(Stage):
    """Loads the model once per actor; one forward per row (no padding: exact positions)."""

    reads = columns("sample_id", "input_ids")
    makes = columns("sample_id", ENGINE_ERROR_COLUMN, *STATE_COLUMNS)

    def __init__(self, model_path: str, trust_remote_code: bool, layer_ids: list[int], dtype: str,
                 cpu_threads: int | None = None, engine_kwargs: dict | None = None):
        self.torch, self.device, self.model = load_model(model_path, trust_remote_code,
                                                         from_pretrained_kwargs(engine_kwargs or {}, dtype), cpu_threads)
        self.layer_ids = sorted(layer_ids)
        layers = decoder_layers(self.model)
        self.num_layers = len(layers)
        self._final = None
        layers[-1].register_forward_hook(self._keep_final)

    def _keep_final(self, module, args, output) -> None:
        self._final = output[0] if isinstance(output, tuple) else output

    def states(self, input_ids: list[int]):
        """[len(input_ids), len(layer_ids), H] on CPU, in the model's dtype."""
        torch = self.torch
        with torch.no_grad():
            # logits_to_keep=1: the output layer on the last position only (its logits are unused;
            # over every position it cost more than the decoder layers of a small model).
            out = self.model(input_ids=torch.tensor([input_ids], device=self.device), output_hidden_states=True,
                             use_cache=False, logits_to_keep=1)
        picked = [self._final[0] if k == self.num_layers else out.hidden_states[k][0] for k in self.layer_ids]
        return torch.stack(picked, dim=1).cpu()

    def apply(self, batch: pa.Table) -> pa.Table:
        errors, states = [], []
        for ids in batch.column("input_ids").to_pylist():
            try:
                states.append(as_columns(self.states(ids), ids))
                errors.append("")
            except Exception as e:  # the row fails, the batch goes on
                states.append(dict.fromkeys(STATE_COLUMNS))
                errors.append(f"{type(e).__name__}: {e}")
        batch = batch.append_column(ENGINE_ERROR_COLUMN, pa.array(errors, pa.string()))
        for name, kind in STATE_COLUMNS.items():
            batch = batch.append_column(name, pa.array([s[name] for s in states], kind))
        return batch


def transformers_hidden_states_stage(ds: ray.data.Dataset, cfg: Config, layer_ids: list[int],
                                     dtype: str) -> ray.data.Dataset:
    return actor_pool(ds, cfg, TransformersHiddenStates, cfg.engine.batch_size, layer_ids=layer_ids, dtype=dtype,
                      engine_kwargs=cfg.engine.engine_kwargs)
