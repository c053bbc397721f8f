"""`train.speculators` -> speculators' own TrainConfig (speculators 0.9.0, the `draft`
extra), with what the stream decides filled in (the target, its aux layer ids, the states'
dtype), checked before anything starts: speculators' config ignores unknown keys, and a
key in the wrong place would train with a silent default.

`trainer.save_path` must be new or empty, hold only what a start of the trainer that made no
step left there (MARKER says the trainer made the folder and lists what it wrote before its
first step; save_path_leftovers): the same command then runs again without a hand-made
cleanup; or hold a run of the same settings that did not finish (MARKER records them:
run_settings), which the same command resumes (save_path_run)."""

from __future__ import annotations

import json
import os

from eagle_data.config import Config
from eagle_data.errors import ConfigError, MissingPackage
from eagle_data.feature_shape import FeatureShape, feature_shape

# Written first into trainer.save_path by the trainer (the folder is the project's), then
# again with the names speculators' run files took ({"start": [...]}); with the run's settings
# ({"config": run_settings}) and, once it is done, {"finished": true}.
MARKER = ".eagle-data-draft"
# What else a start leaves before its first step: Ray Train's folder and an empty
# metrics.jsonl. A step-<N>/ or final/ is never a leftover.
RUN_FILES = {"ray-train", "metrics.jsonl"}

# The keys of speculators' TrainConfig the trainer honours (a section: all its keys but those
# INSTEAD names); any other key given is refused, naming what stands for it here:
# speculators' own trainer reads them, this one would silently ignore them.
HONOURED = {"speculator_type", "seed", "verifier", "draft", "loss", "optimizer", "scheduler",
            "trainer.epochs", "trainer.max_steps", "trainer.save_path", "trainer.log_freq",
            "trainer.gradient_checkpointing", "data.total_seq_len", "data.hidden_states_dtype",
            "data.train_data_ratio"}
INSTEAD = {  # why a refused key is not needed here, or what stands for it
    "draft.token_freq_path": "the draft's vocabulary is counted from OUT's rows",
    "draft.d2t_path": "the draft's vocabulary is counted from OUT's rows; `python -m eagle_data vocab` writes "
                      "the same mapping",
    "draft.t2d_path": "the draft's vocabulary is counted from OUT's rows; `python -m eagle_data vocab` writes "
                      "the same mapping",
    "data": "the rows are OUT's, their states the stream's or OUT's hidden_states/ (train.source)",
    "generation": "the answers are OUT's, made by the generate phase",
    "trainer.checkpoint_freq": "train.checkpoint_every says when to save, in steps",
    "trainer.save_best": "every validation is in metrics.jsonl; train.checkpoint_every saves every N steps",
    "trainer.no_resume_from_checkpoint": "a run starts from step 0 in a new trainer.save_path; a worker group "
                                         "Ray Train starts again (train.max_failures) resumes from its latest "
                                         "step-<N>/",
    "trainer.fsdp_shard": "its workers are DDP ranks (train.workers)",
    "logging": "it logs to metrics.jsonl in trainer.save_path and to the job log",
    "dry_run": "its checks run before anything starts",
    "deterministic_cuda": "train.source: hidden_states gives a reproducible order",
}


def speculators_config(cfg: Config, shape: FeatureShape | None = None):
    """`train.speculators` as speculators' TrainConfig; refused where it cannot train from the
    stream. `shape`: the target's, where the caller has read it (else read here)."""
    if "train" not in cfg.model_fields_set:
        raise ConfigError("the config has no `train:` section: the draft trainer's settings (train.workers, "
                          "train.speculators with trainer.save_path, ...; docs/streaming.md, configs/kimi-k2.5.yaml)")
    try:
        from speculators.train.config.schema import TrainConfig
    except ImportError as e:
        raise MissingPackage(f"the draft trainer needs speculators 0.9.0 (the project's `draft` extra; "
                             f"`make setup` installs it): {e}") from None
    from pydantic import ValidationError

    given = dict(cfg.train.speculators)
    unknown_keys(TrainConfig, given, "train.speculators")
    refuse_unhonoured(given)
    shape = shape or feature_shape(cfg)
    num_layers, ids = shape.num_layers, list(shape.layer_ids)
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
    vocab = draft.get("draft_vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
        raise ConfigError(f"train.speculators.draft.draft_vocab_size {vocab!r}: the draft's vocabulary, a number of "
                          "tokens of at least 1 (null: the target's whole vocabulary, as in speculators)")
    data = dict(given.get("data") or {})
    dtype = data.get("hidden_states_dtype", cfg.hidden_states.dtype)
    if dtype != cfg.hidden_states.dtype:
        raise ConfigError(f"train.speculators.data.hidden_states_dtype {dtype}: the stream's states are "
                          f"hidden_states.dtype {cfg.hidden_states.dtype}; leave it unset or set both alike")
    try:
        spec = TrainConfig.model_validate({**given, "draft": {**draft, "target_layer_ids": ids[:-1]},
                                           "data": {**data, "hidden_states_dtype": dtype},
                                           "verifier": {**(given.get("verifier") or {}),
                                                        "verifier_name_or_path": cfg.model.path,
                                                        "trust_remote_code": cfg.model.trust_remote_code}})
    except ValidationError as e:
        raise ConfigError("train.speculators: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    scheduler(spec.scheduler)
    if spec.speculator_type != "eagle3":
        raise ConfigError(f"train.speculators.speculator_type {spec.speculator_type}: the stream carries EAGLE-3 "
                          "features; only eagle3 trains from it")
    save_path = (given.get("trainer") or {}).get("save_path")
    if not save_path or not os.path.isabs(save_path):
        raise ConfigError(f"train.speculators.trainer.save_path {save_path!r}: give an absolute folder for the "
                          "draft checkpoints (on storage rank 0's node writes and you read)")
    save_path_run(save_path, run_settings(cfg, spec, shape))
    return spec


def run_settings(cfg: Config, spec, shape: FeatureShape) -> dict:
    """The settings a run's steps depend on, as flattened `section.key: value`: the target
    and its features, OUT and the rows selected, the workers' shares and speculators' whole
    resolved config (its save_path aside). A run in save_path resumes only with each alike."""
    settings = {"model.path": cfg.model.path, "output.path": cfg.output.path,
                "hidden_states.layer_ids": list(shape.layer_ids), "hidden_states.dtype": cfg.hidden_states.dtype,
                "hidden_states.finish_reason": cfg.hidden_states.finish_reason,
                "hidden_states.source": cfg.hidden_states.source, "train.source": cfg.train.source,
                "train.workers": cfg.train.workers, "train.batch_size": cfg.train.batch_size}

    def flatten(value, key: str) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                flatten(inner, f"{key}.{name}")
        elif key != "train.speculators.trainer.save_path":
            settings[key] = value

    flatten(spec.model_dump(mode="json"), "train.speculators")
    return json.loads(json.dumps(settings))  # as it reads back from the marker


def save_path_run(save_path: str, settings: dict) -> bool:
    """Whether save_path holds a run to resume: one the trainer started with these
    `settings` that did not finish. False where it is new, empty or holds only what a start
    that made no step left; refused (one line) where it holds anything else: another run's
    files (the settings that differ named), a finished run, files the trainer did not write."""
    if not os.path.exists(save_path):
        return False
    key = f"train.speculators.trainer.save_path {save_path}"
    if os.path.isdir(save_path) and save_path_leftovers(save_path) is not None:
        return False
    marker = read_marker(save_path) if os.path.isdir(save_path) else None
    if marker is None:
        raise ConfigError(f"{key} exists and is not an empty folder: choose a new one (nothing in it is replaced)")
    if marker.get("finished"):
        raise ConfigError(f"{key} holds a finished run (final/): nothing to resume; choose a new folder to train "
                          "again")
    made = marker.get("config")
    if not isinstance(made, dict):  # a start that recorded no settings: nothing says what it ran
        raise ConfigError(f"{key} exists and is not an empty folder: choose a new one (nothing in it is replaced)")
    changed = sorted(k for k in set(made) | set(settings) if made.get(k) != settings.get(k))
    if changed:
        raise ConfigError(f"{key} holds another run's steps, made with other settings (changed: {', '.join(changed)}): "
                          "set them back to resume it, or choose a new folder (nothing in it is replaced)")
    return True


def read_marker(save_path: str) -> dict | None:
    """MARKER's record, or None where there is none that the trainer wrote."""
    try:
        with open(os.path.join(save_path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    start = marker.get("start") if isinstance(marker, dict) else None
    return marker if isinstance(start, list) and all(isinstance(name, str) for name in start) else None


def scheduler(settings) -> None:
    """speculators' schedule settings within what they mean (draft_loop.schedule_steps): a
    warmup ratio is a fraction of the steps, a total at least one step."""
    key = "train.speculators.scheduler"
    ratio, total, warmup = (settings.scheduler_warmup_ratio, settings.scheduler_total_steps,
                            settings.scheduler_warmup_steps)
    if ratio is not None and not 0 <= ratio <= 1:
        raise ConfigError(f"{key}.scheduler_warmup_ratio {ratio}: the share of the schedule's steps that warm up, "
                          "in [0, 1]")
    if total is not None and total < 1:
        raise ConfigError(f"{key}.scheduler_total_steps {total}: the schedule's steps, at least 1 (null: the run's)")
    if warmup is not None and warmup < 0:
        raise ConfigError(f"{key}.scheduler_warmup_steps {warmup}: at least 0 (null: from the ratio, or 1% of the "
                          "schedule's steps)")


def save_path_leftovers(save_path: str) -> list[str] | None:
    """What of an existing save_path folder a new start may remove: [] when it is empty, the
    names a start that made no step left (START_FILES, MARKER among them, metrics.jsonl
    empty); None when it holds anything else (a user's file, a checkpoint, a step's metrics)."""
    names = os.listdir(save_path)
    if not names:
        return []
    marker = read_marker(save_path)
    if marker is None:  # no marker, or not the trainer's
        return None
    started = set(marker["start"])
    if not set(names) <= {MARKER, f"{MARKER}.tmp", *RUN_FILES, *started}:
        return None
    metrics = os.path.join(save_path, "metrics.jsonl")
    if os.path.exists(metrics) and os.path.getsize(metrics):
        return None
    return names


def refuse_unhonoured(given: dict) -> None:
    """A key of speculators' config this trainer does not honour, given: refused (HONOURED)."""
    for section, value in given.items():
        for key in [f"{section}.{key}" for key in value] if isinstance(value, dict) else [section]:
            if key in INSTEAD or (key not in HONOURED and section not in HONOURED):
                why = INSTEAD.get(key) or INSTEAD.get(section) or "it trains eagle3 drafts only"
                raise ConfigError(f"train.speculators.{key}: not used by this trainer ({why}); the keys it takes: "
                                  + ", ".join(sorted(HONOURED)))


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
