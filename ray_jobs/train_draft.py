"""Entry point for `ray job submit ... -- python -m ray_jobs.train_draft --config FILE`:
train an EAGLE-3 draft from the feature stream, with speculators' own draft model, vocab
mapping and loss (speculators 0.9.0, the optional `draft` extra; docs/streaming.md).

    OUT's data/ (the generate phase's rows; no hidden_states/ needed)
      -> the draft vocabulary: OUT's training-token counts (tools/token_counts.py, the
         hidden-states filters), speculators' build_vocab_mappings_from_distribution
      -> eagle_data.stream.features: the target's states at the EAGLE-3 layers from the
         engine replicas, trainer.epochs epochs, train.workers equal shares
      -> a Ray Train TorchTrainer of train.workers workers, each: speculators'
         build_draft_model (the verifier is model.path), DDP, speculators' optimizer; per
         step train.batch_size rows packed into one sequence (speculators' shift_batch and
         CollateFn), the model's own forward and loss
      -> trainer.save_path/final/ (speculators' save_pretrained: config.json,
         model.safetensors; what vLLM loads as `speculative_config.model`), step-<N>/ every
         train.checkpoint_every steps, speculators' run.yaml, and metrics.jsonl (rank 0's
         steps: loss and speculators' per-step metrics)

Checkpoints are by step, not by epoch: a worker's rows are not in epoch order (Ray's equal
split may hand an epoch's last rows out at the very end of the stream).

The states are pre-norm at every layer id, the last one the final state (OUT's convention
and speculators' file layout: `hidden_states[:, :-1]` the aux input, `hidden_states[:, -1]`
the verifier's last state), so hidden_states.layer_ids must end with the model's depth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import uuid

import eagle_data
from eagle_data.config import Config, load_config
from eagle_data.errors import ConfigError, EagleDataError, MissingInput, cli, exit_with, stop_on_signals

log = logging.getLogger("eagle_data")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_jobs.train_draft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml) with a `train:` section")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.workers=8 (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("code: eagle-data %s from %s", eagle_data.__version__,
             os.path.dirname(os.path.abspath(eagle_data.__file__)))
    save_path = None

    def job() -> int:
        nonlocal save_path
        cfg = load_config(args.config, args.overrides)
        spec = speculators_config(cfg)
        save_path = spec.trainer.save_path
        print(train(cfg, spec))
        return 0

    stop_on_signals()
    return cli(job, writing=lambda: save_path)


def speculators_config(cfg: Config):
    """`train.speculators` as speculators' own TrainConfig, with what the stream decides
    filled in (the target, its aux layer ids); refused where it cannot train from the stream."""
    try:
        from speculators.train.config.schema import TrainConfig
    except ImportError as e:
        raise MissingInput(f"the draft trainer needs speculators 0.9.0 (the project's `draft` extra; "
                           f"`make setup` installs it): {e}") from None
    from pydantic import ValidationError

    from eagle_data.job.phases.hidden_states import layer_ids, target_shape

    given = dict(cfg.train.speculators)
    unknown_keys(TrainConfig, given, "train.speculators")
    num_layers, _ = target_shape(cfg)
    ids = layer_ids(cfg, num_layers)
    if ids[-1] != num_layers or len(ids) < 2:
        raise ConfigError(f"hidden_states.layer_ids {ids}: speculators takes the last layer as the final state "
                          f"(layer id {num_layers}) and at least one aux layer before it")
    draft = dict(given.get("draft") or {})
    if draft.get("target_layer_ids") not in (None, ids[:-1]):
        raise ConfigError(f"train.speculators.draft.target_layer_ids {draft['target_layer_ids']}: the stream "
                          f"carries aux layers {ids[:-1]} (hidden_states.layer_ids {ids}); leave it unset")
    verifier = (given.get("verifier") or {}).get("verifier_name_or_path")
    if verifier not in (None, cfg.model.path):
        raise ConfigError(f"train.speculators.verifier.verifier_name_or_path {verifier}: the stream's target is "
                          f"model.path {cfg.model.path}; leave it unset")
    try:
        spec = TrainConfig.model_validate({**given, "draft": {**draft, "target_layer_ids": ids[:-1]},
                                           "verifier": {**(given.get("verifier") or {}),
                                                        "verifier_name_or_path": cfg.model.path,
                                                        "trust_remote_code": cfg.model.trust_remote_code}})
    except ValidationError as e:
        raise ConfigError("train.speculators: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    if spec.speculator_type != "eagle3":
        raise ConfigError(f"train.speculators.speculator_type {spec.speculator_type}: the stream carries EAGLE-3 "
                          "features; only eagle3 trains from it")
    save_path = (given.get("trainer") or {}).get("save_path")
    if not save_path or not os.path.isabs(save_path):
        raise ConfigError(f"train.speculators.trainer.save_path {save_path!r}: give an absolute folder for the "
                          "draft checkpoints (on storage rank 0's node writes and you read)")
    if os.path.exists(save_path) and (not os.path.isdir(save_path) or os.listdir(save_path)):
        raise ConfigError(f"train.speculators.trainer.save_path {save_path} exists and is not an empty folder: "
                          "choose a new one (nothing in it is replaced)")
    return spec


def unknown_keys(model, given: dict, where: str) -> None:
    """speculators' config ignores unknown keys; a misspelt one would train with a default."""
    for key, value in given.items():
        field = model.model_fields.get(key)
        if field is None:
            raise ConfigError(f"{where}.{key}: unknown key (speculators' TrainConfig has "
                              f"{', '.join(model.model_fields)})")
        kind = field.annotation
        if isinstance(value, dict) and isinstance(kind, type) and hasattr(kind, "model_fields"):
            unknown_keys(kind, value, f"{where}.{key}")


def train(cfg: Config, spec) -> str:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution, get_target_vocab_size

    from eagle_data.job.phases.hidden_states import target_shape
    from eagle_data.job.ray_internals import ray_data_progress
    from eagle_data.stream import features, stream_report
    from eagle_data.tools.token_counts import count_tokens

    out, save_path = cfg.output.path, spec.trainer.save_path
    vocab_size = get_target_vocab_size(None, cfg.model.path, cfg.model.trust_remote_code)
    draft_vocab = min(spec.draft.draft_vocab_size or 32_000, vocab_size)
    counts = count_tokens(out, vocab_size, cfg.hidden_states.finish_reason, cfg.hidden_states.source).counts
    d2t, t2d = build_vocab_mappings_from_distribution(
        {int(i): int(counts[i]) for i in counts.nonzero()[0]}, draft_vocab, vocab_size)
    spec.draft.draft_vocab_size = draft_vocab
    os.makedirs(save_path, exist_ok=True)
    spec.save(save_path)  # speculators' run.yaml and train_command.txt, as its own trainer writes them

    if not ray.is_initialized():
        ray.init()  # joins the cluster when there is one, else starts a local instance
        stop_on_signals()
    ray_data_progress(cfg.output.ray_data_progress)
    workers = cfg.train.workers
    report = f"eagle-data-train-{uuid.uuid4().hex[:8]}"
    ds = features(out, cfg, epochs=spec.trainer.epochs, world_size=workers, seed=spec.seed,
                  max_len=spec.data.total_seq_len, report=report)
    gpu = cfg.train.device == "gpu"
    # Ray refuses a worker bundle of 0 CPUs; one byte of memory is a bundle that reserves nothing.
    resources = {"CPU": cfg.train.cpus_per_worker} if cfg.train.cpus_per_worker else {"memory": 1}
    resources.update({"GPU": 1} if gpu else {})
    loop_config = {"args": dict(spec.flatten()), "d2t": d2t, "t2d": t2d, "batch_size": cfg.train.batch_size,
                   "hidden_size": target_shape(cfg)[1], "stream_dtype": cfg.hidden_states.dtype,
                   "save_path": save_path, "checkpoint_every": cfg.train.checkpoint_every}
    log.info("train: %d workers (%s), draft vocab %d of %d, %d epochs, %d rows a step, checkpoints in %s",
             workers, cfg.train.device, draft_vocab, vocab_size, spec.trainer.epochs, cfg.train.batch_size, save_path)
    result = TorchTrainer(train_loop, train_loop_config=loop_config, datasets={"train": ds},
                          scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu,
                                                       resources_per_worker=resources),
                          run_config=RunConfig(storage_path=os.path.join(save_path, "ray-train"),
                                               name="train")).fit()
    if result.error:
        raise result.error
    steps = [json.loads(line) for line in open(os.path.join(save_path, "metrics.jsonl"))]
    if not steps:
        raise EagleDataError(f"train: no step ran (no stream row reached the trainer); see {save_path}")
    stream = stream_report(report)
    failed = sum(sum(e["failed"].values()) for e in stream["epochs"].values())
    saved = sorted((d for d in os.listdir(save_path) if d.startswith("step-")), key=lambda d: int(d[5:]))
    return "\n".join([f"save_path = {save_path}",
                      f"  steps:       {len(steps)}, loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}",
                      f"  stream:      {stream['per_epoch']} samples an epoch, {failed} failed checks",
                      f"  draft:       {save_path}/final (speculators' format: vLLM's speculative_config.model)"
                      + (f"\n  checkpoints: {', '.join(saved)}" if saved else "")])


def train_loop(config: dict) -> None:
    """One Ray Train worker: speculators' draft, trained on this worker's stream shard."""
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
    draft = build_draft_model(args, Eagle3DraftModel, config["t2d"], config["d2t"], args.draft_vocab_size)
    model = prepare_model(draft)
    optimizers = build_optimizers(model, args)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    dtype, device = getattr(torch, args.hidden_states_dtype), get_device()
    rank = ray.train.get_context().get_world_rank()
    save_path, every, step = config["save_path"], config["checkpoint_every"], 0
    metrics_file = open(os.path.join(save_path, "metrics.jsonl"), "a") if rank == 0 else None
    shard = ray.train.get_dataset_shard("train")
    # Two batches fetched ahead of the step (Ray's default is one): benchmarks/stream_balance.py.
    for batch in shard.iter_batches(batch_size=config["batch_size"], batch_format="numpy", prefetch_batches=2):
        packed = pack(batch, config["hidden_size"], config["stream_dtype"], dtype)
        packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
        autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        with autocast:
            _, loss, metrics = model(**packed, **train_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as speculators' trainer
        for opt in optimizers:
            opt.step()
        step += 1
        if rank == 0:
            record = {"step": step, "epochs": sorted({int(e) for e in batch["epoch"]}), "rows": len(batch["epoch"]),
                      "loss": loss.item(),
                      **{k: v.item() for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}}
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if every and step % every == 0:
                save(draft, save_path, f"step-{step}")
        if args.max_steps and step >= args.max_steps:
            break
    if rank == 0:
        metrics_file.close()
        if step:
            save(draft, save_path, "final")


def pack(batch: dict, hidden_size: int, stream_dtype: str, dtype) -> dict:
    """Stream rows -> speculators' packed batch ([1, total tokens, ...], document_ids), each
    row made the sample speculators' dataset makes from its hidden-states file and shifted
    by its shift_batch; no row cut, no padding."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagle_data.stream import row_tensors

    items = []
    for i in range(len(batch["sample_id"])):
        input_ids, loss_mask, states = row_tensors(batch, i, stream_dtype)  # states [T, layers, H]
        n = len(input_ids)
        items.append({"hidden_states": states[:, :-1].flatten(1), "verifier_last_hidden_states": states[:, -1],
                      "input_ids": input_ids, "loss_mask": loss_mask, "lengths": torch.tensor([n]),
                      "position_ids": torch.arange(n)})
    total = sum(len(item["input_ids"]) - 1 for item in items)  # shift_batch drops one token a row
    packed = CollateFn(max_len=total, hidden_size=hidden_size, num_target_layers=states.shape[1] - 1, dtype=dtype,
                       preprocess=shift_batch)(items)
    packed.pop("error_records")
    return packed


def save(draft, save_path: str, name: str) -> None:
    """A speculators checkpoint folder (config.json, model.safetensors), written aside and
    renamed into place: a kill leaves a hidden .tmp folder, never half a checkpoint."""
    final = os.path.join(save_path, name)
    tmp = os.path.join(save_path, f".{name}.{uuid.uuid4().hex}.tmp")
    draft.save_pretrained(tmp)
    os.rename(tmp, final)
    log.info("train: the draft saved to %s", final)


if __name__ == "__main__":
    exit_with(main())
