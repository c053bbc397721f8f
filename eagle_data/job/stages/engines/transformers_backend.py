"""The small-model backend: a Ray actor pool running transformers `generate` on CPU (or GPU).

Same contract as Ray's vLLM stage (see engines/__init__.py), so everything after the
engine is shared and exercised by tests and the demo. Log-probabilities (`logprobs` = k in
the sampling params) are vLLM's `raw_logprobs`, computed as vLLM's sampler does:
log_softmax in float32 of `generate`'s raw logits (`output_logits`, before the temperature
and top-p warpers), torch.topk for the top k, and the sampled token's own entry.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pyarrow as pa
import ray

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines.kwargs import with_passed
from eagle_data.job.stages.engines.logprobs import logprob_values
from eagle_data.job.stages.engines.outputs import CONSUMED, ENGINE_ERROR_COLUMN, engine_output
from eagle_data.model_files import pretrained_args
from eagle_data.storage.contract import LOGPROB_COLUMNS

log = logging.getLogger(__name__)


def typed_from_pretrained(model_path: str, trust_remote_code: bool) -> dict[str, tuple[str, Any]]:
    """`from_pretrained`'s kwargs that typed keys set: {kwarg: (the key that owns it, its
    value)}; None is not passed, but still owned (the tokenizer is loaded without it)."""
    name, extra = pretrained_args(model_path)
    return {"pretrained_model_name_or_path": ("model.path", name), "gguf_file": ("model.path", None),
            **{k: ("model.path", v) for k, v in extra.items()},
            "trust_remote_code": ("model.trust_remote_code", trust_remote_code)}


def load_model(model_path: str, trust_remote_code: bool, from_pretrained: dict, cpu_threads: int | None):
    """(torch, device, the model in eval mode) for a replica: torch on `cpu_threads` (null = all
    cores of the node; Ray would otherwise limit it to the actor's CPUs), on CUDA when there
    is one; logs where the replica runs (actor stdout reaches the job log)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cpu_threads or os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = with_passed(typed_from_pretrained(model_path, trust_remote_code), from_pretrained)
    model = AutoModelForCausalLM.from_pretrained(**kwargs).to(device).eval()
    print(f"engine replica on node {ray.get_runtime_context().get_node_id()}", flush=True)
    return torch, device, model


class TransformersEngine(Stage):
    """Loads the model once per actor; generates a batch of rows per call."""

    reads = columns("sample_id", *CONSUMED)
    makes = columns("prompt_token_ids", "generated_tokens", ENGINE_ERROR_COLUMN)

    def __init__(self, model_path: str, trust_remote_code: bool, engine_kwargs: dict, pad_id: int,
                 cpu_threads: int | None = None):
        self.torch, self.device, self.model = load_model(model_path, trust_remote_code, engine_kwargs, cpu_threads)
        self.pad_id = pad_id

    def apply(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        results: list[dict] = [None] * len(rows)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            params = row["sampling_params"]
            key = (params["max_tokens"], params["temperature"], params["top_p"], params["top_k"],
                   params["min_p"], tuple(params["stop_token_ids"]))
            groups.setdefault(key, []).append(i)
        for indices in groups.values():
            try:
                outputs = self._generate([rows[i] for i in indices])
            except Exception:  # find the row(s) that fail; the others still get answers
                outputs = [self._generate_one(rows[i]) for i in indices]
            for i, out in zip(indices, outputs):
                results[i] = out
        carried = [{k: v for k, v in row.items() if k not in CONSUMED} for row in rows]
        # Every row has the log-probability columns (null on an error row): from_pylist takes
        # its columns from the first row.
        logprobs = dict.fromkeys(LOGPROB_COLUMNS) if rows and rows[0]["sampling_params"].get("logprobs") else {}
        return pa.Table.from_pylist([{**c, **logprobs, **r} for c, r in zip(carried, results)])

    def _generate_one(self, row: dict) -> dict:
        try:
            return self._generate([row])[0]
        except Exception as e:
            log.warning("generation failed for sample %s: %s", row.get("sample_id"), e)
            return engine_output(error=f"{type(e).__name__}: {e}")

    def _generate(self, rows: list[dict]) -> list[dict]:
        from transformers import GenerationConfig

        torch = self.torch
        params = rows[0]["sampling_params"]
        prompts = [list(r["tokenized_prompt"]) for r in rows]
        width = max(len(p) for p in prompts)
        # Left padding, so every row's generation starts at column `width`.
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stop_ids = list(params["stop_token_ids"])
        sample = params["temperature"] > 0
        # A fresh GenerationConfig: the model's own defaults (top_k=50, repetition
        # penalties, ...) must not apply, as vLLM would not apply them either.
        gen_config = GenerationConfig(
            max_new_tokens=params["max_tokens"], do_sample=sample,
            temperature=params["temperature"] if sample else None,
            top_p=params["top_p"] if sample else None, top_k=params["top_k"] if sample else None,
            min_p=(params["min_p"] or None) if sample else None,
            eos_token_id=stop_ids, pad_token_id=self.pad_id,
        )
        k = params.get("logprobs") or 0  # one run-wide setting: the same for every row
        if sample:
            # Seeded per batch: a row's sample depends on the rows batched with it.
            torch.manual_seed(params["seed"])
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                generation_config=gen_config, return_dict_in_generate=True, output_logits=bool(k),
            )
            generated = out.sequences[:, width:]
            if k:
                top_ids, top_logprobs, sampled = top_logprobs_of(torch, out.logits, generated, k)
        results = []
        stops = set(stop_ids)
        for i, (prompt, row_out) in enumerate(zip(prompts, generated.tolist())):
            # Rows that finished early are padded after their stop token: cut there.
            end = next((j + 1 for j, t in enumerate(row_out) if t in stops), len(row_out))
            results.append(engine_output(prompt, row_out[:end]))
            if k:
                results[-1].update(logprob_values(top_ids[i, :end], top_logprobs[i, :end], sampled[i, :end]))
        return results


def top_logprobs_of(torch, logits: tuple, generated, k: int) -> tuple:
    """(top ids [rows, steps, k], their log-probabilities, the generated token's own [rows,
    steps]) as numpy arrays, from generate's raw logits (one [rows, vocab] tensor per step),
    one step at a time as vLLM's sampler computes them: compute_logprobs (log_softmax in
    float32), then gather_logprobs (torch.topk, and the sampled token's entry)."""
    ids, values, own = [], [], []
    for step, step_logits in enumerate(logits):
        logprobs = step_logits.log_softmax(dim=-1, dtype=torch.float32)
        top = torch.topk(logprobs, k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
        own.append(logprobs.gather(-1, generated[:, step:step + 1]).squeeze(-1))
    return tuple(torch.stack(t, dim=1).cpu().numpy() for t in (ids, values, own))


def actor_pool(ds: ray.data.Dataset, cfg: Config, engine: type, batch_size: int | None,
               **constructor_kwargs) -> ray.data.Dataset:
    """`engine` as a pool of engine.replicas actors (one GPU each when the cluster has one)."""
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return ds.map_batches(
        engine,
        fn_constructor_kwargs=dict(model_path=cfg.model.path, trust_remote_code=cfg.model.trust_remote_code,
                                   cpu_threads=cfg.engine.cpu_threads, **constructor_kwargs),
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cfg.engine.replicas),
        num_cpus=cfg.engine.num_cpus,
        num_gpus=gpus,
        resources=cfg.engine.replica_resources or None,
    )


def transformers_stage(ds: ray.data.Dataset, cfg: Config, pad_id: int) -> ray.data.Dataset:
    # Each block is one engine batch (job/stages/feed.py): taken whole, never held back for more rows.
    return actor_pool(ds, cfg, TransformersEngine, batch_size=None, engine_kwargs=cfg.engine.engine_kwargs,
                      pad_id=pad_id)
