"""A training driver SIGKILLed mid-stream on vLLM (issue 55, case 7): a user's own script
that starts its own Ray (`ray.init()`, no cluster) and streams `features()` into a
TorchTrainer of 2 workers. Ray's own processes of that instance end with the driver, and its
actors with them; vLLM's processes below the engine replica (VLLM::EngineCore,
VLLM::Worker, the resource tracker) were left running, re-parented to pid 1, ~2 GB and
burning CPU. Every process an engine replica starts must end with it, however it ends.

One engine load: the session's `hidden_out` (the 8-layer tiny Qwen3, 12 rows) streamed for
1000 epochs (the tiny model answers 200 in about 20 s here); the driver is killed once the
replica has answered its first batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support import REPO, job_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
            engine__batch_size=4, engine__max_concurrent_batches=4, engine__resource_wait_s=60, engine__cpu_threads=1,
            engine__engine_kwargs={"enforce_eager": True, "max_num_seqs": 8, "max_num_batched_tokens": 1024})
REPLICA = "MapWorker(MapBatches(VLLMEngine))"


def command(p: psutil.Process) -> str:
    """Its command line, or its name where that reads empty (vLLM's processes retitle
    themselves: VLLM::EngineCore's command line read empty at times, its name did not)."""
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:  # gone, or a zombie
        return ""


def titled(root: int, title: str) -> list[psutil.Process]:
    return [p for p in psutil.Process(root).children(recursive=True) if title in command(p)]


def answered(replica: psutil.Process) -> bool:
    """Whether the replica has answered a batch: Ray's vLLM stage logs "Elapsed time for
    batch" per batch, in the replica's own log files (its stdout and stderr)."""
    for fd in (1, 2):
        try:
            with open(os.readlink(f"/proc/{replica.pid}/fd/{fd}"), errors="replace") as log:
                if "Elapsed time for batch" in log.read():
                    return True
        except OSError:
            pass
    return False


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_session(sid: int) -> None:
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


def test_the_engines_processes_end_with_a_killed_driver_that_started_its_own_ray(hidden_out, deep_qwen3, tmp_path):
    cfg = job_config(hidden_out, deep_qwen3, hidden_states__dtype="float32",
                     hidden_states__scratch_dir=str(tmp_path / "scratch"), **VLLM)
    job = {"out": str(hidden_out), "config": cfg.model_dump(mode="json"), "save": str(tmp_path), "report": "killed",
           "workers": 2, "max_failures": 0, "stream": {"epochs": 1000, "world_size": 2}}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, as `ray.init()` starts
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'tests'}"
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, str(REPO / "tests" / "support.py"), "stream", json.dumps(job)],
                                  cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    below_replica: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while driver.poll() is None and time.monotonic() < deadline:
            replicas = titled(driver.pid, REPLICA)
            if replicas and answered(replicas[0]):
                break
            time.sleep(0.5)
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-5000:]
        replicas = titled(driver.pid, REPLICA)
        assert replicas, "no vLLM engine replica below the driver"
        below_replica = [c for r in replicas for c in r.children(recursive=True)]
        names = sorted(command(p)[:40].strip() for p in below_replica)
        assert any("VLLM::EngineCor" in n for n in names) and any("VLLM::Worker" in n for n in names), names

        driver.send_signal(signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        while any(alive(p) for p in below_replica) and time.monotonic() < killed + 30:
            time.sleep(0.5)
        left = [f"{p.pid} {command(p)[:60]}" for p in below_replica if alive(p)]
        assert not left, f"processes the engine replica started still run 30 s after the driver's SIGKILL: {left}"
        print(f"\nthe {len(below_replica)} processes below the engine replica ({', '.join(n for n in names if n)}) ended "
              f"{time.monotonic() - killed:.1f} s after the driver's SIGKILL")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for p in below_replica:  # whatever the test found, never left for the rest of the session
            if alive(p):
                p.kill()
        kill_session(driver.pid)  # the driver's Ray instance (its agents outlive it: docs/robustness.md)
