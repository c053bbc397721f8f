"""Starting and leaving Ray: the one way every job does it (the generate job, the draft
trainer).

    start_ray(progress)   joins the cluster when there is one (`ray job submit` sets
                          RAY_ADDRESS), else starts a local instance; then the project's stop
                          signals again, the driver below the engine, the workers' log noise
                          filtered, Ray Data's progress output as configured
    close_ray()           after a job that succeeded: the replicas' last output first
    leave_ray()           after a stop signal or an error: at once
    ray_job()             an entry point's job: Ray closed after it, or left when it raises
"""

from __future__ import annotations

import contextlib
import logging
import time

import ray

from eagle_data.errors import ignore_stop_signals, stop_on_signals
from eagle_data.job.driver_priority import step_below_engine
from eagle_data.job.ray_internals import init_ray, ray_data_progress, wait_for_actors_to_exit
from eagle_data.job.stages.engines import ENGINE_CLASSES
from eagle_data.job.stages.engines.exit_noise import quiet_worker_logs

log = logging.getLogger("eagle_data")


def start_ray(progress: bool) -> float:
    """Ray up for this driver (see the module's docstring); returns the seconds it took.
    `progress`: Ray Data's own progress output (output.ray_data_progress)."""
    started = time.monotonic()
    if not ray.is_initialized():
        init_ray()  # joins the cluster when there is one, else starts a local instance
        stop_on_signals()  # instead of the SIGTERM handlers ray.init installed (errors.stop_on_signals)
    before, after = step_below_engine()  # the driver never preempts the engine (driver_priority.py)
    if after != before:
        log.info("driver: niceness %d -> %d, Ray's workers' (the engine's), so that it never preempts the engine",
                 before, after)
    quiet_worker_logs()
    ray_data_progress(progress)
    return time.monotonic() - started


def close_ray() -> None:
    """Let the engine replicas shut down and their last output reach the log, then leave
    Ray: what the job prints after this (its summary) is the last thing in its log."""
    if ray.is_initialized():
        wait_for_actors_to_exit(ENGINE_CLASSES)
        ignore_stop_signals()  # the job is done: a Ctrl-C now would only cut the shutdown short
        ray.shutdown()


def leave_ray() -> None:
    """After a stop signal or an error: leave Ray at once, without waiting for the replicas
    (`ray job stop` SIGKILLs 3 s after its SIGTERM). ray.shutdown stops every process of the local
    instance this job started, and only disconnects from a cluster it joined; with further
    stop signals ignored, a second Ctrl-C cannot cut it short and leave Ray's agents running.
    Called even when Ray looks shut down: a shutdown cut short has disconnected but may not
    have stopped the local processes yet, and ray.shutdown stops what is left."""
    ignore_stop_signals()
    ray.shutdown()


@contextlib.contextmanager
def ray_job():
    """An entry point's job: Ray closed after it (close_ray), left at once when it raises
    or is stopped (leave_ray), so that no local instance outlives the command. A Ray this
    process was already connected to (a caller's: a test, a notebook) is left as it was."""
    if ray.is_initialized():
        yield
        return
    try:
        yield
    except BaseException:
        leave_ray()
        raise
    close_ray()
