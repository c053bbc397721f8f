"""The hidden-states hand-over on the engine's node (job/stages/engines/state_files.py): the
connector's file read back once it is whole, then removed; a killed run's scratch cleaned,
and nothing else."""

from __future__ import annotations

import fcntl
import os
import threading

import pyarrow as pa
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save, save_file

from eagle_data.errors import NotWritable
from eagle_data.job.stages.engines.state_files import (STATE_COLUMNS, clean_earlier_runs, prepare, scratch_folder,
                                                       take, with_state_columns)


def test_take_waits_for_the_writers_lock_then_hands_the_bytes_on_and_removes_the_file(tmp_path, monkeypatch):
    path = str(tmp_path / "run" / "s-1.safetensors")
    os.makedirs(os.path.dirname(path))
    hidden = torch.randn(5, 3, 8)
    whole = save({"hidden_states": hidden, "token_ids": torch.arange(5)})
    with open(path, "wb") as f:
        f.write(whole[:len(whole) // 2])  # the connector's write under way: half the file
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the connector holds it until the file is whole

    # The writer finishes only once take() asks for the lock: take() has met the half file
    # and must wait, whatever the threads' timing.
    flock, asked, events = fcntl.flock, threading.Event(), []

    def watched_flock(fd, operation):
        if fd != lock:
            asked.set()
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", watched_flock)

    def write_once_asked():
        events.append("asked" if asked.wait(30) else "never asked")
        with open(path, "wb") as f:
            f.write(whole)
        events.append("written")
        os.close(lock)

    writer = threading.Thread(target=write_once_asked)
    writer.start()
    handed = take(path, "float32")
    events.append("taken")
    writer.join()
    assert events == ["asked", "written", "taken"]
    assert handed["hidden_states"] == hidden.numpy().tobytes()
    assert handed["hidden_states_shape"] == [5, 3, 8] and handed["hidden_token_ids"] == [0, 1, 2, 3, 4]
    assert os.listdir(tmp_path / "run") == []


def test_take_converts_to_the_phase_dtype_and_removes_a_file_it_cannot_read(tmp_path):
    path = str(tmp_path / "a.safetensors")
    save_file({"hidden_states": torch.ones(2, 1, 4, dtype=torch.float32), "token_ids": torch.arange(2)}, path)
    assert take(path, "bfloat16")["hidden_states"] == torch.ones(2, 1, 4, dtype=torch.bfloat16).view(
        torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(b"not safetensors")
    with pytest.raises(SafetensorError, match="(?i)header"):
        take(path, "float32")
    assert not os.path.exists(path)


def test_a_later_run_removes_only_this_outs_earlier_run_folders(tmp_path):
    current = scratch_folder(str(tmp_path), "out1", "20261202T101010-aaaaaa")
    assert current == f"{tmp_path}/eagle-data-out1/20261202T101010-aaaaaa"
    ours = tmp_path / "eagle-data-out1"
    for name in ("20261201T090909-bbbbbb", "20261202T101010-aaaaaa"):
        (ours / name).mkdir(parents=True)
        (ours / name / "s.safetensors").write_bytes(b"x")
    (ours / "keep-me").mkdir()  # not named like a run
    (ours / "20261201T090909-cccccc").write_text("a file, not a run's folder")
    (tmp_path / "eagle-data-out2" / "20261201T090909-dddddd").mkdir(parents=True)  # another OUT's
    removed = clean_earlier_runs(current)
    assert removed == [str(ours / "20261201T090909-bbbbbb")]
    assert sorted(p.name for p in ours.iterdir()) == ["20261201T090909-cccccc", "20261202T101010-aaaaaa", "keep-me"]
    assert (ours / "20261202T101010-aaaaaa" / "s.safetensors").exists()
    assert (tmp_path / "eagle-data-out2" / "20261201T090909-dddddd").is_dir()
    assert clean_earlier_runs(str(tmp_path / "nowhere" / "20261202T101010-aaaaaa")) == []


def test_the_hand_over_columns_have_one_type_whether_or_not_rows_failed():
    failed = with_state_columns(pa.table({"sample_id": ["a"]}))
    ok = with_state_columns(pa.table({"sample_id": ["b"], "hidden_states": [b"\x00" * 8],
                                      "hidden_states_shape": [[1, 1, 2]], "hidden_token_ids": [[7]]}))
    assert failed.schema == ok.schema and failed.column("hidden_states").null_count == 1
    assert {name: ok.schema.field(name).type for name in STATE_COLUMNS} == STATE_COLUMNS
    assert pa.concat_tables([failed, ok]).num_rows == 2


def test_a_scratch_folder_that_cannot_be_made_is_one_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(NotWritable, match="hidden_states.scratch_dir: cannot make .*a-file/eagle-data-o/r"):
        prepare(str(tmp_path / "a-file" / "eagle-data-o" / "r"))
    prepare(str(tmp_path / "eagle-data-o" / "20261202T101010-aaaaaa"))
    assert (tmp_path / "eagle-data-o" / "20261202T101010-aaaaaa").is_dir()
