"""`pytest -p cpu_profile`: the CPU each test costs the whole machine, to find what to cut.

The suite is bound by CPU on 2 cores (the cores are busy ~90% of a full run), so a test's
cost is the CPU it makes every process spend (its job's driver, Ray workers, engines, the
Ray instance's agents), not its wall time: a cluster test waiting on three nodes can cost
twice its duration. Each test's setup + call + teardown is bracketed with /proc/stat's busy
time (all processes, so run the tests alone, without the benchmark smokes:
`--ignore=tests/test_benchmarks.py`). Each test's record goes, as one JSON line, to the
file CPU_PROFILE names (default cpu-profile.jsonl), emptied when the session starts and
written test by test (a killed run keeps what it measured); the summary lists the costliest."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

TICKS = os.sysconf("SC_CLK_TCK")
RECORDS: list[dict] = []


def profile_path() -> str:
    return os.environ.get("CPU_PROFILE", "cpu-profile.jsonl")


def pytest_sessionstart(session):
    open(profile_path(), "w").close()


def busy_seconds() -> float:
    """CPU seconds all cores spent working since boot: user, nice, system, irq, softirq
    (not idle, iowait, or steal, the time a virtual machine's host took)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = busy_seconds(), time.monotonic()
    yield
    record = {"id": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
              "cpu_s": round(busy_seconds() - cpu, 2)}
    RECORDS.append(record)
    with open(profile_path(), "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not RECORDS:
        return
    write = terminalreporter.write_line
    total = sum(r["cpu_s"] for r in RECORDS)
    terminalreporter.section("CPU per test (all processes; core-seconds)")
    write(f"{len(RECORDS)} tests: {total:.0f} CPU s in {sum(r['wall_s'] for r in RECORDS):.0f} s")
    files = collections.Counter()
    for r in RECORDS:
        files[r["id"].split("::")[0]] += r["cpu_s"]
    for name, cpu in files.most_common(10):
        write(f"{cpu:8.0f}  {name}")
    write("")
    for r in sorted(RECORDS, key=lambda r: -r["cpu_s"])[:15]:
        write(f"{r['cpu_s']:8.1f} {r['wall_s']:7.1f}s  {r['id']}")
