"""Every process an engine replica starts ends with the replica, however the replica ends
(job/stages/engines/processes.py `die_with_this_process`, issue 55 case 7, issue 63): here a
plain process in the replica's place, with what vLLM's engine starts (a spawned process that
starts another, as EngineCore starts its workers; one that ignores SIGTERM; a
multiprocessing resource tracker), SIGKILLed; or, as Ray ends an exiting worker, its
children SIGKILLed first (`kill_child_processes_on_worker_exit`), then itself. The vLLM replica itself: tests/vllm/test_vllm_engine.py's faults run (its
driver SIGKILLed, Ray kills the replica: every process below it must end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from support import REPO

REPLICA = """
import multiprocessing as mp, multiprocessing.resource_tracker, signal, sys, time
from eagle_data.job.stages.engines.processes import die_with_this_process

def worker():
    time.sleep(600)

def engine_core(stubborn):
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mp.get_context("spawn").Process(target=worker).start()
    time.sleep(600)

if __name__ == "__main__":
    die_with_this_process()
    multiprocessing.resource_tracker.ensure_running()
    for stubborn in (False, True):
        mp.get_context("spawn").Process(target=engine_core, args=(stubborn,)).start()
    from eagle_data.job.stages.engines.processes import watchdogs
    print("ready", *watchdogs(), flush=True)
    time.sleep(600)
"""


def below(pid: int) -> set[int]:
    from eagle_data.job.stages.engines.processes import descendants

    return descendants(pid)


def alive(pid: int) -> bool:
    from eagle_data.job.stages.engines.processes import alive

    return alive(pid)


def children(pid: int) -> list[int]:
    from eagle_data.job.stages.engines.processes import descendants

    return [p for p in descendants(pid) if parent(p) == pid]


def parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize("end", ["sigkill", "as_ray_ends_a_worker"])
def test_what_a_replica_started_ends_with_it(tmp_path, end):
    """`as_ray_ends_a_worker`: Ray SIGKILLs an exiting worker's children, and where its
    process-group cleanup does not reach (RAY_process_group_cleanup_enabled=0, or a pgid
    shared with the raylet) the EngineCore's own children were left running: the watchdog,
    the replica's child then, was killed with the others before it could act (this test
    failed so). The watchdog is no child of the replica now."""
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    started = []
    try:
        ready, watchdog = replica.stdout.readline().split()
        assert ready == "ready", replica.stderr.read()
        deadline = time.monotonic() + 60
        while len(started := below(replica.pid) - {int(watchdog)}) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)  # the tracker, 2 engine cores, their 2 workers
        assert len(started) == 5, started
        if end == "as_ray_ends_a_worker":
            for child in children(replica.pid):
                os.kill(child, signal.SIGKILL)
        replica.send_signal(signal.SIGKILL)
        replica.wait()
        gone_by = time.monotonic() + 30  # SIGTERM, then SIGKILL after 5 s for the stubborn one
        while any(alive(p) for p in started) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert [p for p in started if alive(p)] == []
        assert "stopped the" in replica.stderr.read()  # the watchdog says what it stopped
    finally:
        replica.kill()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
