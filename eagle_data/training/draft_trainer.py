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

What fails is said in one line (errors.cli): the setup before Ray starts (the target's
weights, save_path), the cluster's resources for the workers (train.resource_wait_s), and an
error a worker raises that is the project's (the draft that cannot be built on the
verifier). A stop signal stops the run with its own exit code: `fit` runs in a thread of its
own, since Ray Train puts its own SIGINT handler in place of the project's when it runs in
the main thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import threading
import uuid

import numpy as np
from ray.train import UserCallback

from eagle_data.config import Config
from eagle_data.errors import (ConfigError, EagleDataError, EmptyResult, MissingInput, NotWritable, NoTrainingResources,
                               user_error)
from eagle_data.feature_shape import FeatureShape
from eagle_data.job.ray_internals import undeclared_hint, wait_for_nodes
from eagle_data.job.ray_session import start_ray
from eagle_data.model_files import check_weights
from eagle_data.reader import OutReader, Samples
from eagle_data.reader.samples import padded_order
from eagle_data.tools.token_counts import count_tokens
from eagle_data.training.checkpoints import cut_short, saved_steps
from eagle_data.training.draft_config import MARKER, read_marker, run_settings, save_path_leftovers, save_path_run
from eagle_data.training.draft_loop import train_loop
from eagle_data.training.stream import READ_COLUMNS, features_of
from eagle_data.training.stream_gate import gate_summary, summary_line

log = logging.getLogger("eagle_data")


def train(cfg: Config, spec, shape: FeatureShape) -> str:
    """Train the draft `spec` (draft_config.speculators_config) describes on the target of
    `shape` (feature_shape, read once for the run); returns the summary."""
    save_path, settings = spec.trainer.save_path, run_settings(cfg, spec, shape)
    resuming = prepare_save_path(save_path, settings)
    check_weights(cfg.model.path)  # each worker loads the verifier's: a truncated file fails here, once
    plan = Plan.of(cfg, spec, shape)
    d2t, t2d, vocab_size = draft_vocabulary(cfg, spec, shape)
    if not resuming:
        spec.save(save_path)  # speculators' run.yaml and train_command.txt, as its own trainer writes them
        mark(save_path, start=sorted(set(os.listdir(save_path)) - {MARKER}), config=settings)
    start_ray(cfg.output.ray_data_progress)
    wait_for_worker_resources(cfg)
    log.info("train: %d workers (%s), draft vocab %d of %d, %s, %s, checkpoints in %s", cfg.train.workers,
             cfg.train.device, spec.draft.draft_vocab_size, vocab_size, plan, spec.scheduler.scheduler_type, save_path)
    fit(cfg, spec, d2t, t2d, plan)
    text = summary(save_path, plan)
    marker = read_marker(save_path)
    mark(save_path, marker["start"], marker.get("config"), finished=True)  # the same command says so, not resumes
    return text


@dataclasses.dataclass
class Plan:
    """What the workers train on: the source (train.source), the rows of each side of the
    split (data.train_data_ratio of the prompts train, seeded by their prompt_id), and the
    steps that makes (every worker the same number). `samples`: each side's, read once
    (split_samples), which the stream and the workers are given."""

    source: str
    train_rows: int  # an epoch's rows
    per_epoch: int  # and padded to a multiple of the workers, as the reader and the stream pad them
    validation_rows: int
    epochs: int
    steps: int
    holdout: tuple[float, int]  # (validation fraction, seed)
    gate: str  # the stream's gate (training/stream_gate.py)
    shape: FeatureShape
    samples: dict = dataclasses.field(repr=False)

    @classmethod
    def of(cls, cfg: Config, spec, shape: FeatureShape) -> "Plan":
        holdout = (1 - spec.data.train_data_ratio, spec.seed)
        filters = {"finish_reason": cfg.hidden_states.finish_reason, "source": cfg.hidden_states.source,
                   "max_len": spec.data.total_seq_len}
        offline = cfg.train.source == "hidden_states"
        samples = split_samples(cfg.output.path, holdout, filters, offline)
        if offline:
            check_features(cfg, samples["train"], shape)
        sides = {side: s.row.size for side, s in samples.items()}
        ratio = spec.data.train_data_ratio
        log.info("train: data.train_data_ratio %g: %d rows to train on, %d held out for validation", ratio,
                 sides["train"], sides["validation"])
        if ratio < 1 and sides["train"] and not sides["validation"]:
            raise ConfigError(f"train.speculators.data.train_data_ratio {ratio:g} holds out no row of the "
                              f"{sides['train']} selected (prompts are held out whole, by a seeded hash of their "
                              "prompt_id): lower it to validate, or set it to 1 to train without validation")
        if not sides["train"]:
            raise EmptyResult(f"train: no row of {cfg.output.path} is left to train on (the hidden-states filters, "
                              f"data.total_seq_len {spec.data.total_seq_len}, data.train_data_ratio "
                              f"{spec.data.train_data_ratio} holding out {sides['validation']})")
        workers, epochs = cfg.train.workers, spec.trainer.epochs
        per_epoch = padded_order(np.arange(sides["train"]), workers, False).size
        per_worker = per_epoch // workers  # an epoch's
        steps = (epochs * math.ceil(per_worker / cfg.train.batch_size) if offline
                 else math.ceil(epochs * per_worker / cfg.train.batch_size))  # the stream: every epoch in one pass
        if spec.trainer.max_steps:
            steps = min(steps, spec.trainer.max_steps)
        return cls(cfg.train.source, sides["train"], per_epoch, sides["validation"], epochs, steps, holdout,
                   f"eagle-data-train-{uuid.uuid4().hex[:8]}", shape, samples)

    def __str__(self) -> str:
        return (f"{self.train_rows} rows to train on ({self.source}), {self.validation_rows} held out, "
                f"{self.epochs} epochs, {self.steps} steps")


def split_samples(out: str, holdout: tuple[float, int], filters: dict, hidden_states: bool) -> dict[str, Samples]:
    """Each side of the split (`holdout`: the held-out fraction, the seed) as the workers take
    it: the train side in the seed's (seed, epoch) orders, the held-out rows in file order;
    with `hidden_states`, their OUT's hidden_states/. OUT's shard list, its index and
    hidden_states/'s headers are read once for both."""
    reader, seed = OutReader(out), holdout[1]
    common = dict(hidden_states=hidden_states, columns=READ_COLUMNS, **filters)
    return {"train": Samples(reader, holdout=("train", *holdout), seed=seed, **common),
            "validation": Samples(reader, holdout=("validation", *holdout), shuffle=False, **common)}


def draft_vocabulary(cfg: Config, spec, shape: FeatureShape) -> tuple:
    """d2t and t2d of the draft's vocabulary from OUT's training-token counts, with
    speculators' mapping, and the target's vocabulary size. spec.draft.draft_vocab_size is
    set to what is used: at most the target's; None, as in speculators, is the target's
    whole vocabulary (no mapping: d2t and t2d None). The target's vocabulary is its config's
    (`shape`), as speculators' get_target_vocab_size reads it."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    vocab_size = shape.vocab_size
    if vocab_size is None:
        raise MissingInput(f"model.path {cfg.model.path!r}: the target's config has no vocab_size (the draft's "
                           "vocabulary is mapped onto it)")
    asked = spec.draft.draft_vocab_size
    if asked is None or asked >= vocab_size:
        if asked is not None and asked > vocab_size:
            log.info("train: draft.draft_vocab_size %d is more than the target's %d tokens: the target's", asked,
                     vocab_size)
        spec.draft.draft_vocab_size = vocab_size
        return None, None, vocab_size
    counts = count_tokens(cfg.output.path, vocab_size, cfg.hidden_states.finish_reason, cfg.hidden_states.source).counts
    d2t, t2d = build_vocab_mappings_from_distribution(
        {int(i): int(counts[i]) for i in counts.nonzero()[0]}, asked, vocab_size)
    return d2t, t2d, vocab_size


def prepare_save_path(save_path: str, settings: dict | None = None) -> bool:
    """Whether the run resumes: save_path holds a run of these `settings` that did not finish
    (draft_config.save_path_run; what a save cut short left is removed). Otherwise save_path
    made (or emptied of what a start that made no step left there:
    draft_config.save_path_leftovers) and marked as the trainer's (draft_config.MARKER)."""
    if settings is not None and save_path_run(save_path, settings):
        for name in cut_short(save_path):
            log.warning("train: %s is a checkpoint whose save was cut short: removing it", name)
            shutil.rmtree(os.path.join(save_path, name))
        steps = saved_steps(save_path)
        log.info("train: %s holds a run of these settings that did not finish (checkpoints: %s): it resumes from "
                 "its latest checkpoint, as after a lost worker", save_path,
                 ", ".join(f"step-{n}" for n in steps) if steps else "none: from step 0")
        return True
    leftovers = save_path_leftovers(save_path) if os.path.isdir(save_path) else []
    if leftovers is None:  # filled since the config was checked
        raise NotWritable(f"train.speculators.trainer.save_path {save_path} is not empty: choose a new folder")
    if leftovers:
        log.warning("train: %s holds what a start that made no step left (%s): removing it", save_path,
                    ", ".join(sorted(leftovers)))
    try:
        for name in leftovers:
            path = os.path.join(save_path, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        os.makedirs(save_path, exist_ok=True)
        mark(save_path, start=[], config=settings)
    except OSError as e:
        raise NotWritable(f"train.speculators.trainer.save_path {save_path} cannot be written "
                          f"({type(e).__name__}: {e.strerror or e}); choose a folder you can write") from None
    return False


def mark(save_path: str, start: list[str], config: dict | None = None, finished: bool = False) -> None:
    """draft_config.MARKER: the folder is the trainer's; `start`, what its start wrote there;
    `config`, the run's settings (what a resume must match); `finished`. Written aside and
    renamed into place: a kill never leaves half a marker, which would make the folder another's."""
    record = {"made_by": "eagle-data's draft trainer (python -m ray_jobs.train_draft)", "start": start}
    if config is not None:
        record["config"] = config
    if finished:
        record["finished"] = True
    path = os.path.join(save_path, MARKER)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def wait_for_worker_resources(cfg: Config) -> None:
    """Fail with a message, instead of Ray Train retrying its workers' start forever, when the
    cluster cannot hold train.workers workers (an autoscaling cluster gets train.resource_wait_s)."""
    need = {"GPU": 1} if cfg.train.device == "gpu" else {}
    need.update({"CPU": cfg.train.cpus_per_worker} if cfg.train.cpus_per_worker else {})
    need.update(cfg.train.worker_resources)

    def room(res: dict) -> float:
        return min((math.floor(res.get(k, 0) / v) for k, v in need.items()), default=math.inf)

    fits, nodes = wait_for_nodes(lambda nodes: sum(room(res) for res in nodes) >= cfg.train.workers,
                                 cfg.train.resource_wait_s)
    if fits:
        return
    if "GPU" in need and not any(res.get("GPU", 0) for res in nodes):
        hint = "there is no GPU in the cluster; set train.device=cpu to train on CPUs"
    else:
        hint = (undeclared_hint(cfg.train.worker_resources, nodes, "train.worker_resources", "trainer", 8)
                or "lower train.workers / train.cpus_per_worker or add nodes")
    raise NoTrainingResources(
        f"train.workers={cfg.train.workers} with train.device={cfg.train.device} need {need} each, and after waiting "
        f"{cfg.train.resource_wait_s:g}s (train.resource_wait_s) the cluster has room for "
        f"{sum(min(room(res), cfg.train.workers) for res in nodes):g}: {hint}")


def check_features(cfg: Config, samples, shape: FeatureShape) -> None:
    """OUT's hidden_states/ are the features the config's draft takes (train.source:
    hidden_states): the same layer ids, in the same dtype."""
    ids = list(shape.layer_ids)
    if list(samples.hidden_layer_ids) != ids or samples.hidden_dtype != cfg.hidden_states.dtype:
        raise ConfigError(f"train.source hidden_states: {cfg.output.path}'s hidden_states/ hold layer ids "
                          f"{list(samples.hidden_layer_ids)} in {samples.hidden_dtype}, the config asks for {ids} in "
                          f"{cfg.hidden_states.dtype} (hidden_states.layer_ids, hidden_states.dtype): set them as "
                          "the hidden-states phase ran, or stream (train.source: stream)")


def fit(cfg: Config, spec, d2t, t2d, plan: Plan) -> None:
    """A TorchTrainer of train.workers workers running draft_loop.train_loop: on the stream
    (the validation rows' states computed once, first, and given whole to every worker), or
    on OUT's hidden_states/, which each worker reads itself."""
    from ray.train import DataConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    save_path, workers = spec.trainer.save_path, cfg.train.workers
    datasets = stream_datasets(cfg, plan) if plan.source == "stream" else {}
    gpu = cfg.train.device == "gpu"
    # Ray refuses a worker bundle of 0 CPUs; one byte of memory is a bundle that reserves nothing.
    resources = {"CPU": cfg.train.cpus_per_worker} if cfg.train.cpus_per_worker else {"memory": 1}
    resources.update({"GPU": 1} if gpu else {})
    resources.update(cfg.train.worker_resources)
    trainer = TorchTrainer(train_loop, train_loop_config=loop_config(cfg, spec, d2t, t2d, plan),
                           datasets=datasets or None,
                           dataset_config=DataConfig(datasets_to_split=["train"]) if datasets else None,
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu,
                                                        resources_per_worker=resources),
                           # The same name and storage as the run's first start: Ray Train restores a run's
                           # checkpoints from there, so a driver started again resumes as a new worker group does.
                           run_config=RunConfig(storage_path=os.path.join(save_path, "ray-train"), name="train",
                                                failure_config=FailureConfig(max_failures=cfg.train.max_failures),
                                                callbacks=[RepeatedFailure()]))
    try:
        result = in_a_thread(trainer.fit)
    except TrainingFailedError as e:
        raise failure(e) from None
    if result.error:
        raise failure(result.error)


def stream_datasets(cfg: Config, plan: Plan) -> dict:
    """The stream of the train side's samples, and of the held-out ones (computed once, first,
    and given whole to every worker), each with a gate of its own."""
    datasets = {}
    if plan.validation_rows:
        datasets["validation"] = features_of(plan.samples["validation"], cfg, gate=f"{plan.gate}-validation",
                                             shape=plan.shape).materialize()
    datasets["train"] = features_of(plan.samples["train"], cfg, epochs=plan.epochs, world_size=cfg.train.workers,
                                    gate=plan.gate, shape=plan.shape)
    return datasets


def loop_config(cfg: Config, spec, d2t, t2d, plan: Plan) -> dict:
    """What each Ray Train worker's draft_loop.train_loop is given: from OUT's hidden_states/,
    the split's samples (each worker takes its rank's share without reading OUT's index again)."""
    return {"args": dict(spec.flatten()), "d2t": d2t, "t2d": t2d, "batch_size": cfg.train.batch_size,
            "hidden_size": plan.shape.hidden_size, "stream_dtype": cfg.hidden_states.dtype,
            "save_path": spec.trainer.save_path, "checkpoint_every": cfg.train.checkpoint_every,
            "source": plan.source, "samples": plan.samples if plan.source == "hidden_states" else None,
            "epochs": plan.epochs, "total_steps": plan.steps, "validation": bool(plan.validation_rows),
            "gate": plan.gate, "per_epoch": plan.per_epoch}


class RepeatedFailure(UserCallback):
    """Ray Train's controller stops retrying (train.max_failures, -1 without end) where two
    attempts in a row failed the same way with no checkpoint reported between them: the
    same error, from the same checkpoint, would come again at every retry. A lost worker's
    error names the worker, so lost workers are retried as before."""

    def __init__(self):
        self.last = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is not None:  # progress: an earlier failure is not this one's twin
            self.last = None

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        rank = min(worker_exceptions)  # the lowest rank's: every rank fails alike where the cause is shared
        error = worker_exceptions[rank]
        seen = f"{type(error).__name__}: {error}"  # a worker's error is its traceback's text
        if seen == self.last:
            last_line = (str(error).strip().splitlines() or [type(error).__name__])[-1]
            raise EagleDataError(f"train: the workers failed twice in a row the same way, from the same checkpoint, "
                                 f"so Ray Train does not start them again (train.max_failures): rank {rank}: "
                                 f"{last_line}")
        self.last = seen


def in_a_thread(call):
    """call() in a thread of its own, its result or error here. The main thread waits, where
    the project's stop signals (errors.stop_on_signals) stop the job: in the main thread Ray
    Train's fit() puts its own SIGINT handler in place, which only asks the run to stop and
    exits 1 without a word."""
    outcome = {}

    def run():
        try:
            outcome["result"] = call()
        except BaseException as e:  # handed to the main thread as it is
            outcome["error"] = e

    thread = threading.Thread(target=run, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def failure(error: BaseException) -> BaseException:
    """A failed fit() as the user is told: the project's error a worker raised (the first by
    rank), with its message and exit code; anything else as it is (a bug: its traceback)."""
    ranks = sorted(getattr(error, "worker_failures", {}).items())
    causes = [*(cause for _, cause in ranks), getattr(error, "controller_failure", None), error]
    return next((found for cause in causes if (found := user_error(cause)) is not None), error)


def summary(save_path: str, plan: Plan) -> str:
    with open(os.path.join(save_path, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "step" in r and "validation" not in r]
    validations = [r for r in records if "validation" in r]
    if not steps:
        raise EagleDataError(f"train: no step ran (no row reached the trainer); see {save_path}")
    lines = [f"save_path = {save_path}",
             f"  steps:       {steps[-1]['step']} of {plan.steps}, loss {steps[0]['loss']:.4f} -> "
             f"{steps[-1]['loss']:.4f} (rank 0's rows)"]
    if validations:
        last = validations[-1]["validation"]
        accuracy = ", ".join(f"{last[k]:.3f}" for k in sorted(last) if k.startswith("full_acc_"))
        lines.append(f"  validation:  {plan.validation_rows} rows held out, loss "
                     f"{validations[0]['validation']['loss']:.4f} -> {last['loss']:.4f}, full_acc by step {accuracy}")
    if plan.source == "stream":
        lines.append(f"  stream:      {summary_line(gate_summary(plan.gate))}")
    else:
        lines.append(f"  rows:        {plan.train_rows} an epoch from hidden_states/")
    saved = sorted((d for d in os.listdir(save_path) if d.startswith("step-")), key=lambda d: int(d[5:]))
    lines.append(f"  draft:       {save_path}/final (speculators' format: vLLM's speculative_config.model)")
    if saved:
        lines.append(f"  checkpoints: {', '.join(saved)}")
    return "\n".join(lines)
