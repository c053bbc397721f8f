"""The benchmark smoke runs (tests/test_benchmarks.py): each script in benchmarks/ at a
smoke size, the smallest that still runs every step it has. They start with the test session
(conftest.py's `smoke_runs`) and run in the background beside the other tests, each on a Ray
instance of its own: a smoke run shows that its script runs end to end and prints its table
(tests/test_benchmarks.py reads it back: counts and invariants, never a speed), and much of
it is waiting on one core (imports, model loads, actor start-ups) that the tests beside it
fill. Two lanes, one script at a time in each, of about equal CPU: the vLLM scripts; and the
rest. recipe_study.py's smoke is a test of its own in the foreground
(tests/test_benchmarks.py, OWN_TEST): the pilot it runs killed in each kind of stage and run
again. Each smoke's wall and CPU time: docs/development.md."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from support import REPO, vllm_unavailable

# script -> (smoke arguments, text its output must contain)
SMOKE = {
    "driver_memory.py": (["--smoke"], "rows x2: driver peak RSS"),
    "engine_feeding.py": (["--slots", "4", "--rows", "40", "--measure-s", "2", "--settings", "4x4", "naive"],
                          "| naive (all rows x 1) |"),
    # Every step ran: the CPU table's header names each window, and the bytes line comes last.
    "hidden_states_throughput.py": (["--smoke"], "| bare vLLM | phase on vLLM | floor (no engine) |"),
    "postprocess_throughput.py": (["--rows", "40", "--repeats", "1"], "| ours (Postprocessor) |"),
    "reader_memory.py": (["--rows", "400", "--tokens", "50", "--rows-per-shard", "100"], "| rows | shards |"),
    # Every path ran: the breakdown's header names each.
    "server_vs_job.py": (["--smoke"], "| bare vLLM (LLM.generate) | job, default feeding | server C=2 |"),
    # A bound that the 48 rows pass (~180 MB; above the gate's floor, 2 workers' windows and the
    # split: 20 rows, at most 110 MB): the gate holds them to it (test_benchmarks.stream_scale).
    "stream_scale.py": (["--smoke", "--max-bytes", "120000000"], "| trainer step (x engine) |"),
}


# Each smoke run of a whole job, or of 20 s or more, is `slow`; vLLM's is `vllm`.
VLLM = {"hidden_states_throughput.py", "server_vs_job.py"}
SLOW = {"driver_memory.py", "engine_feeding.py", "stream_scale.py"}
# Two lanes of about equal CPU (docs/development.md): the vLLM scripts; the rest, the costliest first.
FIRST_LANE = {"hidden_states_throughput.py", "server_vs_job.py"}
OTHER_LANE_FIRST = {"stream_scale.py"}
MARKS = {**{s: pytest.mark.slow for s in SLOW}, **{s: pytest.mark.vllm for s in VLLM}}

TEST = "test_benchmark_runs_at_smoke_size"
# Scripts whose smoke is a test of its own (tests/test_benchmarks.py), not a run in a lane: the
# recipe study at its smoke size is the pilot's whole run, killed in each kind of stage.
OWN_TEST = {"recipe_study.py"}

# The smokes run at the lowest priority, with every process they start (their own Ray
# instances' workers included: Ray adds its worker niceness, 0 in the tests (conftest.py),
# to what it is started with). The tests beside them keep the cores where they need them,
# and the smokes take what the tests leave: waits on Ray, on a subprocess, on one thread.
# Niceness weighs only within a session: Linux shares the cores between sessions first
# (sched_autogroup), so a process a test starts in a session of its own takes half the cores
# at most beside the smokes, whatever their niceness (docs/development.md). The tests start
# theirs in a process group of their own instead.
NICENESS = 19
# Except for their Ray start: these scripts start their Ray instances with
# benchmarks/_workload.own_ray alone, and run at the tests' niceness until it is up, then step
# down to NICENESS with it (_workload.SMOKE_NICENESS). Under `nice` a start got so little of the
# cores that it missed Ray's fixed 30 s wait for the raylet (CI, 2026-12-06).
STEP_DOWN_ONCE_RAY_IS_UP = {"driver_memory.py", "engine_feeding.py", "hidden_states_throughput.py",
                            "stream_scale.py"}
# Beside the tests a smoke gets only the cores they leave: the whole run's length, not its own.
SMOKE_TIMEOUT_S = 3600


def run_smoke(script: str) -> subprocess.CompletedProcess:
    args, _ = SMOKE[script]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, str(REPO / "benchmarks" / script), *args]
    if script in STEP_DOWN_ONCE_RAY_IS_UP:
        env["EAGLE_DATA_SMOKE_NICENESS"] = str(NICENESS)
    else:
        command = ["nice", "-n", str(NICENESS), *command]
    return subprocess.run(command, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT_S)


def start_smokes(items) -> tuple[dict[str, Future], list[ThreadPoolExecutor]]:
    """The smoke runs of the selected test items, started in their lanes."""
    scripts = [item.callspec.params["script"] for item in items if item.originalname == TEST
               and (item.get_closest_marker("vllm") is None or vllm_unavailable() is None)]
    lanes = {"first": ThreadPoolExecutor(1), "other": ThreadPoolExecutor(1)}
    runs = {s: lanes["first" if s in FIRST_LANE else "other"].submit(run_smoke, s)
            for s in sorted(scripts, key=lambda s: s not in OTHER_LANE_FIRST)}
    return runs, list(lanes.values())
