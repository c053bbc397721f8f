"""The production backend: Ray's vLLM engine stage (`ray.data.llm`), kept thin.

We tokenize with the chat template ourselves (prompts phase) and decode ourselves
(postprocess), so Ray's chat-template, tokenize and detokenize stages are off and the
engine gets `tokenized_prompt` + per-row `sampling_params`.

Feeding rule: Ray's stage hands back a batch only when its slowest row is done, so one
8K-token straggler holds its whole batch, and its finished rows keep their place in flight.
Many batches must be in flight per replica so that the engine always has enough unfinished
rows to fill every sequence slot: batch_size x max_concurrent_batches >= (2 + batch_size/8)
x max_num_seqs (i.e. 2.5 N for batches of 4, 4 N for 16, 6 N for 32); the curve behind the
factor is in docs/performance.md, "Feeding the engine".
"""

from __future__ import annotations

import logging
import os
from typing import Any

from eagle_data.config import Config
from eagle_data.errors import NoReplicaResources, stop_signals_kept
from eagle_data.job.ray_internals import undeclared_hint, wait_for_nodes
from eagle_data.job.stages.engines.kwargs import with_passed
from eagle_data.job.stages.engines.vllm_udf import check_threads_bind, vllm_stage_udf
from eagle_data.model_files import resolve_model_path

log = logging.getLogger(__name__)


def feed_factor(batch_size: int) -> float:
    """Rows in flight per engine slot needed to keep the slots busy (see module docstring)."""
    return 2 + batch_size / 8


def typed_engine_kwargs(cfg: Config) -> dict[str, tuple[str, Any]]:
    """vLLM's engine kwargs that typed keys set: {kwarg: (the key that owns it, its value)}.
    A value of None is not passed (vLLM's default) but still owned: the prompts phase
    tokenizes with model.tokenizer_path whether or not model.tokenizer is set."""
    typed = {
        "model": ("model.path", None),  # Ray's model_source
        "tensor_parallel_size": ("engine.tensor_parallel_size", cfg.engine.tensor_parallel_size),
        "max_model_len": ("engine.max_model_len", cfg.engine.max_model_len),
        "trust_remote_code": ("model.trust_remote_code", cfg.model.trust_remote_code),
        "tokenizer": ("model.tokenizer", resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else None),
    }
    if cfg.engine.device == "cpu":
        # vLLM's CPU build takes the KV cache size in bytes (its VLLM_CPU_KVCACHE_SPACE env
        # variable is the legacy spelling of the same setting).
        typed["kv_cache_memory_bytes"] = ("engine.cpu_kv_cache_gib", int(cfg.engine.cpu_kv_cache_gib * 2**30))
    return typed


def engine_kwargs(cfg: Config) -> dict:
    kwargs = with_passed(typed_engine_kwargs(cfg), cfg.engine.engine_kwargs)  # anything else passes through
    if cfg.engine.device == "cpu" and cfg.engine.tensor_parallel_size > 1:
        # The ranks as vLLM's own processes inside the replica's actor, on its one CPU bundle
        # (Ray's default for TP > 1, its "ray" executor, wants a GPU bundle per rank).
        kwargs.setdefault("distributed_executor_backend", "mp")
    return kwargs


def replica_needs(cfg: Config) -> dict[str, float]:
    """What one replica asks Ray for on one node: Ray's default is a {"GPU": 1, "CPU": 1}
    bundle per TP rank; on CPU one bundle of engine.num_cpus CPUs (TP 1, see config.py);
    plus engine.replica_resources."""
    if cfg.engine.device == "cpu":
        need = {"CPU": float(cfg.engine.num_cpus)}
    else:
        need = {"GPU": float(cfg.engine.tensor_parallel_size), "CPU": float(cfg.engine.tensor_parallel_size)}
    return {**need, **cfg.engine.replica_resources}


def placement_group_config(cfg: Config) -> dict | None:
    """A replica's bundles. CPU: one bundle of engine.num_cpus CPUs (without it Ray's stage
    asks for a GPU and waits forever). GPU: Ray's default (one GPU + one CPU per TP/PP
    worker, PACK), or None (the default itself) without engine.replica_resources, which go
    into the first bundle."""
    if cfg.engine.device == "cpu":
        bundles = [{"CPU": cfg.engine.num_cpus}]
    elif cfg.engine.replica_resources:
        workers = cfg.engine.tensor_parallel_size * cfg.engine.engine_kwargs.get("pipeline_parallel_size", 1)
        bundles = [{"CPU": 1, "GPU": 1} for _ in range(workers)]
    else:
        return None
    bundles[0].update(cfg.engine.replica_resources)
    return {"bundles": bundles, "strategy": "PACK"}


def wait_for_replica_resources(cfg: Config, poll_s: float = 2.0) -> None:
    """Fail with a message, instead of Ray Data waiting forever on "No available node types
    can fulfill ...", when the cluster cannot hold one replica. An autoscaling cluster gets
    engine.resource_wait_s to add the nodes."""
    need = replica_needs(cfg)
    # Per node: a TP group's bundles are packed on one node by Ray's stage.
    fits, nodes = wait_for_nodes(lambda nodes: any(all(res.get(k, 0) >= v for k, v in need.items()) for res in nodes),
                                 cfg.engine.resource_wait_s, poll_s)
    if fits:
        return
    has_gpu = any(res.get("GPU", 0) > 0 for res in nodes)
    if "GPU" in need and not has_gpu:
        hint = "there is no GPU in the cluster; set engine.device=cpu to run vLLM on CPUs (vLLM's CPU build, `make setup`)"
    else:
        hint = (undeclared_hint(cfg.engine.replica_resources, nodes, "engine.replica_resources", "engine", 1)
                or "no node has that much; lower engine.tensor_parallel_size / engine.num_cpus or add nodes")
    raise NoReplicaResources(
        f"engine.backend=vllm with engine.device={cfg.engine.device}: one replica needs {need} on one node, "
        f"and after waiting {cfg.engine.resource_wait_s:g}s (engine.resource_wait_s) {hint}")


def check_cpu_binding(cfg: Config) -> None:
    """On CPU, a set VLLM_CPU_OMP_THREADS_BIND vLLM cannot use is refused before any work
    (vllm_udf.check_threads_bind; each replica checks the cores on its node too)."""
    if cfg.engine.device == "cpu":
        check_threads_bind(cfg.engine.tensor_parallel_size * cfg.engine.engine_kwargs.get("pipeline_parallel_size", 1))


def processor_config(cfg: Config, extra_engine_kwargs: dict | None = None):
    """Ray's processor config for cfg's engine; `extra_engine_kwargs` (a phase's own engine
    settings, e.g. the hidden-states pass) go over `engine_kwargs(cfg)`."""
    from ray.data.llm import vLLMEngineProcessorConfig

    check_cpu_binding(cfg)  # every vLLM pass builds its stage here: the acceptance job's, the stream's

    kwargs = {**engine_kwargs(cfg), **(extra_engine_kwargs or {})}
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


def vllm_stage(ds, cfg: Config, extra_engine_kwargs: dict | None = None):
    """The generate phase's engine stage: Ray's processor (its preprocess map, vLLM stage
    and postprocess map, as `Processor.__call__` applies them), except that the vLLM stage
    takes each block as one batch (batch_size=None): job/stages/feed.py sends blocks of one
    engine batch, and a stage holding a depth's last, smaller block back for more rows would
    wait forever. `extra_engine_kwargs` go over the job's (the acceptance job's draft)."""
    processor = build_vllm_processor(cfg, extra_engine_kwargs)
    ds = ds.map(processor.preprocess, **processor.preprocess_map_kwargs)
    for stage in processor.stages.values():
        kwargs = stage.get_dataset_map_batches_kwargs(batch_size=cfg.engine.batch_size,
                                                      data_column=processor.DATA_COLUMN)
        ds = ds.map_batches_internal(stage.fn, **{**kwargs, "batch_size": None})
    return ds.map(processor.postprocess, **processor.postprocess_map_kwargs)


def build_vllm_processor(cfg: Config, extra_engine_kwargs: dict | None = None):
    from ray.data.llm import build_processor

    with stop_signals_kept():  # its ray.init replaces the job's SIGTERM handler (errors.stop_signals_kept)
        processor = build_processor(processor_config(cfg, extra_engine_kwargs))
    # model_copy: an assignment would run the stage's validator again, which pops its own settings.
    stage = processor.get_stage_by_name("vLLMEngineStage")
    processor.stages["vLLMEngineStage"] = stage.model_copy(update={"fn": vllm_stage_udf(cfg.engine.cpu_threads)})
    return processor


def engine_summary(cfg: Config) -> str:
    """The engine line of the job log: vLLM's version, the device and the replicas."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm = version("vllm")
    except PackageNotFoundError:
        try:
            vllm = version("vllm-cpu") + " (vllm-cpu)"
        except PackageNotFoundError:
            vllm = "not installed"
    threads = ""
    if cfg.engine.device == "cpu":  # what vllm_udf.bind_cpu_threads does in each replica
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        threads = f", VLLM_CPU_OMP_THREADS_BIND={bind} (set)" if bind else \
            f", its threads on {cfg.engine.cpu_threads or 'all'} of a replica's cores (engine.cpu_threads)"
    return (f"vLLM {vllm} through ray.data.llm's vLLM stage on {cfg.engine.device}, "
            f"{cfg.engine.replicas} replica(s) of {replica_needs(cfg)}, tensor parallel {cfg.engine.tensor_parallel_size}"
            f"{threads}")
