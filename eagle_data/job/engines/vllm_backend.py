"""The production backend: Ray's vLLM engine stage (`ray.data.llm`), kept thin.

We tokenize with the chat template ourselves (prompts phase) and decode ourselves
(postprocess), so Ray's chat-template, tokenize and detokenize stages are off and the
engine gets `tokenized_prompt` + per-row `sampling_params`.

Feeding rule: Ray's stage hands back a batch only when its slowest row is done, so one
8K-token straggler holds its whole batch, and its finished rows keep their place in flight.
Many batches must be in flight per replica so that the engine always has enough unfinished
rows to fill every sequence slot: batch_size x max_concurrent_batches >= (2 + batch_size/8)
x max_num_seqs (i.e. 2.5 N for batches of 4, 4 N for 16, 6 N for 32). The factor comes
from the simulated-engine curve in docs/performance.md (long-tailed completions, mean
~1,300 tokens, max 8,192): 1.5 N, the first guess, measured 41% slot utilisation.
"""

from __future__ import annotations

import logging

from eagle_data.config import Config
from eagle_data.model_files import resolve_model_path

log = logging.getLogger(__name__)



def feed_factor(batch_size: int) -> float:
    """Rows in flight per engine slot needed to keep the slots busy (see module docstring)."""
    return 2 + batch_size / 8


def engine_kwargs(cfg: Config) -> dict:
    kwargs = {
        "tensor_parallel_size": cfg.engine.tensor_parallel_size,
        "max_model_len": cfg.engine.max_model_len,
        "trust_remote_code": cfg.model.trust_remote_code,
    }
    if cfg.model.tokenizer:
        kwargs["tokenizer"] = resolve_model_path(cfg.model.tokenizer)
    kwargs.update(cfg.engine.engine_kwargs)  # anything else passes through
    return kwargs


def processor_config(cfg: Config):
    from ray.data.llm import vLLMEngineProcessorConfig

    kwargs = engine_kwargs(cfg)
    in_flight = cfg.engine.batch_size * cfg.engine.max_concurrent_batches
    max_num_seqs = kwargs.get("max_num_seqs")
    factor = feed_factor(cfg.engine.batch_size)
    if max_num_seqs and in_flight < factor * max_num_seqs:
        log.warning(
            "engine.batch_size x engine.max_concurrent_batches = %d rows in flight per replica, "
            "below %.1f x max_num_seqs (%d): the engine will idle while batches drain",
            in_flight, factor, max_num_seqs,
        )
    return vLLMEngineProcessorConfig(
        model_source=resolve_model_path(cfg.model.path),
        engine_kwargs=kwargs,
        batch_size=cfg.engine.batch_size,
        max_concurrent_batches=cfg.engine.max_concurrent_batches,
        # A fixed pool: every replica starts at once instead of autoscaling up from one.
        concurrency=(cfg.engine.replicas, cfg.engine.replicas),
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
        should_continue_on_error=True,
        placement_group_config=placement_group_config(cfg),
    )


def placement_group_config(cfg: Config) -> dict | None:
    """A replica's bundles (one GPU + one CPU per TP/PP worker, and PACK, as Ray's default)
    with engine.replica_resources added to the first one; None (Ray's default placement)
    without replica_resources."""
    if not cfg.engine.replica_resources:
        return None
    workers = cfg.engine.tensor_parallel_size * cfg.engine.engine_kwargs.get("pipeline_parallel_size", 1)
    bundles = [{"CPU": 1, "GPU": 1} for _ in range(workers)]
    bundles[0].update(cfg.engine.replica_resources)
    return {"bundles": bundles, "strategy": "PACK"}


def build_vllm_processor(cfg: Config):
    from ray.data.llm import build_processor

    return build_processor(processor_config(cfg))
