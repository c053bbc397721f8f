"""tests/cpu_profile.py, the per-test CPU profile, on a test that burns a known amount of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import REPO


def test_each_test_gets_the_cpu_it_spent(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import time\n"
        "def test_burns_half_a_second():\n"
        "    end = time.process_time() + 0.5\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "def test_sleeps():\n"
        "    time.sleep(0.5)\n")
    records = tmp_path / "cpu.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "CPU_PROFILE": str(records)}
    for _ in range(2):  # the second run's records replace the first's
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_profile", "-p", "no:cacheprovider",
                               "test_burn.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    burn, sleep = (json.loads(line) for line in records.read_text().splitlines())
    assert burn["id"] == "test_burn.py::test_burns_half_a_second" and sleep["id"] == "test_burn.py::test_sleeps"
    # Machine-wide: other processes (the benchmark smokes beside the suite) only add to it.
    assert burn["cpu_s"] >= 0.45 and sleep["wall_s"] >= 0.5
    assert "CPU per test" in done.stdout and "test_burn.py::test_burns_half_a_second" in done.stdout
