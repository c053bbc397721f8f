"""CPU seconds by kind of process, sampled over a benchmark's process tree (the driver, a
local Ray instance it started, vLLM's processes), for the figures' "inside the engine's
window" tables (server_vs_job.py, hidden_states_throughput.py)."""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

import psutil

ENGINE_KINDS = ("engine model worker (VLLM::Worker)", "engine core (VLLM::EngineCore)")
FRONT = "engine front (replica actor / LLM process / API server)"
DRIVER = "driver (the job's; the server's client)"  # this process
# Process kinds, in the breakdown's order: (kind, strings one of which its command line contains).
KINDS = [(ENGINE_KINDS[0], ("VLLM::Worker",)), (ENGINE_KINDS[1], ("EngineCore",)),
         (FRONT, ("VLLMEngine", "InstantStates", "openai.api_server")), (DRIVER, ()),
         ("Ray's actors and agents", ("_StatsActor", "Coordinator", "ActorLocationTracker", "Agent")),
         ("Ray Data task workers (reads, requests, postprocess)", ("ray::",)), ("raylet", ("raylet/raylet",)),
         ("gcs", ("gcs_server",)), ("other processes", ("",))]


class CpuSampler:
    """CPU seconds and niceness of this process and its descendants, sampled every `every_s`
    on the monotonic clock vLLM's engine core stamps its metrics with. A worker's command
    line is its current Ray task, so a sample's CPU goes to the kind the process had then."""

    # --engine-cores (server_vs_job.py): vLLM's engine processes on these cores, every other
    # process of the tree on the rest, each thread, re-applied at each sample
    engine_cores: set[int] | None = None

    def __init__(self, front: str | None = None, every_s: float = 0.5):
        self.front, self.every_s = front, every_s  # front: the kind of this process itself
        self.pid = os.getpid()  # the sampled process (bare's samples are read by its parent)
        # (time, {pid: (kind, cpu s, nice)}, the sampler thread's own CPU s so far: the
        # driver's figure includes it)
        self.samples: list[tuple[float, dict, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")

    def kind(self, proc: psutil.Process) -> str:
        if proc.pid == os.getpid():
            return self.front or DRIVER
        line = " ".join(proc.cmdline())
        return next(kind for kind, needles in KINDS if any(n in line for n in needles))

    def sample(self) -> None:
        me = psutil.Process()
        snap = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    snap[proc.pid] = (self.kind(proc), cpu.user + cpu.system, proc.nice())
                if self.engine_cores:
                    self.pin(proc.pid, snap[proc.pid][0] in ENGINE_KINDS)
            except psutil.Error:  # exited meanwhile
                pass
        snap.update(self.own_threads(me))
        self.samples.append((time.monotonic(), snap, time.thread_time()))

    def pin(self, pid: int, engine: bool) -> None:
        cores = self.engine_cores if engine else set(range(os.cpu_count())) - self.engine_cores
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # ended meanwhile
                pass

    def own_threads(self, me: psutil.Process) -> dict:
        """This process's threads as (-thread id: ("thread: NAME", cpu s, nice)), NAME the
        Python thread's name or the OS one (Ray's C++ threads), digits dropped."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        threads = {}
        for t in me.threads():
            try:
                name = names.get(t.id) or Path(f"/proc/self/task/{t.id}/comm").read_text().strip()
                nice = os.getpriority(os.PRIO_PROCESS, t.id)
            except OSError:  # ended meanwhile
                continue
            name = name.split("-dataset_")[0].rstrip("0123456789_-")  # one row per kind of thread
            if name != self._thread.name:  # given as "sampler thread"
                threads[-t.id] = ("thread: " + name, t.user_time + t.system_time, nice)
        return threads

    def _run(self) -> None:
        while True:
            self.sample()  # here only: its thread_time() is this thread's
            if self._stop.wait(self.every_s):
                return self.sample()

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> dict:
        """{kind: [CPU s, {nice values}]} between the last sample at or before `start` and
        the first at or after `end` (a process started meanwhile counts from 0, one gone by
        then, like the job's engine after its last row, up to its last sample); the sampler's
        own CPU is taken out of the driver's and given as "sampler thread"."""
        times = [t for t, _, _ in self.samples]
        begin = max(bisect.bisect_right(times, start) - 1, 0)
        stop = min(bisect.bisect_left(times, end), len(times) - 1)
        _, first, own0 = self.samples[begin]
        last = {pid: value for _, snap, _ in self.samples[begin:stop + 1] for pid, value in snap.items()}
        own1 = self.samples[stop][2]
        kinds: dict = {"sampler thread": [own1 - own0, set()]}
        for pid, (kind, cpu, nice) in last.items():
            entry = kinds.setdefault(kind, [0.0, set()])
            entry[0] += cpu - (first[pid][1] if pid in first else 0.0) - (own1 - own0 if pid == self.pid else 0)
            entry[1].add(nice)
        return kinds
