"""No benchmark can rot: each script in benchmarks/ runs at a smoke size (seconds, a real
model load for the vLLM ones) and must exit 0 and print its figures. The full sizes stay
manual (each script's docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import REPO, attached, vllm_unavailable

# script -> (smoke arguments, text its output must contain)
SMOKE = {
    "driver_memory.py": (["--rows", "200", "400"], "driver peak RSS"),
    "engine_feeding.py": (["--slots", "4", "--rows", "40", "--measure-s", "2", "--settings", "4x4", "naive",
                           "--no-model-table"], "util"),
    "hidden_states_throughput.py": (["--smoke"], "| bare vLLM, generate + files written |"),
    # --logprobs: about 13 s more, nearly all of it importing Ray's vLLM stage (torch, vllm).
    "multi_turn_loads.py": (["--smoke"], "loads per run (this checkout)"),
    "postprocess_throughput.py": (["--rows", "40", "--repeats", "1", "--logprobs", "2", "--logprobs-rows", "4"],
                                  "ours (Postprocessor)"),
    "prompts_memory.py": (["--smoke"], "driver peak RSS growth"),
    "reader_memory.py": (["--rows", "400", "--tokens", "50", "--rows-per-shard", "100"], "samples"),
    "resume_cost.py": (["--rows", "2000", "--rows-per-shard", "500", "--failed", "50", "--repeats", "1"], "resume reads what it needs"),
    # --skip bare: vllm_vs_job's smoke measures bare vLLM (LLM.generate); here the job is the
    # reference the server's rows are compared with.
    "server_vs_job.py": (["--smoke", "--skip", "bare"], "| server, tight timeout | 2 |"),
    "vocab_count.py": (["--smoke"], "counts equal: True"),
    "vllm_vs_job.py": (["--smoke"], "| bare vLLM (LLM.generate) |"),
}


def test_every_benchmark_has_a_smoke_size():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE)


# Each smoke run of a whole job, or of 20 s or more, is `slow`; vLLM's is `vllm`.
MARKS = {"vllm_vs_job.py": pytest.mark.vllm, "hidden_states_throughput.py": pytest.mark.vllm,
         "server_vs_job.py": pytest.mark.vllm, "multi_turn_loads.py": pytest.mark.vllm,
         "driver_memory.py": pytest.mark.slow, "prompts_memory.py": pytest.mark.slow,
         "engine_feeding.py": pytest.mark.slow, "postprocess_throughput.py": pytest.mark.slow}


# The smoke runs go in three lanes that run side by side (a run only shows that its script
# still runs and prints its figures: at a smoke size, and side by side, the figures mean
# nothing). One lane runs on the session's Ray instance (RAY_ADDRESS: benchmarks/_workload.py
# start_ray, or the job command's own ray.init), one script at a time, since their jobs would
# compete for its 2 CPUs; the other vLLM scripts start a Ray instance of their own, one at a
# time beside it; the rest (the memory benchmarks sample the Ray workers under their own
# process) in the third lane.
ATTACHED = {"hidden_states_throughput.py", "multi_turn_loads.py"}
OWN_RAY_VLLM = {"server_vs_job.py", "vllm_vs_job.py"}


def run_smoke(script: str, env: dict) -> subprocess.CompletedProcess:
    args, _ = SMOKE[script]
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def smoke_runs(request):
    """The selected scripts' smoke runs, started at once in their lanes; a test waits for its own."""
    scripts = [item.callspec.params["script"] for item in request.session.items
               if item.originalname == "test_benchmark_runs_at_smoke_size"
               and (item.get_closest_marker("vllm") is None or vllm_unavailable() is None)]
    attached_env = attached(request.getfixturevalue("ray_local")) if ATTACHED & set(scripts) else None
    own_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    lanes = {"attached": ThreadPoolExecutor(1), "vllm": ThreadPoolExecutor(1), "other": ThreadPoolExecutor(1)}
    runs = {s: lanes["attached" if s in ATTACHED else "vllm" if s in OWN_RAY_VLLM else "other"].submit(
        run_smoke, s, attached_env if s in ATTACHED else own_env) for s in scripts}
    yield runs
    for lane in lanes.values():
        lane.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("script", [pytest.param(s, marks=MARKS.get(s, ())) for s in sorted(SMOKE)],
                         ids=lambda s: s.removesuffix(".py"))
def test_benchmark_runs_at_smoke_size(script, smoke_runs):
    proc = smoke_runs[script].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert SMOKE[script][1] in output, output[-4000:]
