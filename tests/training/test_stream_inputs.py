"""The feature stream's refusals before any engine starts (issue 55): an OUT without data/,
filters that select nothing, a `model.path` whose config cannot be read. Synthetic OUTs
(`write_out`), no engine, no Ray work: each error comes before the stream's first actor."""

from __future__ import annotations

import shutil

import pytest

from support import job_config, synthetic_row, write_out
from eagle_data.errors import MissingInput
from eagle_data.training.stream import features


MODEL = "never-loaded"  # the stream refuses these OUTs before it reads the model's config


def synthetic_out(tmp_path, finish: str = "stop"):
    rows = [synthetic_row(i, 4, 0, 3, finish, "s") for i in range(4)]
    return write_out(tmp_path / "out", rows, rows_per_shard=2)


def test_an_out_without_data_says_data_is_missing_not_the_unset_filters(tmp_path):
    """Was: `no data/ row is selected (hidden_states.finish_reason None, source None, max_len
    None)`, blaming filters that were all unset."""
    out = synthetic_out(tmp_path)
    shutil.rmtree(out / "data")
    with pytest.raises(MissingInput) as caught:
        features(str(out), job_config(out, MODEL))
    message = str(caught.value)
    assert f"{out}/data is missing" in message and "has the generate phase run?" in message, message
    assert "None" not in message and "finish_reason" not in message, message
    (out / "data").mkdir()  # there, but empty
    with pytest.raises(MissingInput, match=f"{out}/data holds no row: .*has the generate phase run"):
        features(str(out), job_config(out, MODEL))


def test_filters_that_select_nothing_are_named_only_when_set(tmp_path):
    out = synthetic_out(tmp_path, finish="length")
    with pytest.raises(MissingInput) as caught:
        features(str(out), job_config(out, MODEL, hidden_states__finish_reason=["stop"]))
    message = str(caught.value)
    assert "no data/ row is selected by hidden_states.finish_reason ['stop']" in message, message
    assert "source" not in message and "max_len" not in message, message


def test_a_model_path_without_a_config_is_named_with_the_cause(tmp_path):
    """Was: `the hidden-states phase needs the target's config: no model config found
    (OSError)`, naming neither the key nor the path nor what went wrong."""
    out = synthetic_out(tmp_path)
    missing = tmp_path / "no-such-model"
    with pytest.raises(MissingInput) as caught:
        features(str(out), job_config(out, missing))
    message = str(caught.value)
    assert f"model.path {str(missing)!r}" in message and "does not exist" in message, message
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(MissingInput) as caught:
        features(str(out), job_config(out, empty))
    message = str(caught.value)
    # transformers' own words: the folder has no model config
    assert f"model.path {str(empty)!r}" in message and "(ValueError: Unrecognized model in" in message, message
    assert "\n" not in message
