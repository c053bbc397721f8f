"""The draft trainer's driver (`python -m ray_jobs.train_draft`, docs/streaming.md): an
EAGLE-3 draft trained from the feature stream with speculators' own draft model, vocab
mapping and loss.

    OUT's data/ (the generate phase's rows; no hidden_states/ needed)
      -> the draft vocabulary: OUT's training-token counts (tools/token_counts.py, the
         hidden-states filters), speculators' build_vocab_mappings_from_distribution
      -> training.stream.features: the target's states at the EAGLE-3 layers from the
         engine replicas, trainer.epochs epochs, train.workers equal shares
      -> a Ray Train TorchTrainer of train.workers workers (draft_loop.py)
      -> trainer.save_path: final/ (speculators' save_pretrained: config.json,
         model.safetensors; what vLLM loads as `speculative_config.model`), step-<N>/ every
         train.checkpoint_every steps, speculators' run.yaml, and metrics.jsonl (rank 0's
         steps: loss and speculators' per-step metrics)

Checkpoints are by step, not by epoch: a worker's rows are not in epoch order (Ray's equal
split may hand an epoch's last rows out at the very end of the stream).
"""

from __future__ import annotations

import json
import logging
import os
import uuid

from eagle_data.config import Config
from eagle_data.errors import EagleDataError
from eagle_data.job.phases.hidden_states import target_shape
from eagle_data.job.ray_session import start_ray
from eagle_data.tools.token_counts import count_tokens
from eagle_data.training.draft_loop import train_loop
from eagle_data.training.stream import features, stream_report

log = logging.getLogger("eagle_data")


def train(cfg: Config, spec) -> str:
    """Train the draft `spec` (draft_config.speculators_config) describes; returns the summary."""
    save_path = spec.trainer.save_path
    d2t, t2d, vocab_size = draft_vocabulary(cfg, spec)
    os.makedirs(save_path, exist_ok=True)
    spec.save(save_path)  # speculators' run.yaml and train_command.txt, as its own trainer writes them
    start_ray(cfg.output.ray_data_progress)
    report = f"eagle-data-train-{uuid.uuid4().hex[:8]}"
    log.info("train: %d workers (%s), draft vocab %d of %d, %d epochs, %d rows a step, checkpoints in %s",
             cfg.train.workers, cfg.train.device, spec.draft.draft_vocab_size, vocab_size, spec.trainer.epochs,
             cfg.train.batch_size, save_path)
    fit(cfg, spec, d2t, t2d, report)
    return summary(save_path, stream_report(report))


def draft_vocabulary(cfg: Config, spec) -> tuple:
    """d2t and t2d of the draft's vocabulary (spec.draft.draft_vocab_size, set to what is
    used: at most the target's) from OUT's training-token counts, with speculators' mapping."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution, get_target_vocab_size

    vocab_size = get_target_vocab_size(None, cfg.model.path, cfg.model.trust_remote_code)
    draft_vocab = min(spec.draft.draft_vocab_size or 32_000, vocab_size)
    counts = count_tokens(cfg.output.path, vocab_size, cfg.hidden_states.finish_reason, cfg.hidden_states.source).counts
    d2t, t2d = build_vocab_mappings_from_distribution(
        {int(i): int(counts[i]) for i in counts.nonzero()[0]}, draft_vocab, vocab_size)
    spec.draft.draft_vocab_size = draft_vocab
    return d2t, t2d, vocab_size


def fit(cfg: Config, spec, d2t, t2d, report: str) -> None:
    """The stream into a TorchTrainer of train.workers workers running draft_loop.train_loop."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    save_path, workers = spec.trainer.save_path, cfg.train.workers
    ds = features(cfg.output.path, cfg, epochs=spec.trainer.epochs, world_size=workers, seed=spec.seed,
                  max_len=spec.data.total_seq_len, report=report)
    gpu = cfg.train.device == "gpu"
    # Ray refuses a worker bundle of 0 CPUs; one byte of memory is a bundle that reserves nothing.
    resources = {"CPU": cfg.train.cpus_per_worker} if cfg.train.cpus_per_worker else {"memory": 1}
    resources.update({"GPU": 1} if gpu else {})
    loop_config = {"args": dict(spec.flatten()), "d2t": d2t, "t2d": t2d, "batch_size": cfg.train.batch_size,
                   "hidden_size": target_shape(cfg)[1], "stream_dtype": cfg.hidden_states.dtype,
                   "save_path": save_path, "checkpoint_every": cfg.train.checkpoint_every}
    result = TorchTrainer(train_loop, train_loop_config=loop_config, datasets={"train": ds},
                          scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu,
                                                       resources_per_worker=resources),
                          run_config=RunConfig(storage_path=os.path.join(save_path, "ray-train"),
                                               name="train")).fit()
    if result.error:
        raise result.error


def summary(save_path: str, stream: dict) -> str:
    with open(os.path.join(save_path, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    if not steps:
        raise EagleDataError(f"train: no step ran (no stream row reached the trainer); see {save_path}")
    failed = sum(sum(e["failed"].values()) for e in stream["epochs"].values())
    saved = sorted((d for d in os.listdir(save_path) if d.startswith("step-")), key=lambda d: int(d[5:]))
    return "\n".join([f"save_path = {save_path}",
                      f"  steps:       {len(steps)}, loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}",
                      f"  stream:      {stream['per_epoch']} samples an epoch, {failed} failed checks",
                      f"  draft:       {save_path}/final (speculators' format: vLLM's speculative_config.model)"
                      + (f"\n  checkpoints: {', '.join(saved)}" if saved else "")])
