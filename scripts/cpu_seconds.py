"""The wall time and the CPU seconds (user + system) of a command and of every process it
starts, Ray's workers and vLLM's processes included.

    .venv/bin/python scripts/cpu_seconds.py COMMAND [ARGS...]

`/usr/bin/time` (and a parent's rusage) counts only the children that were waited for, and
raylet ignores SIGCHLD (SigIgn in /proc/<raylet>/status), so the kernel drops its workers'
CPU when they exit: a Ray job's workers never show. Here the command runs with a tag in its
environment, which every process below it inherits (Ray's workers too); every `every`
seconds each live process with the tag is read (/proc/PID/stat: utime + stime), and each
process counts its last reading. What a process spends in its last interval before it
exits, or a process that lives less than one, is missed: a lower bound, close for processes
that run for seconds. Prints one line to stderr, after the command's own output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

TICKS = os.sysconf("SC_CLK_TCK")


def tagged_cpu(tag: bytes, seen: dict[int, float]) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        seen[int(pid)] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def main() -> int:
    every = 0.2
    tag = f"CPU_SECONDS_TAG={uuid.uuid4().hex}"
    seen: dict[int, float] = {}
    start = time.monotonic()
    proc = subprocess.Popen(sys.argv[1:], env={**os.environ, tag.split("=")[0]: tag.split("=")[1]})
    while proc.poll() is None:
        tagged_cpu(tag.encode(), seen)
        time.sleep(every)
    wall = time.monotonic() - start
    time.sleep(2 * every)  # what the command left behind, still exiting
    tagged_cpu(tag.encode(), seen)
    print(f"cpu_seconds: exit {proc.returncode}, wall {wall:.1f} s, CPU {sum(seen.values()):.1f} s (user + system) "
          f"in {len(seen)} processes", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
