"""CPU seconds by kind of process, sampled over a benchmark's process tree (the driver, a
local Ray instance it started, vLLM's processes), for the "inside the engine's window"
tables of server_vs_job.py and hidden_states_throughput.py."""

from __future__ import annotations

import bisect
import os
import threading
import time

import psutil

ENGINE_KINDS = ("engine model worker (VLLM::Worker)", "engine core (VLLM::EngineCore)")
FRONT = "engine front (replica actor / LLM process / API server)"
DRIVER = "driver (the job's; the server's client)"  # this process
# Process kinds, in the tables' order: (kind, strings one of which its command line contains).
KINDS = [(ENGINE_KINDS[0], ("VLLM::Worker",)), (ENGINE_KINDS[1], ("EngineCore",)),
         (FRONT, ("VLLMEngine", "InstantStates", "openai.api_server")), (DRIVER, ()),
         ("Ray's actors and agents", ("_StatsActor", "Coordinator", "ActorLocationTracker", "Agent")),
         ("Ray Data task workers (reads, requests, postprocess)", ("ray::",)), ("raylet", ("raylet/raylet",)),
         ("gcs", ("gcs_server",)), ("other processes", ("",))]
SAMPLER = "sampler thread"


class Every:
    """A thread that calls `sample()` every `every_s` seconds while the `with` block runs,
    once more as it ends: the benchmarks' samplers (CPU here, memory in stream_scale.py)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{type(self).__name__}-sampler")

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()  # here only: a sample's thread_time() is this thread's
            if self._stop.wait(self.every_s):
                return self.sample()


class CpuSampler(Every):
    """CPU seconds of this process and its descendants, sampled every `every_s` on the
    monotonic clock vLLM's engine core stamps its metrics with. A worker's command line is
    its current Ray task, so a sample's CPU goes to the kind the process had then."""

    # server_vs_job.py --engine-cores: vLLM's engine processes on these cores, every other
    # process of the tree on the rest, each thread, re-applied at each sample
    engine_cores: set[int] | None = None

    def __init__(self, front: str | None = None, every_s: float = 0.5):
        super().__init__(every_s)
        self.front = front  # the kind of this process itself
        self.pid = os.getpid()  # the sampled process (bare's samples are read by its parent)
        # (time, {pid: (kind, cpu s)}, the sampler thread's own CPU s so far: this process's
        # figure includes it)
        self.samples: list[tuple[float, dict, float]] = []

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
                    snap[proc.pid] = (self.kind(proc), cpu.user + cpu.system)
                if self.engine_cores:
                    self.pin(proc.pid, snap[proc.pid][0] in ENGINE_KINDS)
            except psutil.Error:  # exited meanwhile
                pass
        self.samples.append((time.monotonic(), snap, time.thread_time()))

    def pin(self, pid: int, engine: bool) -> None:
        cores = self.engine_cores if engine else set(range(os.cpu_count())) - self.engine_cores
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # ended meanwhile
                pass

    def window(self, start: float, end: float) -> dict[str, float]:
        """{kind: CPU s} between the last sample at or before `start` and the first at or
        after `end` (a process started meanwhile counts from 0, one gone by then, like the
        job's engine after its last row, up to its last sample); the sampler's own CPU is
        taken out of this process's and given as SAMPLER."""
        times = [t for t, _, _ in self.samples]
        begin = max(bisect.bisect_right(times, start) - 1, 0)
        stop = min(bisect.bisect_left(times, end), len(times) - 1)
        _, first, own0 = self.samples[begin]
        last = {pid: value for _, snap, _ in self.samples[begin:stop + 1] for pid, value in snap.items()}
        own = self.samples[stop][2] - own0
        kinds = {SAMPLER: own}
        for pid, (kind, cpu) in last.items():
            kinds[kind] = kinds.get(kind, 0.0) + cpu - (first[pid][1] if pid in first else 0.0) \
                - (own if pid == self.pid else 0.0)
        return kinds


def total(kinds: dict[str, float], skip: tuple[str, ...] = ()) -> float:
    """All processes' CPU s in a window (CpuSampler.window), the sampler's thread and `skip` left out."""
    return sum(v for k, v in kinds.items() if k != SAMPLER and k not in skip)
