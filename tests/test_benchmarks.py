"""No benchmark can rot: each script in benchmarks/ runs at a smoke size (seconds, a real
model load for vllm_vs_job) and must exit 0 and print its figures. The full sizes stay
manual (each script's docstring)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import REPO, attached

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


# Smoke runs on the session's Ray instance (RAY_ADDRESS: benchmarks/_workload.py start_ray, or
# the job command's own ray.init): a Ray start saved per script. The memory benchmarks keep
# their own: they sample the Ray workers under their process.
ATTACHED = {"vllm_vs_job.py", "hidden_states_throughput.py", "server_vs_job.py", "multi_turn_loads.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=MARKS.get(s, ())) for s in sorted(SMOKE)],
                         ids=lambda s: s.removesuffix(".py"))
def test_benchmark_runs_at_smoke_size(script, request):
    args, expected = SMOKE[script]
    env = attached(request.getfixturevalue("ray_local")) if script in ATTACHED else os.environ
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert expected in output, output[-4000:]
