"""The processes below an engine replica (Linux /proc): waiting for vLLM's to exit, and making
every one of them end with the replica however it ends.

`die_with_this_process()` (an engine replica calls it before it starts anything) marks what
this process starts from then on, and everything those start in turn, with a token in their
environment, and starts a watchdog: a small process of its own session, this file run with
Python's standard library only, that holds a pipe from this process. It is not this process's
child (it forks away from the process started to start it, which exits): Ray SIGKILLs an
exiting worker's children (`kill_child_processes_on_worker_exit`), and a watchdog among them
was gone before it could act, leaving what vLLM's EngineCore had started (its Worker, a
grandchild of the replica) to run on wherever Ray's process-group cleanup did not reach it
(`RAY_process_group_cleanup_enabled=0`: a stand-in Worker outlived its replica by 20 s and
more). When this process ends
(SIGKILL included: the kernel closes the pipe) the watchdog stops every marked process:
SIGTERM (vLLM's EngineCore shuts its workers down on it), SIGKILL after `GRACE_S`; a
multiprocessing resource tracker is left to exit by itself once the processes that wrote to it
are gone (it then unlinks their shared memory), and killed after a further `GRACE_S`. Ray kills
an actor's children when it stops the actor itself, but not when the actor's process ends any
other way: a driver that started its own Ray and was SIGKILLed takes its raylet and the
actors with it, and vLLM's processes were left running, re-parented to pid 1.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

OWNER_ENV = "EAGLE_DATA_ENGINE_OWNER"  # the token of the process whose end ends them
GRACE_S = 5.0
POLL_S = 2.0  # the watchdog also looks at its owner's pid this often (a fork that kept the pipe)
_watchdog: list = []  # this process's watchdog and the pipe's write end: kept open until it ends


def descendants(pid: int) -> set[int]:
    """The processes below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_exit(pids: set[int], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def die_with_this_process() -> None:
    """Every process this one starts from now on ends when this one ends (module docstring).
    Linux only (a no-op elsewhere); once per process."""
    import subprocess
    import uuid

    if _watchdog or not os.path.isdir("/proc"):
        return
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    read_end, write_end = os.pipe()  # neither inherited by what this process starts
    starter = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), token, str(os.getpid()), start_time(os.getpid()),
         str(read_end)],
        pass_fds=[read_end], start_new_session=True, env={"PATH": os.environ.get("PATH", "")},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    watchdog = int(starter.stdout.readline())  # the starter's child: the watchdog; then the starter exits
    starter.stdout.close()
    starter.wait()
    os.close(read_end)
    _watchdog.extend([watchdog, write_end])
    os.environ[OWNER_ENV] = token


def watchdogs() -> set[int]:
    """This process's watchdog (it ends after this process, not before)."""
    return {_watchdog[0]} if _watchdog else set()


def start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot): with its pid, one process ever."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def marked(token: str) -> list[int]:
    """The live processes whose environment holds this token."""
    entry = f"{OWNER_ENV}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return [p for p in found if alive(p)]


def is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def send(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop_marked(token: str, grace_s: float = GRACE_S) -> list[int]:
    """Stop every process marked with `token` (module docstring); returns those found."""
    found = marked(token)
    engines = [p for p in found if not is_resource_tracker(p)]
    send(engines, signal.SIGTERM)
    wait_for_exit(set(engines), grace_s)
    send([p for p in marked(token) if not is_resource_tracker(p)], signal.SIGKILL)
    wait_for_exit(set(found), grace_s)  # the trackers, once their writers are gone
    send(marked(token), signal.SIGKILL)
    return found


def watch(token: str, owner: int, owner_start: str, fd: int) -> None:
    """The watchdog: wait for the owner's end (its pipe closes, or its pid is gone), then stop
    what it marked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the owner's to handle
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 1):
            break
        if start_time(owner) != owner_start:
            break
    found = stop_marked(token)
    if found:
        print(f"eagle-data: engine process {owner} ended; stopped the {len(found)} process(es) it started: "
              f"{sorted(found)}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # die_with_this_process's starter, then in its child the watchdog
    child = os.fork()
    if child:
        print(child, flush=True)
        os._exit(0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the starter's pipe is read once; stderr stays the owner's log
    watch(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
