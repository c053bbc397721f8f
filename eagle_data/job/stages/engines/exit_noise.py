"""The lines an engine replica's processes print at a clean exit that are not errors, left
out of the driver's copy of the workers' output (the job log)."""

from __future__ import annotations

import re

# vLLM's worker attaches shared memory without registering it with Python's resource
# tracker, and at exit the tracker prints a KeyError traceback per name (and the worker a
# warning) although nothing failed.
HARMLESS_EXIT_NOISE = re.compile(
    r"resource_tracker: process died unexpectedly|warnings\.warn\('resource_tracker: process died")
TRACKER_TRACEBACK = re.compile(r"multiprocessing/resource_tracker\.py|cache\[rtype\]\.remove\(name\)|"
                               r"^KeyError: '/(psm_|mp-)")


# vLLM 0.29's exit path can stop the engine process before it cancels the task reading its
# outputs (vllm_udf.py cancels it first where it gets the chance); that task then logs
# this block, although every row was answered. A real engine death mid-run also fails its
# rows (failed/, with the error) and Ray reports the actor's death.
SHUTDOWN_HEADER = re.compile(r"\[async_llm\.py:\d+\] AsyncLLM output_handler failed\.$")
SHUTDOWN_LINE = re.compile(r"\[async_llm\.py:\d+\] ")


def drop_harmless_exit_noise(lines: list[str]) -> list[str]:
    """Worker output lines without the resource tracker's KeyError tracebacks and warnings,
    and without vLLM's shutdown-time EngineDeadError block."""
    kept, i = [], 0
    while i < len(lines):
        if SHUTDOWN_HEADER.search(lines[i]):
            end = i + 1
            while end < len(lines) and SHUTDOWN_LINE.search(lines[end]) and "EngineDeadError" not in lines[end]:
                end += 1
            if end < len(lines) and "vllm.v1.engine.exceptions.EngineDeadError" in lines[end]:
                i = end + 1
                continue
        if HARMLESS_EXIT_NOISE.search(lines[i]):
            i += 1
            continue
        if lines[i].strip() == "Traceback (most recent call last):":
            end = i + 1
            while end < len(lines) and TRACKER_TRACEBACK.search(lines[end].strip()):
                end += 1
            if end - i == 4:  # Traceback, File ..., the remove line, KeyError: '/psm_...'
                i = end
                continue
        kept.append(lines[i])
        i += 1
    return kept


def cut_short(lines: list[str]) -> int:
    """Where a resource-tracker traceback that `lines` ends before its last line starts
    (len(lines) when they end on none): Ray hands the driver a worker's output in batches,
    and a batch boundary can fall inside the 4 lines."""
    for start in range(max(len(lines) - 3, 0), len(lines)):
        if lines[start].strip() == "Traceback (most recent call last):" and all(
                TRACKER_TRACEBACK.search(line.strip()) for line in lines[start + 1:]):
            return start
    return len(lines)


class QuietPrinter:
    """Ray's printer of the workers' output, less their harmless exit noise. A batch that
    ends inside what may be a tracker traceback keeps those lines back, per process and
    stream, until the next batch tells (at most 3 lines: the rest of a real traceback
    follows them)."""

    eagle_quiet = True

    def __init__(self, printer):
        self.printer = printer
        self.held: dict[tuple, list[str]] = {}

    def __call__(self, data: dict) -> None:
        key = (data.get("pid"), data.get("is_err"))
        lines = self.held.pop(key, []) + list(data.get("lines", []))
        cut = cut_short(lines)
        if cut < len(lines):
            self.held[key] = lines[cut:]
        lines = drop_harmless_exit_noise(lines[:cut])
        if lines:
            self.printer({**data, "lines": lines})


def quiet_worker_logs() -> None:
    """Print the workers' output in the driver (the job log) without their harmless exit
    noise: a handler swapped in Ray's internal stdstream dispatcher (`ray._private`)."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printer = next((h for name, h in dispatcher.handlers if name == "ray_print_logs"), None)
    if printer is None or getattr(printer, "eagle_quiet", False):
        return
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", QuietPrinter(printer))
