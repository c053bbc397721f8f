"""The draft trainer (`python -m ray_jobs.train_draft`) under bad input, a missing resource,
a worker's error and stop signals: one `error:` line naming the key, path or file and exit 2
(130/143 for a signal), nothing left running, what it wrote reusable by the same command."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from support import REPO, as_config, ray_processes_of, read, train_settings
from eagle_data.errors import (DamagedModel, DraftStartFailed, NoTrainingResources, NotWritable, Stopped,
                               stop_on_signals)
from eagle_data.storage.selection import held_out
from eagle_data.training.draft_config import MARKER
from eagle_data.training.draft_trainer import draft_vocabulary, failure, in_a_thread, wait_for_worker_resources


def train_draft(settings: dict, tmp_path: Path, *overrides: str, capsys) -> tuple[int, str]:
    """The entry point in this process (what fails before Ray starts): its exit code and stderr."""
    from ray_jobs.train_draft import main

    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(settings))
    code = main(["--config", str(config), *(a for o in overrides for a in ("--set", o))])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("where", ["/proc/eagle-data-draft", "/sys/eagle-data-draft", "under-a-file"])
def test_a_save_path_that_cannot_be_made_is_one_line_naming_it(deep_qwen3, tmp_path, capsys, own_signal_handlers,
                                                               where):
    """/sys/x and /proc/x were a PermissionError / FileNotFoundError traceback from os.makedirs."""
    if where == "under-a-file":
        (tmp_path / "file").write_text("a user's file")
        where = str(tmp_path / "file" / "draft")
    code, err = train_draft(train_settings(tmp_path / "out", deep_qwen3, Path(where)), tmp_path, capsys=capsys)
    assert code == NotWritable.exit_code == 2
    assert err.startswith(f"error: train.speculators.trainer.save_path {where} cannot be written (")
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_truncated_target_is_named_before_ray_starts_and_the_command_then_runs_again(
        deep_qwen3, tmp_path, capsys, own_signal_handlers):
    """It failed in the workers, a WorkerGroupError traceback, exit 1, and left speculators'
    run files in save_path, so the same command was then refused."""
    broken = shutil.copytree(deep_qwen3, tmp_path / "broken")
    os.truncate(broken / "model.safetensors", (broken / "model.safetensors").stat().st_size - 1000)
    settings = train_settings(tmp_path / "out", broken, tmp_path / "draft")
    for _ in range(2):  # the same command again: not refused for what the first one left
        code, err = train_draft(settings, tmp_path, capsys=capsys)
        assert code == DamagedModel.exit_code == 2
        assert err == f"error: model.path '{broken}': model.safetensors is truncated " \
                      f"({(broken / 'model.safetensors').stat().st_size} bytes; its header says " \
                      f"{(deep_qwen3 / 'model.safetensors').stat().st_size}); download or convert the model again\n"
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == [MARKER]


def test_a_split_that_holds_out_nothing_while_validation_is_asked_is_refused(deep_qwen3, tmp_path, capsys, caplog,
                                                                             own_signal_handlers):
    """data.train_data_ratio 0.999 on 12 rows holds out none of them (a seeded hash per
    prompt): the run trained without validation, silently. Now refused before Ray starts,
    one line naming the key and the counts; with a ratio that holds rows out, the log says
    how many each side got; 1.0 asks for no validation and is not refused."""
    import logging

    from support import synthetic_row, write_out
    from eagle_data.errors import ConfigError

    out = write_out(tmp_path / "out", [synthetic_row(i, 3, 1, 4, "stop", "a") for i in range(12)], rows_per_shard=4)
    settings = train_settings(out, deep_qwen3, tmp_path / "draft", data={"train_data_ratio": 0.999})
    code, err = train_draft(settings, tmp_path, capsys=capsys)
    assert code == ConfigError.exit_code == 2
    assert err == ("error: train.speculators.data.train_data_ratio 0.999 holds out no row of the 12 selected (prompts "
                   "are held out whole, by a seeded hash of their prompt_id): lower it to validate, or set it to 1 to "
                   "train without validation\n")
    from eagle_data.feature_shape import feature_shape
    from eagle_data.training.draft_config import speculators_config
    from eagle_data.training.draft_trainer import Plan

    for ratio, held in ((0.5, 6), (1.0, 0)):  # 6 of 12 on seed 42's hash
        cfg = as_config({**settings, "train": {**settings["train"], "speculators": {
            **settings["train"]["speculators"], "data": {"train_data_ratio": ratio},
            "trainer": {"save_path": str(tmp_path / f"draft-{ratio}")}}}})
        shape = feature_shape(cfg)
        with caplog.at_level(logging.INFO, logger="eagle_data"):
            plan = Plan.of(cfg, speculators_config(cfg, shape), shape)
        assert (plan.train_rows, plan.validation_rows) == (12 - held, held)
        assert f"train: data.train_data_ratio {ratio:g}: {12 - held} rows to train on, {held} held out for " \
               "validation" in caplog.messages


def test_draft_vocab_size_null_is_the_targets_whole_vocabulary_and_more_is_clamped(deep_qwen3, tmp_path):
    """null trained with 32,000 (an `or 32_000`); speculators' own null is the verifier's
    whole vocabulary, without a mapping."""
    from support import job_config
    from eagle_data.feature_shape import feature_shape
    from eagle_data.training.draft_config import speculators_config

    cfg = job_config(tmp_path / "out", deep_qwen3)
    vocab = json.loads((deep_qwen3 / "config.json").read_text())["vocab_size"]
    for asked in (None, vocab + 1000):
        speculators = {"trainer": {"save_path": str(tmp_path / "d")}, "draft": {"draft_vocab_size": asked}}
        spec = speculators_config(cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"speculators": speculators})}))
        assert draft_vocabulary(cfg, spec, feature_shape(cfg)) == (None, None, vocab)
        assert spec.draft.draft_vocab_size == vocab


def test_a_training_start_reads_the_targets_config_and_outs_index_once(ray_local, deep_qwen3, tmp_path, monkeypatch):
    """The driver's start, from the config to what the workers are given (the target's shape,
    speculators' config, the vocabulary, the split, the stream's datasets, the loop's config):
    the target's config.json was read 4 times (once in speculators_config, once per stream,
    once for the loop's hidden size) and OUT's shard list and index 4 times (each side of the
    split, then again per stream); now once each (one index per side)."""
    import builtins

    from support import as_config, job_settings, synthetic_row, write_out
    from eagle_data.feature_shape import feature_shape
    from eagle_data.reader.samples import OutReader, Samples
    from eagle_data.training.draft_config import speculators_config
    from eagle_data.training.draft_trainer import Plan, loop_config, stream_datasets

    out = write_out(tmp_path / "out", [synthetic_row(i, 3, 1, 4, "stop", "a") for i in range(12)], rows_per_shard=4)
    settings = job_settings(out, deep_qwen3, hidden_states__dtype="float32")
    settings["train"] = {"workers": 2, "device": "cpu", "speculators": {"trainer": {"save_path": str(tmp_path / "d")},
                                                                         "data": {"train_data_ratio": 1.0}}}
    cfg = as_config(settings)
    counts = {"config.json": 0, "OutReader": 0, "index": 0}
    opened = builtins.open

    def counting_open(file, *args, **kwargs):
        counts["config.json"] += str(file) == str(deep_qwen3 / "config.json")
        return opened(file, *args, **kwargs)

    def counted(key, method):
        def call(self, *args, **kwargs):
            counts[key] += 1
            return method(self, *args, **kwargs)
        return call

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(OutReader, "__init__", counted("OutReader", OutReader.__init__))
    monkeypatch.setattr(Samples, "_build_index", counted("index", Samples._build_index))
    shape = feature_shape(cfg)
    spec = speculators_config(cfg, shape)
    d2t, t2d, vocab = draft_vocabulary(cfg, spec, shape)
    plan = Plan.of(cfg, spec, shape)
    datasets = stream_datasets(cfg, plan)
    try:
        config = loop_config(cfg, spec, d2t, t2d, plan)
    finally:
        ray_local.kill(ray_local.get_actor(plan.gate))
    assert counts == {"config.json": 1, "OutReader": 1, "index": 2}  # the train side's and the held-out side's
    assert set(datasets) == {"train"} and config["hidden_size"] == shape.hidden_size
    assert vocab == json.loads((deep_qwen3 / "config.json").read_text())["vocab_size"]


def test_workers_the_cluster_cannot_hold_fail_with_a_message_after_the_wait(ray_local, deep_qwen3, tmp_path):
    """`train.device=gpu` on a machine without a GPU: Ray Train said "worker group startup
    timed out after 60 s" again and again, without end."""
    from support import job_config

    cfg = job_config(tmp_path / "out", deep_qwen3, train__device="gpu", train__cpus_per_worker=0, train__resource_wait_s=1)
    started = time.monotonic()
    with pytest.raises(NoTrainingResources, match=r"train.workers=1 with train.device=gpu need \{'GPU': 1\} each, "
                                                  r"and after waiting 1s \(train.resource_wait_s\) the cluster has "
                                                  r"room for 0: there is no GPU in the cluster; set train.device=cpu"):
        wait_for_worker_resources(cfg)
    assert time.monotonic() - started < 30
    cpus = job_config(tmp_path / "out", deep_qwen3, train__device="cpu", train__cpus_per_worker=2, train__workers=2,
                      train__resource_wait_s=0)
    with pytest.raises(NoTrainingResources, match=r"room for 1: lower train.workers"):
        wait_for_worker_resources(cpus)  # the session's instance has 2 CPUs: room for one such worker
    one = cpus.model_copy(update={"train": cpus.train.model_copy(update={"workers": 1})})
    wait_for_worker_resources(one)
    # The Kimi config's workers go to trainer nodes (train.worker_resources), which a cluster not
    # made by cluster.yaml lacks: the wait left them out and passed, leaving them to Ray Train.
    on_trainer_nodes = one.model_copy(update={"train": one.train.model_copy(update={"worker_resources": {"eagle_trainer": 1}})})
    with pytest.raises(NoTrainingResources, match=r"need \{'CPU': 2.0, 'eagle_trainer': 1\} each, .* room for 0: no node "
                                                  r"declares 'eagle_trainer' \(train.worker_resources\)"):
        wait_for_worker_resources(on_trainer_nodes)


def test_a_project_error_raised_in_a_worker_is_the_runs_error(ray_local):
    """A worker's own error came out as Ray Train's WorkerGroupError traceback, exit 1."""
    from ray.train import WorkerGroupError

    @ray_local.remote(num_cpus=0)
    def build():
        raise DraftStartFailed("the draft could not be built on its verifier, model.path /m (KeyError: 'x')")

    try:
        ray_local.get(build.remote())
    except Exception as e:
        raised = e  # Ray's RayTaskError wrapping the worker's DraftStartFailed
    group = WorkerGroupError("rank 1 failed", {1: raised, 0: RuntimeError("a rank lost with it")})
    assert type(failure(group)) is DraftStartFailed
    assert str(failure(group)) == "the draft could not be built on its verifier, model.path /m (KeyError: 'x')"
    bug = WorkerGroupError("rank 0 failed", {0: ZeroDivisionError("a bug")})
    assert failure(bug) is bug  # not the project's: as it is, with its traceback


def test_a_stop_signal_reaches_the_job_while_fit_runs_in_its_thread(own_signal_handlers):
    """In the main thread Ray Train's fit() puts a SIGINT handler of its own in place of the
    project's (it only asks the run to stop, then exits 1 without a word): fit runs in a
    thread of its own, where it installs none, and the main thread stops on the signal."""
    def fit():  # as Ray Train's: its handler only where it runs in the main thread
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, lambda *a: None)
        time.sleep(30)

    stop_on_signals()
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    with pytest.raises(Stopped) as stopped:
        in_a_thread(fit)
    assert stopped.value.signum == signal.SIGINT and time.monotonic() - started < 10
    assert in_a_thread(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        in_a_thread(lambda: 1 / 0)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_trainer_stopped_mid_training_exits_128_plus_the_signal_and_leaves_no_ray(hidden_out, deep_qwen3, tmp_path,
                                                                                   signum):
    """The trainer on its own local Ray instance (beside the session's: another instance on
    the machine), stopped once it has made two steps. SIGTERM exited 130 "stopped by
    SIGINT"; Ctrl-C was Ray Train's "Gracefully aborting...", exit 1, no `error:` line; and
    every run printed Ray Train's PlacementGroupCleaner traceback ("Found multiple active
    Ray instances"). Now: 128 + the signal, one line naming it, no traceback, the steps made
    kept, and no process of its Ray instance alive after it."""
    save = tmp_path / "draft"
    config = tmp_path / "train.yaml"
    settings = train_settings(hidden_out, deep_qwen3, save)
    settings["train"]["source"] = "hidden_states"  # no engine: the stop is the driver's, whatever feeds the workers
    config.write_text(yaml.safe_dump(settings))
    ray_tmpdir = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"ray-td-{os.getpid()}-{signum}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=ray_tmpdir)
    log = tmp_path / "log.txt"
    try:
        with open(log, "w") as out:
            # A process group of its own (Ctrl-C reaches it whole), in the tests' session (tests/smokes.py)
            job = subprocess.Popen([sys.executable, "-m", "ray_jobs.train_draft", "--config", str(config)], cwd=REPO,
                                   env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
            deadline = time.monotonic() + 300
            while job.poll() is None and time.monotonic() < deadline:
                if (save / "metrics.jsonl").exists() and len((save / "metrics.jsonl").read_text().splitlines()) >= 2:
                    break
                time.sleep(0.2)
            assert job.poll() is None, log.read_text()[-3000:]
            # SIGTERM as `kill` sends it; Ctrl-C as a terminal does, to the whole process group
            os.kill(job.pid, signum) if signum == signal.SIGTERM else os.killpg(job.pid, signum)
            code = job.wait(timeout=120)
        text = log.read_text()
        assert code == 128 + signum, text[-3000:]
        assert text.splitlines()[-1] == f"error: stopped by {signal.Signals(signum).name}"
        assert not tracebacks_but_rays_overload_warnings(text), text
        lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        steps = [s["step"] for s in lines if "validation" not in s]  # (an epoch's validation: its last step's)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
        deadline = time.monotonic() + 30
        while ray_processes_of(ray_tmpdir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray_processes_of(ray_tmpdir) == []
    finally:
        for p in ray_processes_of(ray_tmpdir):
            p.kill()
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def tracebacks_but_rays_overload_warnings(log: str) -> int:
    """The tracebacks in a job's log, but those of Ray Train's warning that a resource request
    to its autoscaling coordinator timed out, which it says is "safe to ignore" where it is
    transient on an overloaded machine (its logger prints the traceback right after the
    message): beside the suite's load it was printed once, Ray's and not the stop's."""
    lines = log.splitlines()
    return sum(line.rstrip().endswith("Traceback (most recent call last):")
               and not (i and re.search(r"Failed to (send|cancel) resource request for", lines[i - 1]))
               for i, line in enumerate(lines))


def test_only_rays_overload_warning_tracebacks_are_left_out():
    ray_warning = ("(TrainController pid=7) Failed to send resource request for abc. If this only happens "
                   "transiently during network partition or CPU being overloaded, it's safe to ignore this error.\n"
                   "(TrainController pid=7) Traceback (most recent call last):\n(TrainController pid=7) ...\n")
    ours = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: x\n"
    assert tracebacks_but_rays_overload_warnings(ray_warning) == 0
    assert tracebacks_but_rays_overload_warnings(ours) == 1
    assert tracebacks_but_rays_overload_warnings(ray_warning + ours + ray_warning) == 1


def offline_config(out, seed: int = 0, batch_size: int = 2) -> dict:
    """draft_loop's config for train.source: hidden_states, as draft_trainer.fit makes it
    (what the reading of rows needs)."""
    from eagle_data.training.draft_trainer import split_samples

    samples = split_samples(str(out), (0.3, seed), {"finish_reason": None, "source": None, "max_len": None}, True)
    return {"source": "hidden_states", "epochs": 2, "batch_size": batch_size, "samples": samples}


@pytest.mark.slow
def test_the_offline_rows_are_the_readers_split_and_order_the_same_for_a_seed(hidden_out, monkeypatch):
    """train.source: hidden_states: each worker's batches are its rank's slice of the
    reader's (seed, epoch) order of the train side, every epoch; the held-out rows never
    among them; each held-out row on one worker only; the same seed the same rows in the
    same order, another seed another order; resumed at step N, the batches from the N-th on.
    The split is read once (hidden_states/'s headers once for both sides), and the workers
    take their shares of it without reading OUT again (it was once per side on the driver,
    and again per side in every worker)."""
    from eagle_data.reader import Samples
    from eagle_data.storage.hidden_states import Index
    from eagle_data.training.draft_loop import train_items, validation_items

    reads = []
    monkeypatch.setattr(Index, "read", classmethod(lambda cls, *a, _read=Index.read: reads.append(a) or _read(*a)))
    config = offline_config(hidden_out)
    list(train_items(config, 1, 2)), list(validation_items(config, 1, 2))
    assert len(reads) == 1

    def ids(items) -> list[tuple]:
        return [tuple(item[0].tolist()) for item in items]

    world = 2
    runs = {seed: [[(ids(items), epochs) for items, epochs, _ in train_items(offline_config(hidden_out, seed), rank,
                                                                              world)]
                   for rank in range(world)] for seed in (0, 0, 1)}
    data = {tuple(r["input_ids"]): r for r in read(hidden_out, "data")}
    validation = {s for s, r in data.items() if held_out([r["prompt_id"]], 0.3, 0)[0]}
    assert validation and len(validation) < len(data)
    for rank in range(world):
        expected = Samples(str(hidden_out), holdout=("train", 0.3, 0), rank=rank, world_size=world, seed=0)
        for epoch in range(2):
            expected.set_epoch(epoch)
            got = [row for batch, epochs in runs[0][rank] if epochs == [epoch] for row in batch]
            assert got == [tuple(expected.sample(int(p))["input_ids"].tolist()) for p in expected.order]
            assert not set(got) & validation
    assert runs[0] == [[(ids(items), epochs) for items, epochs, _ in train_items(offline_config(hidden_out, 0), rank,
                                                                                 world)] for rank in range(world)]
    assert runs[1] != runs[0]
    # Resumed at a checkpoint's step: each rank's batches from that one on, across the epochs' turn.
    for start in (1, len(runs[0][0]) // 2 + 1):
        assert [[(ids(items), epochs) for items, epochs, _ in train_items(offline_config(hidden_out, 0), rank, world,
                                                                          start)]
                for rank in range(world)] == [batches[start:] for batches in runs[0]]
    held = [row for rank in range(world) for batch in validation_items(offline_config(hidden_out), rank, world)
            for row in ids(batch)]
    assert sorted(held) == sorted(validation)  # each once, across the workers


@pytest.mark.slow
def test_a_draft_from_the_datasets_own_answers_hidden_states_follows_the_schedule_and_is_validated_each_epoch(
        trained_draft, dataset_answers_out):
    """`train.source: hidden_states` (no engine: OUT's features) on an OUT of a dataset's own
    answers (prompt.answers=dataset: the baseline's rows, which the trainer takes like any),
    2 workers, 3 epochs, half the prompts held out (the `trained_draft` run): speculators'
    linear schedule (1% warmup, here 0 steps) over the run's steps, one validation after
    each epoch's steps with speculators' full_acc_k, the draft saved, and a checkpoint every
    2 steps reported to Ray Train."""
    save, done = trained_draft
    data = read(dataset_answers_out[0], "data")
    train_rows = sum(not held_out([r["prompt_id"]], 0.5, 0)[0] for r in data)
    assert 0 < train_rows < len(data)  # both sides have rows (7 rows, seed 0)
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "validation" not in r]
    validations = [r for r in records if "validation" in r]
    total = 3 * math.ceil(math.ceil(train_rows / 2) / 2)  # 3 epochs x each worker's rows, 2 a step
    assert [s["step"] for s in steps] == list(range(1, total + 1))
    assert [s["lr"] for s in steps] == pytest.approx([0.01 * (total - k) / total for k in range(total)])
    assert [(v["epoch"], v["step"]) for v in validations] == [(e, round(total * (e + 1) / 3)) for e in range(3)]
    for v in validations:
        assert {"loss", "full_acc_0", "full_acc_1", "full_acc_2"} <= set(v["validation"])
        assert all(math.isfinite(x) for x in v["validation"].values())
    assert f"validation:  {len(data) - train_rows} rows held out" in done.stdout
    assert (save / "final" / "model.safetensors").exists()
    # Every 2 steps a checkpoint: speculators' draft and the trainer's state, reported to Ray Train.
    saved = sorted(int(p.name[5:]) for p in save.glob("step-*"))
    assert saved == list(range(2, total + 1, 2))
    state = torch.load(save / f"step-{saved[-1]}" / "trainer_state.pt", weights_only=False)
    assert state["step"] == saved[-1] and state["consumed"] is None  # hidden_states/: the step is the place
    assert state["schedulers"][0]["last_epoch"] == saved[-1] and state["optimizers"][0]["state"]
    reported = [json.loads(p.read_text()) for p in (save / "ray-train" / "train").glob("checkpoint_*/checkpoint.json")]
    assert sorted(r["step"] for r in reported) == saved
    assert {r["path"] for r in reported} == {str(save / f"step-{n}") for n in saved}
