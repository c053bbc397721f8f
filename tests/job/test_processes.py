"""Every process an engine replica starts ends with the replica, however the replica ends
(job/stages/engines/processes.py `die_with_this_process`, issue 55 case 7): here a plain
process in the replica's place, with what vLLM's engine starts (a spawned process that
starts another, as EngineCore starts its workers; one that ignores SIGTERM; a
multiprocessing resource tracker), SIGKILLed. The vLLM replica itself: tests/vllm/test_vllm_engine.py's faults run (its
driver SIGKILLed, Ray kills the replica: every process below it must end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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
    print("ready", flush=True)
    time.sleep(600)
"""


def below(pid: int) -> set[int]:
    from eagle_data.job.stages.engines.processes import descendants

    return descendants(pid)


def alive(pid: int) -> bool:
    from eagle_data.job.stages.engines.processes import alive

    return alive(pid)


def test_what_a_sigkilled_replica_started_ends_with_it(tmp_path):
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    started = []
    try:
        assert replica.stdout.readline().strip() == "ready", replica.stderr.read()
        deadline = time.monotonic() + 60
        while len(started := below(replica.pid)) < 6 and time.monotonic() < deadline:
            time.sleep(0.2)  # the watchdog, the tracker, 2 engine cores, their 2 workers
        assert len(started) == 6, started
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
