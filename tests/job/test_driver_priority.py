"""The driver steps down to Ray's workers' niceness, every thread of it, and never up
(eagle_data/job/driver_priority.py). The whole job's use of it, with Ray's default worker
niceness, is checked on the README's first job command (tests/test_readme.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO

THREADS = """
import json, os, sys, threading
from eagle_data.job.driver_priority import lower_to

stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in threads:
    t.start()
os.setpriority(os.PRIO_PROCESS, threads[0].native_id, 18)  # a thread already below the target
before, after = lower_to(int(sys.argv[1]))
late = []
later = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, 0)))
later.start()
later.join()


def niceness(tid):  # None for a thread that ended while listed: `later`, joined, can still be exiting
    try:
        return os.getpriority(os.PRIO_PROCESS, int(tid))
    except ProcessLookupError:
        return None


listed = {t: niceness(t) for t in os.listdir("/proc/self/task")}
print(json.dumps({"before": before, "after": after, "late": late[0], "lowered": threads[0].native_id,
                  "threads": {t: n for t, n in listed.items() if n is not None}}))
stop.set()
"""


def niceness_under_nice(start: int, below: int) -> int:
    """The niceness `nice -n start` gives a child of this runner; the test is skipped, with
    the reason, where the runner's niceness cannot be changed so (already too low a priority
    for `start` to add to, or a sandbox that refuses setpriority) or leaves it no lower than
    `below`."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    child = subprocess.run(["nice", "-n", str(start), sys.executable, "-c",
                            "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                           capture_output=True, text=True, timeout=60)
    got = int(child.stdout)
    if got != own + start:
        pytest.skip(f"this runner's niceness ({own}) cannot be raised by {start}: `nice -n {start}` gave {got}"
                    f"{' (' + child.stderr.strip() + ')' if child.stderr.strip() else ''}")
    if got >= below:
        pytest.skip(f"this runner runs at niceness {own}: `nice -n {start}` gives {got}, and the test needs "
                    f"a niceness below {below} there")
    return got


def lowered(target: int, start: int) -> dict:
    proc = subprocess.run(["nice", "-n", str(start), sys.executable, "-c", THREADS, str(target)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_thread_steps_down_to_the_workers_niceness_and_threads_started_later_inherit_it():
    own = niceness_under_nice(0, below=15)
    got = lowered(15, 0)
    assert got["before"] == own and got["after"] == 15 and got["late"] == 15, got
    assert len(got["threads"]) >= 4  # the main thread and the three waiting (and any an import started)
    assert {int(t): n for t, n in got["threads"].items()} == {
        int(t): (18 if int(t) == got["lowered"] else 15) for t in got["threads"]}, got


def test_a_driver_already_below_the_workers_stays_where_it_is():
    start = niceness_under_nice(5, below=19)  # one thread is set to 18: not below 18 without a privilege
    got = lowered(3, 5)  # `nice -n 5` adds 5 to this process's niceness
    assert got["before"] == got["after"] == got["late"] == start, got
    assert set(got["threads"].values()) == {got["before"], 18}, got


def test_the_workers_niceness_is_read_from_a_worker(ray_local):
    from eagle_data.job.driver_priority import workers_niceness

    # conftest.py starts the session's Ray workers at 0 (RAY_worker_niceness): Ray's default is 15.
    assert workers_niceness() == int(os.environ["RAY_worker_niceness"]) == 0


def test_another_process_steps_down_every_thread_of_it():
    """lower_to(n, pid): what a benchmark smoke does to its Ray instance's processes once it
    is up (benchmarks/_workload.step_down)."""
    from eagle_data.job.driver_priority import lower_to

    own = niceness_under_nice(0, below=15)
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]\n"
                              "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        assert lower_to(15, child.pid) == (own, 15)
        threads = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{child.pid}/task")}
        assert len(threads) >= 4 and set(threads.values()) == {15}, threads
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # this process as it was
    finally:
        child.kill()
        child.wait()
