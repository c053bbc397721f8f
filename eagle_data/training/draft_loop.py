"""One Ray Train worker of the draft trainer (draft_trainer.py): speculators' draft model,
trained on this worker's share of the rows, from the stream or from OUT's hidden_states/.

Per step: train.batch_size rows packed into one sequence (batches.pack: speculators'
shift_batch and CollateFn), the model's own forward and loss, speculators' optimizer, its
gradient clipping and its learning-rate schedule (`scheduler.*`: linear with 1% warmup by
default, over the run's steps). Rank 0 writes metrics.jsonl (a line every trainer.log_freq
steps: its own rows' loss and speculators' metrics, normalized as speculators normalizes
them, and the learning rate) and the checkpoints (speculators' save_pretrained, written
aside and renamed into place).

Validation, when rows are held out (data.train_data_ratio < 1): after each epoch's worth of
steps and at the end, every held-out row once across the workers, without gradients; the
metric sums of all workers added up (speculators' full_acc_k: the share of positions where
the draft's k-th step is right, all earlier ones right too), logged in metrics.jsonl and
the job log. The rows of one epoch do not arrive together from the stream, so an epoch's
end is the step count: the run's steps / trainer.epochs.

Checkpoints (train.checkpoint_every; checkpoints.py): rank 0 writes `step-<N>/`, speculators'
draft and `trainer_state.pt` (the optimizers', the schedules' and the step; on the stream,
the places of each epoch's order that every worker had trained on by step N; on
hidden_states/ the step says where each rank is), and every worker reports it to Ray Train
(`ray.train.report`, a pointer to the folder). A worker group Ray Train starts again
(train.max_failures) starts from the latest one: the model, the optimizers, the schedules,
the step, metrics.jsonl cut back to it, and the stream's place (the places trained on are
not asked again: what is left of every epoch, in the epochs' order, whatever the lost
workers had prefetched).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from typing import Iterator

from eagle_data.errors import DraftStartFailed
from eagle_data.reader.batches import pack, stream_items
from eagle_data.training.checkpoints import checkpoint, restore, save

log = logging.getLogger("eagle_data")


def train_loop(config: dict) -> None:
    """Ray Train's loop: `config` is draft_trainer.loop_config's."""
    import ray.train
    import torch

    from ray.train.torch import get_device, prepare_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the worker's lines in the job log
    args = argparse.Namespace(**config["args"])
    torch.manual_seed(args.seed)
    draft = build_draft(args, config)
    model = prepare_model(draft)
    optimizers, schedulers = optimizers_and_schedules(model, args, config["total_steps"])
    from speculators.models.eagle3 import Eagle3DraftModel

    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    dtype, device = getattr(torch, args.hidden_states_dtype), get_device()
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    save_path, every = config["save_path"], config["checkpoint_every"]
    # The step that ends each epoch's worth of steps -> that epoch.
    ends = {max(1, round(config["total_steps"] * (e + 1) / config["epochs"])): e for e in range(config["epochs"])}
    validated = set()

    def validate(step: int, epoch: int) -> None:
        if config["validation"] and epoch not in validated:
            validated.add(epoch)
            # The draft itself, not its DDP wrapper: a wrapped forward syncs buffers with the
            # other workers, and the workers' shares of the held-out rows differ.
            metrics = evaluate(draft, validation_items(config, rank, world), config["hidden_size"], dtype, device,
                               val_kwargs, world)
            if rank == 0:
                record = {"validation": metrics, "epoch": epoch, "step": step}
                write(record)
                log.info("train: validation after epoch %d (step %d): %s", epoch, step,
                         ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    restored = restore(ray.train.get_checkpoint(), draft, optimizers, schedulers, config, rank, world)
    step = restored["step"] if restored else 0
    validated.update(e for end, e in ends.items() if end <= step)  # done before the checkpoint was written
    consumed = restored.get("consumed") if restored else None  # the stream's places trained on, all workers
    # This worker's places since the last checkpoint; kept only where a checkpoint takes them:
    # without checkpoints the list would grow with every row of the run.
    trained: list[tuple[int, int]] = []
    with open(os.path.join(save_path, "metrics.jsonl"), "a") if rank == 0 else contextlib.nullcontext() as file:
        def write(record: dict) -> None:
            file.write(json.dumps(record) + "\n")
            file.flush()

        for items, epochs, places in train_items(config, rank, world, step, consumed):
            loss, metrics = forward(model, items, config["hidden_size"], dtype, device, train_kwargs)
            for opt in optimizers:
                opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as speculators' trainer
            lr = optimizers[0].param_groups[0]["lr"]
            for opt in optimizers:
                opt.step()
            for scheduler in schedulers:
                scheduler.step()
            step += 1
            if every:
                trained.extend(places)
            if rank == 0 and (step % args.log_freq == 0 or step == config["total_steps"]):
                write({"step": step, "epochs": epochs, "rows": len(items), "lr": lr, **scalars(metrics)})
            if step in ends:
                validate(step, ends[step])
            if every and step % every == 0:  # after the epoch's validation: a restored run does not repeat it
                consumed = checkpoint(draft, optimizers, schedulers, config, step, consumed, trained, rank, world)
                trained = []
            if args.max_steps and step >= args.max_steps:
                break
        # A run that stopped short of its last epoch's end (max_steps, rows that failed a check)
        validate(step, next((e for end, e in sorted(ends.items()) if end >= step), config["epochs"] - 1))
    if rank == 0 and step:
        save(draft, save_path, "final")


def build_draft(args, config: dict):
    """speculators' build_draft_model, on the target as verifier (its config and weights)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import build_draft_model

    if not args.draft_mrope_full_head_hack:
        install_partial_neox_rotary()  # as speculators' own trainer does
    try:
        draft = build_draft_model(args, Eagle3DraftModel, config["t2d"], config["d2t"], args.draft_vocab_size)
    except Exception as e:  # speculators loads the verifier's config and weights here: say which failed how
        raise DraftStartFailed(f"the draft could not be built on its verifier, model.path "
                               f"{args.verifier_name_or_path} ({type(e).__name__}: {e})") from None
    if args.gradient_checkpointing:  # as speculators' trainer
        draft.gradient_checkpointing_enable()
    return draft


def optimizers_and_schedules(model, args, total_steps: int) -> tuple[list, list]:
    """speculators' optimizers and, one per optimizer, its learning-rate schedule: the kind
    (`scheduler.scheduler_type`), over schedule_steps' warmup and total steps."""
    from speculators.train.optimizers import build_optimizers
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    optimizers = build_optimizers(model, args)
    if args.scheduler_type == "none":
        return optimizers, []
    warmup, total = schedule_steps(args, total_steps)
    if args.scheduler_type == "linear":
        return optimizers, [get_linear_schedule_with_warmup(opt, warmup, total) for opt in optimizers]
    return optimizers, [get_cosine_schedule_with_warmup(opt, warmup, total, num_cycles=args.scheduler_num_cosine_cycles)
                        for opt in optimizers]


def schedule_steps(args, run_steps: int) -> tuple[int, int]:
    """(warmup, total) steps of the learning-rate schedule, with the meaning speculators'
    settings document (`scheduler.*`): total is `scheduler_total_steps`, or else the run's
    steps (`trainer.max_steps` where it cuts the epochs' steps short: its trainer's default);
    warmup is `scheduler_warmup_steps`, or else `scheduler_warmup_ratio` of total, or else 1%
    of total. draft_config refuses a ratio outside [0, 1] and totals below 1."""
    total = args.scheduler_total_steps if args.scheduler_total_steps is not None else run_steps
    if args.scheduler_warmup_steps is not None:
        return args.scheduler_warmup_steps, total
    if args.scheduler_warmup_ratio is not None:
        return int(total * args.scheduler_warmup_ratio), total
    return total // 100, total


def forward(model, items: list[tuple], hidden_size: int, dtype, device, call_kwargs: dict) -> tuple:
    """speculators' draft on rows (input_ids, loss_mask, hidden_states), packed as its own
    dataset packs them (batches.pack), in autocast for a states' dtype below float32: (loss,
    its per-step metrics)."""
    import torch

    packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in pack(items, hidden_size, dtype).items()}
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with autocast:
        _, loss, metrics = model(**packed, **call_kwargs)
    return loss, metrics


def train_items(config: dict, rank: int, world: int, start: int = 0,
                consumed=None) -> Iterator[tuple[list[tuple], list[int], list[tuple[int, int]]]]:
    """This worker's batches of rows (input_ids, loss_mask, hidden_states), their epochs and
    their places ((epoch, position) in the stream's epoch order; none from hidden_states/):
    its stream shard (every epoch in one pass; `consumed`, the places every worker had
    trained on by a restored checkpoint, not asked again), or its rank's slice of OUT's
    hidden_states/, epoch by epoch in the reader's (seed, epoch) order, from batch `start`
    on (a restored checkpoint's step)."""
    if config["source"] == "stream":
        import ray.train

        from eagle_data.training.stream_gate import stream_batches

        shard = ray.train.get_dataset_shard("train")
        for batch in stream_batches(shard, config["gate"], batch_size=config["batch_size"], consumed=consumed):
            yield (stream_items(batch, config["stream_dtype"]), sorted({int(e) for e in batch["epoch"]}),
                   [(int(e), int(p)) for e, p in zip(batch["epoch"], batch["position"])])
        return
    samples = offline_samples(config, "train", rank, world)
    for epoch in range(config["epochs"]):
        samples.set_epoch(epoch)
        order = samples.order
        for start_row in range(0, len(order), config["batch_size"]):
            if start > 0:
                start -= 1
                continue
            yield ([reader_item(samples.sample(int(pos))) for pos in order[start_row:start_row + config["batch_size"]]],
                   [epoch], [])


def validation_items(config: dict, rank: int, world: int) -> Iterator[list[tuple]]:
    """This worker's batches of the held-out rows, each row on one worker only: the
    validation stream's rows (the whole of it given to every worker) whose place is the
    worker's, or its share of OUT's hidden_states/ in file order."""
    if config["source"] == "stream":
        import ray.train

        place = 0
        for batch in ray.train.get_dataset_shard("validation").iter_batches(
                batch_size=config["batch_size"] * world, batch_format="numpy"):
            items = stream_items(batch, config["stream_dtype"])
            mine = [item for i, item in enumerate(items, place) if i % world == rank]
            place += len(items)
            if mine:
                yield mine
        return
    samples = offline_samples(config, "validation", 0, 1)
    mine = samples.order[rank::world]
    for start in range(0, len(mine), config["batch_size"]):
        yield [reader_item(samples.sample(int(pos))) for pos in mine[start:start + config["batch_size"]]]


def offline_samples(config: dict, side: str, rank: int, world: int):
    """The rows of OUT's hidden_states/ on one side of the split, as the reader serves rank
    `rank` of `world` (the driver's index: OUT is not read again)."""
    return config["samples"][side].for_rank(rank, world)


def reader_item(sample: dict) -> tuple:
    import torch

    return torch.from_numpy(sample["input_ids"]), torch.from_numpy(sample["loss_mask"]), sample["hidden_states"]


def evaluate(model, batches, hidden_size: int, dtype, device, call_kwargs: dict, world: int) -> dict:
    """speculators' validation metrics over every worker's batches: each metric's sums and
    totals added up across the workers (one collective), then normalized as speculators does."""
    import torch
    import torch.distributed as dist
    from speculators.train.utils import normalize_counted_metrics

    sums: dict = {}
    model.eval()
    with torch.no_grad():
        for items in batches:
            _, metrics = forward(model, items, hidden_size, dtype, device, call_kwargs)
            for k, v in metrics.items():
                if k.endswith(("_sum", "_total")):
                    sums[k] = sums.get(k, 0.0) + v.detach().float().cpu()
    model.train()
    keys = set(sums)
    if world > 1:  # every worker takes part, whatever its number of batches (none: no metric of its own)
        named = [None] * world
        dist.all_gather_object(named, sorted(keys))
        keys = set().union(*named)
    keys = sorted(keys)
    values = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32).reshape(()) for k in keys])
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return normalize_counted_metrics(dict(zip(keys, values.tolist())))


def scalars(metrics: dict) -> dict:
    """speculators' per-step metrics of this worker, normalized as speculators does (each
    `x_sum / x_total` as `x`)."""
    from speculators.train.utils import normalize_counted_metrics

    return normalize_counted_metrics({k: v.item() for k, v in metrics.items() if getattr(v, "numel", lambda: 0)() == 1})
