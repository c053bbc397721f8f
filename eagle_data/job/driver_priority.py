"""The driver's scheduling priority: never above the engine's.

Ray starts its workers (the engine replicas and their vLLM processes among them) at its
worker niceness, 15 unless the cluster sets `RAY_worker_niceness`, and leaves the driver
at the niceness it was started with: 0 from a shell, and 0 under `ray job submit` too. On a
machine where the driver shares cores with an engine, each burst of the driver (Ray Data's
scheduling loop, its per-batch bookkeeping) then preempts the engine's processes at once,
and the engine's step waits for it: on 2 cores the job made 0.96 of `vllm serve`'s tokens/s
that way, and 0.99 with the engine at the driver's niceness (docs/performance.md, "Settled").
So once Ray is up the driver steps down to the workers' niceness. It never raises its own
priority (that needs a privilege), and Ray's own daemons (raylet, gcs) keep theirs.
"""

from __future__ import annotations

import os

import ray


def _niceness(pid: int = 0) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def workers_niceness(timeout_s: float = 60) -> int | None:
    """The niceness of a Ray worker of this cluster (a task's process; no CPU reserved), or
    None when no worker answered within `timeout_s` (the job's own tasks then say why)."""
    ref = ray.remote(num_cpus=0)(_niceness).remote()
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayError:  # GetTimeoutError, a worker that could not start
        ray.cancel(ref, force=True)
        return None


def lower_to(niceness: int, pid: int = 0) -> tuple[int, int]:
    """Every thread of process `pid` (0: this one; Linux sets niceness per thread) to at
    least `niceness`; threads started later inherit their starter's. Returns the main
    thread's (before, after)."""
    before = _niceness(pid)
    folder = f"/proc/{pid or 'self'}/task"
    tasks = os.listdir(folder) if os.path.isdir(folder) else [str(pid)]
    for tid in map(int, tasks):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return before, _niceness(pid)


def step_below_engine() -> tuple[int, int]:
    """The driver (this process) to Ray's workers' niceness, where it is below it; as it
    was when no worker answered."""
    niceness = workers_niceness()
    return lower_to(niceness) if niceness is not None else (_niceness(), _niceness())
