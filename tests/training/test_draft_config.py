"""The draft trainer's settings (eagle_data/training/draft_config.py): `train.speculators` is
speculators' own TrainConfig, which ignores unknown keys; the job refuses what would train
with a silent default, in the wrong place, or on other features than the stream's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import job_config
from eagle_data.errors import ConfigError, NotWritable
from eagle_data.training.draft_config import MARKER, speculators_config
from eagle_data.training.draft_trainer import prepare_save_path


def config(out, model, **speculators):
    cfg = job_config(out, model)
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"speculators": speculators})})


def test_the_stream_decides_the_verifier_and_the_aux_layers(deep_qwen3, tmp_path):
    spec = speculators_config(config(tmp_path / "out", deep_qwen3, trainer={"save_path": str(tmp_path / "d")},
                                     loss={"loss_implementation": "eager"}))
    assert spec.draft.target_layer_ids == [2, 4, 5]  # EAGLE-3's [2, 4, 5, 8] for 8 layers, less the final state
    assert spec.verifier.verifier_name_or_path == str(deep_qwen3)
    assert spec.loss.loss_implementation == "eager"


@pytest.mark.parametrize("speculators, message", [
    ({"trainer": {"save_pat": "/x"}}, "train.speculators.trainer.save_pat: unknown key"),
    ({"lose": {}}, "train.speculators.lose: unknown key"),
    ({}, "train.speculators.trainer.save_path None: give an absolute folder"),
    ({"trainer": {"save_path": "drafts"}}, "train.speculators.trainer.save_path 'drafts': give an absolute folder"),
    ({"draft": {"target_layer_ids": [1, 2, 3]}}, "the stream carries aux layers [2, 4, 5]"),
    ({"speculator_type": "dflash"}, "only eagle3 trains from it"),
    ({"data": {"hidden_states_dtype": "float16"}},
     "train.speculators.data.hidden_states_dtype float16: the stream's states are hidden_states.dtype bfloat16"),
    # 0 trained with 32,000 (an `or 32_000`); null is speculators' whole vocabulary.
    ({"draft": {"draft_vocab_size": 0}}, "train.speculators.draft.draft_vocab_size 0: the draft's vocabulary"),
    ({"draft": {"draft_vocab_size": -5}}, "train.speculators.draft.draft_vocab_size -5: the draft's vocabulary"),
    # a ratio out of range was speculators' ValueError in every worker, a traceback
    ({"scheduler": {"scheduler_warmup_ratio": 1.5}}, "train.speculators.scheduler.scheduler_warmup_ratio 1.5: the share"),
    ({"scheduler": {"scheduler_total_steps": 0}}, "train.speculators.scheduler.scheduler_total_steps 0: the schedule's"),
    ({"scheduler": {"scheduler_warmup_steps": -1}}, "train.speculators.scheduler.scheduler_warmup_steps -1: at least 0"),
])
def test_refused(deep_qwen3, tmp_path, speculators, message):
    if "save_path" not in message:
        speculators = {**speculators, "trainer": {"save_path": str(tmp_path / "d"), **speculators.get("trainer", {})}}
    with pytest.raises(ConfigError) as e:
        speculators_config(config(tmp_path / "out", deep_qwen3, **speculators))
    assert message in str(e.value)


def test_a_save_path_holding_files_is_refused_and_left_alone(deep_qwen3, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("a user's file")
    with pytest.raises(ConfigError, match="exists and is not an empty folder"):
        speculators_config(config(tmp_path / "out", deep_qwen3, trainer={"save_path": str(tmp_path / "d")}))
    assert (tmp_path / "d" / "mine.txt").read_text() == "a user's file"


def test_the_states_dtype_is_the_streams_unless_set_alike(deep_qwen3, tmp_path):
    """speculators' data.hidden_states_dtype (its autocast and the packed states' dtype) and
    the stream's hidden_states.dtype were never checked against each other."""
    cfg = job_config(tmp_path / "out", deep_qwen3, hidden_states__dtype="float32")
    given = {"trainer": {"save_path": str(tmp_path / "d")}}
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"speculators": given})})
    assert speculators_config(cfg).data.hidden_states_dtype == "float32"
    cfg.train.speculators["data"] = {"hidden_states_dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="hidden_states_dtype bfloat16: the stream's states are hidden_states.dtype "
                                          "float32; leave it unset or set both alike"):
        speculators_config(cfg)


def test_a_config_without_a_train_section_is_told_so(deep_qwen3, tmp_path):
    """It was told `train.speculators.trainer.save_path None: give an absolute folder`."""
    with pytest.raises(ConfigError, match="the config has no `train:` section"):
        speculators_config(job_config(tmp_path / "out", deep_qwen3))


def started(save: Path, metrics: str = "") -> Path:
    """save_path as a start that made no step leaves it (speculators' run files, Ray Train's
    folder, metrics.jsonl), listed in the trainer's marker."""
    save.mkdir()
    for name in ("run.yaml", "train_command.txt", "speculators.patch"):
        (save / name).write_text(name)
    (save / "ray-train" / "train").mkdir(parents=True)
    (save / "metrics.jsonl").write_text(metrics)
    (save / MARKER).write_text(json.dumps({"start": ["run.yaml", "speculators.patch", "train_command.txt"]}))
    return save


def test_what_a_start_that_made_no_step_left_is_taken_over_and_nothing_else(deep_qwen3, tmp_path):
    """A failed start left speculators' run.yaml and friends, and the same command was then
    refused until the user deleted them by hand. Only what the trainer's marker says it
    wrote is taken over, and never a folder with a step done or a file of the user's."""
    save = started(tmp_path / "d")
    cfg = config(tmp_path / "out", deep_qwen3, trainer={"save_path": str(save)})
    speculators_config(cfg)  # accepted
    prepare_save_path(str(save))
    assert sorted(p.name for p in save.iterdir()) == [MARKER]
    assert json.loads((save / MARKER).read_text())["start"] == []

    refused = {"a step done": started(tmp_path / "steps", metrics='{"step": 1}\n'),
               "a user's file": started(tmp_path / "user"), "no marker": started(tmp_path / "unmarked"),
               "a checkpoint": started(tmp_path / "checkpoint")}
    (refused["a user's file"] / "notes.txt").write_text("mine")
    (refused["no marker"] / MARKER).unlink()
    (refused["a checkpoint"] / "step-2").mkdir()
    for why, folder in refused.items():
        before = sorted(p.name for p in folder.rglob("*"))
        with pytest.raises(ConfigError, match="exists and is not an empty folder"):
            speculators_config(config(tmp_path / "out", deep_qwen3, trainer={"save_path": str(folder)}))
        with pytest.raises(NotWritable, match="is not empty"):
            prepare_save_path(str(folder))
        assert sorted(p.name for p in folder.rglob("*")) == before, why


def test_a_run_of_the_same_settings_is_resumed_and_another_or_a_finished_one_refused(deep_qwen3, tmp_path):
    """The marker records the run's settings (run_settings): the same ones resume the folder as
    it is (but a checkpoint a kill cut short while it was written aside); other ones are
    refused naming the keys that differ; a finished run is refused. Nothing is touched then."""
    from eagle_data.feature_shape import feature_shape
    from eagle_data.training.draft_config import run_settings
    from eagle_data.training.draft_trainer import mark

    save = started(tmp_path / "d", metrics='{"step": 1}\n')
    (save / "step-2").mkdir()
    aside = save / f".step-4.{'0' * 32}.tmp"  # a save cut short
    aside.mkdir()
    cfg = config(tmp_path / "out", deep_qwen3, trainer={"save_path": str(save)}, seed=7)
    mark(str(save), ["run.yaml", "speculators.patch", "train_command.txt"],
         run_settings(cfg, speculators_config(config(tmp_path / "out", deep_qwen3, seed=7,
                                                     trainer={"save_path": str(tmp_path / "new")})), feature_shape(cfg)))
    spec = speculators_config(cfg)  # accepted: the same settings
    assert prepare_save_path(str(save), run_settings(cfg, spec, feature_shape(cfg))) is True
    assert not aside.exists() and (save / "step-2").is_dir() and (save / "metrics.jsonl").exists()

    before = sorted(p.name for p in save.rglob("*"))
    with pytest.raises(ConfigError) as other:
        speculators_config(config(tmp_path / "out", deep_qwen3, trainer={"save_path": str(save)}, seed=8,
                                  loss={"loss_implementation": "eager"}))
    assert str(other.value) == (f"train.speculators.trainer.save_path {save} holds another run's steps, made with other "
                                "settings (changed: train.speculators.loss.loss_implementation, train.speculators.seed): "
                                "set them back to resume it, or choose a new folder (nothing in it is replaced)")
    marker = json.loads((save / MARKER).read_text())
    mark(str(save), marker["start"], marker["config"], finished=True)
    with pytest.raises(ConfigError, match="holds a finished run \\(final/\\): nothing to resume; choose a new folder"):
        speculators_config(cfg)
    assert sorted(p.name for p in save.rglob("*")) == before


@pytest.mark.parametrize("speculators, message", [
    # Valid keys that only speculators' own trainer reads: they passed and were silently ignored.
    ({"trainer": {"checkpoint_freq": 0.5}}, "trainer.checkpoint_freq: not used by this trainer "
                                            "(train.checkpoint_every says when to save, in steps)"),
    ({"draft": {"d2t_path": "/x/d2t.npy"}}, "draft.d2t_path: not used by this trainer (the draft's vocabulary "
                                            "is counted from OUT's rows"),
    ({"data": {"data_path": "/x"}}, "data.data_path: not used by this trainer (the rows are OUT's"),
    ({"generation": {"vllm_endpoint": "http://x"}}, "generation.vllm_endpoint: not used by this trainer"),
    ({"logging": {"logger": "wandb"}}, "logging.logger: not used by this trainer"),
    ({"dflash": {"block_size": 8}}, "dflash.block_size: not used by this trainer (it trains eagle3 drafts only)"),
    ({"trainer": {"fsdp_shard": True}}, "trainer.fsdp_shard: not used by this trainer"),
])
def test_a_key_speculators_reads_but_this_trainer_does_not_is_refused(deep_qwen3, tmp_path, speculators, message):
    speculators = {**speculators, "trainer": {"save_path": str(tmp_path / "d"), **speculators.get("trainer", {})}}
    with pytest.raises(ConfigError, match="the keys it takes: data.hidden_states_dtype, ") as e:
        speculators_config(config(tmp_path / "out", deep_qwen3, **speculators))
    assert f"train.speculators.{message}" in str(e.value)


def test_the_keys_it_honours_are_taken(deep_qwen3, tmp_path):
    spec = speculators_config(config(
        tmp_path / "out", deep_qwen3, seed=3, loss={"loss_implementation": "eager", "ttt_steps": 2},
        optimizer={"optimizer": "adamw", "lr": 0.02}, draft={"draft_attn_impl": "eager", "num_layers": 1},
        scheduler={"scheduler_type": "cosine", "scheduler_warmup_steps": 2},
        data={"train_data_ratio": 0.8, "total_seq_len": 512},
        trainer={"save_path": str(tmp_path / "d"), "epochs": 2, "max_steps": 9, "log_freq": 2,
                 "gradient_checkpointing": True}))
    assert (spec.seed, spec.loss.ttt_steps, spec.optimizer.lr, spec.scheduler.scheduler_type,
            spec.scheduler.scheduler_warmup_steps, spec.data.train_data_ratio, spec.trainer.log_freq,
            spec.trainer.gradient_checkpointing) == (3, 2, 0.02, "cosine", 2, 0.8, 2, True)


@pytest.mark.parametrize("warmup_steps, warmup_ratio, total_steps, max_steps", [
    (None, None, None, None), (5, None, None, None), (None, 0.25, None, None), (3, 0.5, None, None),
    (None, None, 40, None), (None, 0.1, 40, None), (None, None, None, 7), (2, None, 40, 7)])
def test_the_schedules_steps_mean_what_speculators_settings_say(warmup_steps, warmup_ratio, total_steps, max_steps):
    """draft_loop.schedule_steps resolves speculators' `scheduler.*` settings itself (speculators'
    own resolver is private): the same (warmup, total) as speculators' trainer for a run of 250
    steps (50 a loader epoch, 5 epochs; max_steps, where set, cuts the run to it). This fails
    when speculators changes what its settings mean."""
    import warnings
    from argparse import Namespace

    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps

    from eagle_data.training.draft_loop import schedule_steps

    run_steps = max_steps or 250  # the trainer's plan: the epochs' steps, max_steps where it is fewer
    args = Namespace(scheduler_warmup_steps=warmup_steps, scheduler_warmup_ratio=warmup_ratio,
                     scheduler_total_steps=total_steps)
    settings = TrainerConfig(lr=1e-4, num_epochs=5, save_path="/x", max_steps=max_steps,
                             scheduler_warmup_steps=warmup_steps, scheduler_warmup_ratio=warmup_ratio,
                             scheduler_total_steps=total_steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # speculators' "both set" warning
        assert schedule_steps(args, run_steps) == _resolve_scheduler_steps(settings, 50)
