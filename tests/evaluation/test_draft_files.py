"""A draft folder checked before anything loads it (eagle_data/draft_files.py, issue 63): a
real draft the project's trainer wrote (`trained_draft`: its final/ and step-<N>/), then
damaged copies of it, each refused with one error naming the file and what is wrong. The
acceptance job's one-line refusal of such a draft, run as a user runs it:
tests/evaluation/test_acceptance_job.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from eagle_data.draft_files import check_draft_folder
from eagle_data.errors import DamagedModel, EagleDataError, MissingInput

pytestmark = pytest.mark.slow  # the trainer's draft (a session fixture the acceptance job's tests share)


@pytest.fixture
def copy(trained_draft, tmp_path):
    def make(name: str = "final"):
        return shutil.copytree(trained_draft[0] / name, tmp_path / f"copy-{name}")
    return make


def test_the_trainers_drafts_pass_as_written(trained_draft):
    save, _ = trained_draft
    for folder in [save / "final", *sorted(save.glob("step-*"))]:
        draft = check_draft_folder(str(folder), "d")
        assert draft.config["speculators_model_type"] == "eagle3"
        assert draft.shape("t2d") and draft.shape("d2t"), sorted(draft.tensors)


def test_a_damaged_draft_is_refused_naming_its_file_and_what_is_wrong(copy, tmp_path):
    def refused(folder, error, pattern):
        with pytest.raises(error, match=pattern) as found:
            check_draft_folder(str(folder), "acceptance.drafts.mine")
        assert str(found.value).startswith("acceptance.drafts.mine: ") and "\n" not in str(found.value)
        return str(found.value)

    folder = copy()
    weights, config = folder / "model.safetensors", folder / "config.json"
    whole = weights.read_bytes()
    header_end = 8 + int.from_bytes(whole[:8], "little")

    weights.write_bytes(os.urandom(len(whole)))  # was a MemoryError: random bytes read as a header length
    refused(folder, DamagedModel, rf"{weights} is not a readable safetensors file \(a header of \d+ bytes in a file "
                                  rf"of {len(whole)}\)")
    weights.write_bytes(whole[:header_end // 2])  # was a JSONDecodeError
    refused(folder, DamagedModel, rf"{weights} is not a readable safetensors file \(a header of {header_end - 8} bytes "
                                  rf"in a file of {header_end // 2}\)")
    weights.write_bytes(whole[:8] + b"[" + whole[9:header_end])  # a header that is not JSON
    refused(folder, DamagedModel, rf"{weights} is not a readable safetensors file \(its header is not JSON")
    weights.write_bytes(whole[:len(whole) - 1000])  # was: the engine started, then 5 tracebacks
    refused(folder, DamagedModel, rf"{weights} is truncated \({len(whole) - 1000} bytes; its header says {len(whole)}\)"
                                  r"; copy or save the draft again")
    weights.write_bytes(whole[:7])
    refused(folder, DamagedModel, r"fewer than the 8 of its header's length")
    weights.unlink()
    weights.mkdir()  # was an IsADirectoryError
    refused(folder, DamagedModel, rf"{weights} is not a file")
    weights.rmdir()
    refused(folder, MissingInput, rf"{weights} is missing")
    weights.write_bytes(whole)

    text = config.read_text()
    config.write_text(json.dumps([json.loads(text)]))  # was an AttributeError: 'list' object has no attribute 'get'
    refused(folder, DamagedModel, rf"{config} holds a JSON list, not an object")
    config.write_text(text[:len(text) // 2])
    refused(folder, DamagedModel, rf"{config} is not JSON \(JSONDecodeError")
    config.write_text(json.dumps({**json.loads(text), "transformer_layer_config": [1]}))
    refused(folder, DamagedModel, r"transformer_layer_config is a JSON list, not an object")
    config.write_text(json.dumps({**json.loads(text), "speculators_model_type": "dflash"}))
    refused(folder, MissingInput, r"not a speculators EAGLE-3 draft .*'dflash'")
    config.unlink()
    config.mkdir()
    refused(folder, DamagedModel, rf"{config} is not a file")
    config.rmdir()
    refused(folder, MissingInput, r"no config.json: not a draft folder")
    refused(tmp_path / "nowhere", MissingInput, "does not exist")
    (tmp_path / "file.txt").write_text("x")
    refused(tmp_path / "file.txt", MissingInput, "is a file, not a draft folder")


def test_a_checkpoint_the_trainer_wrote_is_checked_the_same_way(copy):
    folder = copy("step-2")  # also holds trainer_state.pt, which the draft check leaves alone
    check_draft_folder(str(folder), "train")
    os.truncate(folder / "model.safetensors", 100)
    with pytest.raises(EagleDataError, match="model.safetensors is not a readable safetensors file"):
        check_draft_folder(str(folder), "train")
