"""The draft trainer (`python -m ray_jobs.train_draft`) after the loss of its driver: the same
command resumes from the run's latest intact checkpoint (Ray Train's own restore: the same
RunConfig name and storage), each step trained once across the two runs; a damaged latest
checkpoint is found before it is loaded and skipped; a save_path of other settings, or of a
finished run, is refused in one line. The run is on OUT's hidden_states/ (no engine); on the
stream, the place a checkpoint restores is the same restore a lost worker makes
(tests/cluster/test_cluster.py, the draft trainer submitted) and a new gate handed resumed
places is tests/training/test_stream_gate.py's: a stream run killed here cost the suite
~4 minutes for no path of its own. Unit tests for the checks behind them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from support import REPO, attached, ray_processes, train_settings
from eagle_data.errors import ConfigError
from eagle_data.training.checkpoints import cut_metrics, damage, intact, state_problem
from eagle_data.training.draft_trainer import RepeatedFailure


def start(config: Path, ray_local, log: Path) -> subprocess.Popen:
    """The trainer's command, as a user runs it, with a driver of its own on the session's Ray."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "ray_jobs.train_draft", "--config", str(config)], cwd=REPO,
                                env={**attached(ray_local), "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)


def registered(save: Path) -> tuple[int, str] | None:
    """(step, its pointer's folder) of the latest checkpoint Ray Train's controller registered."""
    try:
        snapshot = json.loads((save / "ray-train" / "train" / "checkpoint_manager_snapshot.json").read_text())
        latest = snapshot["latest_checkpoint_result"]
        return latest["metrics"]["step"], latest["checkpoint_dir_name"]
    except (OSError, ValueError, KeyError, TypeError):  # not written yet, or being written
        return None


def kill_the_driver_once_a_checkpoint_is_registered(job: subprocess.Popen, save: Path, log: Path, step: int) -> int:
    """SIGKILL of the driver alone once Ray Train has registered a checkpoint of step `step` or
    later; then waits until the run's workers and controller are gone (Ray ends a driver's
    actors with it). The step of Ray Train's latest checkpoint then."""
    deadline = time.monotonic() + 600
    while job.poll() is None and (registered(save) or (0,))[0] < step and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.poll() is None and registered(save)[0] >= step, log.read_text()[-3000:]
    job.kill()
    job.wait()
    deadline = time.monotonic() + 120
    while (ray_processes("RayTrainWorker") or ray_processes("TrainController")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes("RayTrainWorker") and not ray_processes("TrainController")
    return registered(save)[0]


def steps_of(save: Path) -> list[dict]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "validation" not in r]


@pytest.mark.slow
def test_a_trainer_whose_driver_is_killed_resumes_from_its_latest_intact_checkpoint(
        ray_local, hidden_out, deep_qwen3, tmp_path, capsys, own_signal_handlers):
    """train.source hidden_states, 2 workers, 8 epochs, a checkpoint every 2 steps. The driver
    SIGKILLed once Ray Train has a checkpoint: the same command was refused ("exists and is
    not an empty folder"), every step lost. Now: with another learning rate it is refused,
    naming the key; Ray Train's latest checkpoint damaged (trainer_state.pt cut short), the
    same command skips it, resumes from the newest intact one (rank 0's choice, every rank's),
    and trains each step once
    (with train.max_failures -1 Ray Train had restarted the workers without end, each failing
    `PytorchStreamReader failed reading zip archive`); once finished, the command says so."""
    from ray_jobs.train_draft import main

    save = tmp_path / "draft"
    settings = train_settings(hidden_out, deep_qwen3, save)
    settings["train"].update(source="hidden_states", workers=2, checkpoint_every=2, max_failures=-1)
    settings["train"]["speculators"]["trainer"]["epochs"] = 8
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(settings))

    job = start(config, ray_local, tmp_path / "first.log")
    # Killed once there is a checkpoint before Ray Train's latest: the one the resumed run falls back on.
    killed_at = kill_the_driver_once_a_checkpoint_is_registered(job, save, tmp_path / "first.log", 4)
    assert not (save / "final").exists()

    # Another run's settings: refused in one line naming what differs, before anything is touched.
    other = json.loads(json.dumps(settings))
    other["train"]["speculators"]["optimizer"]["lr"] = 0.02
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    before = sorted(p.name for p in save.iterdir())
    assert main(["--config", str(tmp_path / "other.yaml")]) == ConfigError.exit_code == 2
    err = capsys.readouterr().err
    # speculators' resolved config: its muon_lr follows lr
    assert err.startswith(f"error: train.speculators.trainer.save_path {save} holds another run's steps, made with "
                          "other settings (changed: train.speculators.optimizer.lr, train.speculators.optimizer.muon_lr"
                          "): set them back to resume it") and err.count("\n") == 1, err
    assert sorted(p.name for p in save.iterdir()) == before

    # The checkpoint Ray Train will hand the new workers, cut short.
    folder = Path(json.loads((save / "ray-train" / "train" / registered(save)[1] / "checkpoint.json").read_text())
                  ["path"])
    state = folder / "trainer_state.pt"
    os.truncate(state, state.stat().st_size // 2)
    resumed = start(config, ray_local, tmp_path / "second.log")
    code = resumed.wait(timeout=900)
    text = (tmp_path / "second.log").read_text()
    assert code == 0, text[-5000:]
    assert f"holds a run of these settings that did not finish" in text
    assert re.search(rf"the checkpoint {folder} is damaged \(trainer_state.pt is not a whole archive \(BadZipFile: ",
                     text), text[-5000:]
    [(step, of)] = re.findall(r"a new group of workers resumes from \S+/step-(\d+): step \d+ of (\d+)", text)
    step, total = int(step), int(of)
    print(f"killed with step-{killed_at} Ray Train's latest; step-{folder.name[5:]} damaged; resumed from step {step}")
    assert 2 <= step < int(folder.name[5:]) and step % 2 == 0
    assert [s["step"] for s in steps_of(save)] == list(range(1, total + 1))  # each step once across the two runs
    assert f"steps:       {total} of {total}" in text
    assert (save / "final" / "model.safetensors").exists() and damage(str(folder)) is None  # saved again

    assert main(["--config", str(config)]) == 2  # finished: nothing to resume
    assert capsys.readouterr().err == (f"error: train.speculators.trainer.save_path {save} holds a finished run "
                                       "(final/): nothing to resume; choose a new folder to train again\n")


def test_a_checkpoints_files_are_checked_before_it_is_loaded(tmp_path):
    """damage(): speculators' draft (draft_files.check_draft_folder: config.json an object,
    model.safetensors whole) and trainer_state.pt a whole archive; intact() skips the damaged
    ones, newest first."""
    from safetensors.torch import save_file

    def checkpoint(step: int) -> Path:
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / "config.json").write_text('{"speculators_model_type": "eagle3"}')
        save_file({"w": torch.ones(64)}, folder / "model.safetensors")
        torch.save({"step": step, "optimizers": [{"x": torch.zeros(256)}]}, folder / "trainer_state.pt")
        return folder

    folders = [checkpoint(n) for n in (2, 4, 6)]
    assert [damage(str(f)) for f in folders] == [None, None, None]
    weights, state = folders[2] / "model.safetensors", folders[2] / "trainer_state.pt"
    os.truncate(weights, weights.stat().st_size - 8)
    assert damage(str(folders[2])).startswith(f"{weights} is truncated ({weights.stat().st_size} bytes; its header "
                                              f"says {weights.stat().st_size + 8})")
    os.truncate(state, 100)
    assert state_problem(str(state)).startswith("trainer_state.pt is not a whole archive (BadZipFile: ")
    (folders[1] / "config.json").write_text("[1, 2]")
    assert damage(str(folders[1])) == f"{folders[1] / 'config.json'} holds a JSON list, not an object: not a draft's config"
    (folders[0] / "trainer_state.pt").unlink()
    assert damage(str(folders[0])) == "trainer_state.pt is missing"
    assert damage(str(tmp_path / "step-8")) == "it is missing"
    assert intact(str(folders[2]), str(tmp_path)) is None  # all three damaged: from step 0
    checkpoint(3)
    assert intact(str(folders[2]), str(tmp_path)) == str(tmp_path / "step-3")  # the newest intact before it


def test_metrics_are_cut_back_to_the_step_without_a_line_a_kill_cut_short(tmp_path):
    lines = [{"step": 1, "loss": 1.0}, {"validation": {"loss": 1.0}, "step": 2}, {"step": 2}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    cut_metrics(str(tmp_path), 2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in lines[:3]]


def test_ray_train_stops_retrying_a_failure_that_repeats_with_no_checkpoint_between():
    """The controller's callback: the lowest rank's error twice alike with no checkpoint
    reported between them is the run's error; a lost worker (its error names it) or a
    checkpoint between two failures lets Ray Train go on retrying."""
    from eagle_data.errors import EagleDataError, user_error

    def worker_error(text: str) -> Exception:  # as Ray Train hands it over: the worker's traceback as text
        return RuntimeError(f"Traceback (most recent call last):\n  File \"x.py\"\n{text}")

    callback = RepeatedFailure()
    zip_error = "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory"
    callback.after_exception(None, {1: worker_error(zip_error), 0: worker_error(zip_error)})
    callback.after_report(None, [{"step": 4}], checkpoint=object())  # progress: retried again
    callback.after_exception(None, {0: worker_error(zip_error)})
    callback.after_exception(None, {0: worker_error("ActorDiedError: worker 1a2b died")})
    callback.after_exception(None, {0: worker_error("ActorDiedError: worker 3c4d died")})
    callback.after_exception(None, {0: worker_error(zip_error)})
    with pytest.raises(EagleDataError) as stopped:
        callback.after_exception(None, {0: worker_error(zip_error), 1: worker_error("gloo: connection reset")})
    assert str(stopped.value) == ("train: the workers failed twice in a row the same way, from the same checkpoint, "
                                  "so Ray Train does not start them again (train.max_failures): rank 0: " + zip_error)
    assert user_error(stopped.value) is stopped.value


@pytest.mark.slow
def test_ray_train_with_the_callback_gives_up_on_the_second_identical_failure(ray_local, tmp_path):
    """On Ray Train itself (its controller calls the callback), train.max_failures -1: a
    worker that fails the same way at every start was started again without end; now the
    second identical failure is the run's error, the project's one line."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from eagle_data.training.draft_trainer import failure, in_a_thread

    def loop(config):
        raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")

    trainer = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"memory": 1}),
                           run_config=RunConfig(storage_path=str(tmp_path), name="repeats",
                                                failure_config=FailureConfig(max_failures=-1),
                                                callbacks=[RepeatedFailure()]))
    with pytest.raises(Exception) as raised:
        in_a_thread(trainer.fit)
    assert str(failure(raised.value)) == (
        "train: the workers failed twice in a row the same way, from the same checkpoint, so Ray Train does not start "
        "them again (train.max_failures): rank 0: PytorchStreamReader failed reading zip archive: failed finding "
        "central directory")
