"""A stopped job (`ray job stop`, `kill`: SIGTERM; Ctrl-C: SIGINT) exits with 128 + the
signal's number and one line, keeps what it published, and leaves none of the Ray
processes it started behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from support import REPO, job_settings, ray_processes_of, shards
from eagle_data.tools.verify import verify


@pytest.fixture
def ray_tmpdir():
    # Short, under /tmp: Ray's socket paths inside it must fit in 107 bytes.
    path = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    yield path
    for p in ray_processes_of(path):  # whatever the test found left, so it leaks nothing
        p.kill()
    shutil.rmtree(path, ignore_errors=True)


def ctrl_c(job: subprocess.Popen) -> None:
    """Ctrl-C, then again every 0.3 s until the job is gone (so some land while Ray shuts
    down); the terminal sends SIGINT to the whole foreground process group."""
    deadline = time.monotonic() + 60
    while job.poll() is None and time.monotonic() < deadline:
        try:
            os.killpg(job.pid, signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.3)


@pytest.mark.slow
def test_a_job_stopped_by_ctrl_c_exits_130_with_one_line_and_leaves_no_ray(tmp_path, tiny_qwen3, ray_tmpdir):
    """The job starts its own local Ray instance (no RAY_ADDRESS) and is stopped by Ctrl-C,
    again and again, once it has published a data shard: rc 130, one `error:` line and no
    traceback nor C++ stack, the published data valid, and no process of its Ray instance
    alive a few seconds later (two Ctrl-Cs cut ray.shutdown short and left the dashboard and
    runtime-env agents running); the manifest's run says it was stopped, and by SIGINT.
    SIGTERM (`kill`, `ray job stop`) takes the same path in the job (errors.stop_on_signals):
    its whole-job runs are the vLLM one below (its own Ray instance, stopped while the model
    loads), tests/cluster's `ray job stop` and resume, and the acceptance job's
    (tests/evaluation/test_acceptance_job.py); tests/base/test_errors_module.py checks both
    signals' exit codes and lines."""
    signum = signal.SIGINT
    out = tmp_path / "out"
    config = tmp_path / "job.yaml"
    # One row per engine batch and shard, so that the stop lands between shards.
    config.write_text(yaml.safe_dump(job_settings(out, tiny_qwen3, engine__batch_size=1, output__rows_per_shard=1,
                                                  sampling__max_tokens=32, source__sample=8)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=ray_tmpdir)
    log = tmp_path / "stderr.txt"  # a file, not a pipe: nothing reads it while the job runs
    with open(log, "w") as stderr_file:
        # A process group of its own (Ctrl-C reaches it whole), in the tests' session (tests/smokes.py)
        job = subprocess.Popen([sys.executable, "-m", "ray_jobs.generate", "--config", str(config)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=stderr_file, process_group=0)
    try:
        deadline = time.monotonic() + 180
        while not shards(out, "data") and job.poll() is None:
            assert time.monotonic() < deadline, "no data shard"
            time.sleep(0.05)
        assert job.poll() is None, "the job finished before it could be stopped"
        stopped = time.monotonic()
        ctrl_c(job)
        job.wait(timeout=60)
        print(f"\n{signal.Signals(signum).name}: the job exited {time.monotonic() - stopped:.1f} s after the signal")
    finally:
        if job.poll() is None:
            job.kill()
    stderr = log.read_text()
    name = signal.Signals(signum).name
    assert job.returncode == 128 + signum, (job.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and "Aborted" not in stderr and "SIGTERM received" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == [stderr.strip().splitlines()[-1]] and errors[0].startswith(f"error: stopped by {name}"), errors
    assert "run the same command to resume" in errors[0]
    problems, counts = verify(str(out))
    assert problems == [] and counts["ok"] >= 1, problems
    record = json.loads((out / "manifest.json").read_text())["phases"]["generate"]
    assert (record["status"], record["runs"][-1]["status"], record["runs"][-1]["stopped_by"]) == ("stopped", "stopped",
                                                                                                   name), record
    deadline = time.monotonic() + 10
    while ray_processes_of(ray_tmpdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [" ".join(p.cmdline()[:1]) or p.pid for p in ray_processes_of(ray_tmpdir)]
    assert left == [], left


# vLLM's CPU build, as tests/vllm's: fp32, one engine thread, small KV cache.
VLLM = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
            engine__cpu_threads=1, engine__resource_wait_s=30,
            engine__engine_kwargs={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8})


def wait_for_process(ray_tmpdir: str, title: str, job: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until a process of the job's Ray instance has `title` in its command line."""
    deadline = time.monotonic() + timeout_s
    while job.poll() is None and time.monotonic() < deadline:
        for p in ray_processes_of(ray_tmpdir):
            try:
                if title in " ".join(p.cmdline()):
                    return
            except Exception:  # gone meanwhile
                continue
        time.sleep(0.1)
    raise AssertionError(f"no {title} process (the job {'exited' if job.poll() is not None else 'still runs'})")


def left_after(ray_tmpdir: str, timeout_s: float) -> list[str]:
    """The job's Ray instance's processes still alive `timeout_s` after now (none sooner: returns
    as soon as all are gone)."""
    deadline = time.monotonic() + timeout_s
    while ray_processes_of(ray_tmpdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for p in ray_processes_of(ray_tmpdir):
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:60]}")
        except Exception:
            pass
    return left


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sigterm_while_vllm_loads_the_model_is_a_stop_with_its_line_and_leaves_nothing(tmp_path, deep_qwen3,
                                                                                        ray_tmpdir):
    """The generate job on vLLM, its own local Ray instance, SIGTERMed while its engine
    replica loads the model (vLLM's EngineCore is up): exit 143 and the one line, the
    manifest's generate run `stopped` (by SIGTERM), and nothing of its Ray instance (vLLM's
    processes included) left 30 s after the job exited. Was (issue 63): exit 15, no line, the
    manifest `running`: Ray's build_processor had installed Ray's SIGTERM handler."""
    out = tmp_path / "out"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(out, deep_qwen3, source__sample=4, **VLLM)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=ray_tmpdir)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr_file:
        job = subprocess.Popen([sys.executable, "-m", "ray_jobs.generate", "--config", str(config)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=stderr_file, process_group=0)
    try:
        wait_for_process(ray_tmpdir, "VLLM::EngineCore", job)
        stopped = time.monotonic()
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=120)
        exited = time.monotonic()
        left = left_after(ray_tmpdir, 30)
        print(f"\nSIGTERM while vLLM loads: the job exited {exited - stopped:.1f} s after the signal; its Ray "
              f"instance gone {time.monotonic() - exited:.1f} s after that")
    finally:
        if job.poll() is None:
            job.kill()
    stderr = log.read_text()
    assert job.returncode == 143, (job.returncode, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == [stderr.strip().splitlines()[-1]] and errors[0].startswith("error: stopped by SIGTERM"), errors
    record = json.loads((out / "manifest.json").read_text())["phases"]["generate"]
    assert record["status"] == "stopped" and record["runs"][-1]["status"] == "stopped", record
    assert record["runs"][-1]["stopped_by"] == "SIGTERM"
    assert left == [], left
