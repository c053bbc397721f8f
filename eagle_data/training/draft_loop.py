"""One Ray Train worker of the draft trainer (draft_trainer.py): speculators' draft model,
trained on this worker's shard of the feature stream.

Per step: train.batch_size rows of the shard packed into one sequence (batches.pack:
speculators' shift_batch and CollateFn), the model's own forward and loss, speculators'
optimizer and its gradient clipping. Rank 0 writes metrics.jsonl (one line a step) and the
checkpoints (speculators' save_pretrained, written aside and renamed into place).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import uuid

from eagle_data.errors import DraftStartFailed
from eagle_data.training.batches import pack

log = logging.getLogger("eagle_data")

# Batches fetched ahead of the step (Ray's default is one): benchmarks/stream_balance.py
# measured a trainer slower than the engine waiting 3.5% of its time with 4.
PREFETCH_BATCHES = 4


def train_loop(config: dict) -> None:
    """Ray Train's loop: `config` is draft_trainer.loop_config's."""
    import ray.train
    import torch
    from ray.train.torch import get_device, prepare_model
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import build_draft_model
    from speculators.train.optimizers import build_optimizers

    args = argparse.Namespace(**config["args"])
    torch.manual_seed(args.seed)
    if not args.draft_mrope_full_head_hack:
        install_partial_neox_rotary()  # as speculators' own trainer does
    try:
        draft = build_draft_model(args, Eagle3DraftModel, config["t2d"], config["d2t"], args.draft_vocab_size)
    except Exception as e:  # speculators loads the verifier's config and weights here: say which failed how
        raise DraftStartFailed(f"the draft could not be built on its verifier, model.path "
                               f"{args.verifier_name_or_path} ({type(e).__name__}: {e})") from None
    model = prepare_model(draft)
    optimizers = build_optimizers(model, args)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    dtype, device = getattr(torch, args.hidden_states_dtype), get_device()
    rank = ray.train.get_context().get_world_rank()
    save_path, every, step = config["save_path"], config["checkpoint_every"], 0
    shard = ray.train.get_dataset_shard("train")
    with open(os.path.join(save_path, "metrics.jsonl"), "a") if rank == 0 else contextlib.nullcontext() as metrics:
        for batch in shard.iter_batches(batch_size=config["batch_size"], batch_format="numpy",
                                        prefetch_batches=PREFETCH_BATCHES):
            packed = pack(batch, config["hidden_size"], config["stream_dtype"], dtype)
            packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
            autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
            with autocast:
                _, loss, step_metrics = model(**packed, **train_kwargs)
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as speculators' trainer
            for opt in optimizers:
                opt.step()
            step += 1
            if rank == 0:
                record = {"step": step, "epochs": sorted({int(e) for e in batch["epoch"]}),
                          "rows": len(batch["epoch"]), "loss": loss.item(),
                          **{k: v.item() for k, v in step_metrics.items()
                             if isinstance(v, torch.Tensor) and v.numel() == 1}}
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                if every and step % every == 0:
                    save(draft, save_path, f"step-{step}")
            if args.max_steps and step >= args.max_steps:
                break
    if rank == 0 and step:
        save(draft, save_path, "final")


def save(draft, save_path: str, name: str) -> None:
    """A speculators checkpoint folder (config.json, model.safetensors), written aside and
    renamed into place: a kill leaves a hidden .tmp folder, never half a checkpoint."""
    final = os.path.join(save_path, name)
    tmp = os.path.join(save_path, f".{name}.{uuid.uuid4().hex}.tmp")
    draft.save_pretrained(tmp)
    os.rename(tmp, final)
    log.info("train: the draft saved to %s", final)
