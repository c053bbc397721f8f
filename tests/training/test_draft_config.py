"""The draft trainer's settings (eagle_data/training/draft_config.py): `train.speculators` is
speculators' own TrainConfig, which ignores unknown keys; the job refuses what would train
with a silent default, in the wrong place, or on other features than the stream's."""

from __future__ import annotations

import pytest

from support import job_config
from eagle_data.errors import ConfigError
from eagle_data.training.draft_config import speculators_config


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
     "train.speculators: data.hidden_states_dtype: Value error, hidden_states_dtype float16 is not supported"),
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
