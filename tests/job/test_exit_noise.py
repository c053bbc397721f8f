"""eagle_data.job.stages.engines.exit_noise without a Ray instance: the filter on the workers' output."""

from __future__ import annotations

from eagle_data.job.stages.engines.exit_noise import drop_harmless_exit_noise

# As the driver received them from a vLLM CPU engine actor at a clean exit (Python 3.11).
TRACKER_NOISE = [
    "(Worker pid=3689) /usr/lib/python3.11/multiprocessing/resource_tracker.py:123: UserWarning: "
    "resource_tracker: process died unexpectedly, relaunching.  Some resources might leak.",
    "(Worker pid=3689)   warnings.warn('resource_tracker: process died unexpectedly, '",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 239, in main',
    "    cache[rtype].remove(name)",
    "KeyError: '/psm_8456cd61'",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 239, in main',
    "    cache[rtype].remove(name)",
    "KeyError: '/mp-brk25jra'",
]


def test_the_resource_trackers_exit_noise_is_dropped_and_nothing_else():
    kept = ["INFO [core_client.py:696] [shutdown] MPClient: complete", "engine replica on node abc"]
    assert drop_harmless_exit_noise(kept[:1] + TRACKER_NOISE + kept[1:]) == kept


def test_other_tracebacks_are_kept_whole():
    real = ["Traceback (most recent call last):", '  File "/app/x.py", line 3, in f',
            "    cache[rtype].remove(name)", "KeyError: 'sample_id'"]
    also = ["Traceback (most recent call last):", '  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", '
            "line 239, in main", "    cache[rtype].remove(name)", "ValueError: boom"]
    assert drop_harmless_exit_noise(real) == real
    assert drop_harmless_exit_noise(also) == also


ENGINE_SHUTDOWN = [
    "ERROR 12-01 11:45:35 [async_llm.py:819] AsyncLLM output_handler failed.",
    "ERROR 12-01 11:45:35 [async_llm.py:819] Traceback (most recent call last):",
    'ERROR 12-01 11:45:35 [async_llm.py:819]   File "/x/vllm/v1/engine/async_llm.py", line 765, in output_handler',
    "ERROR 12-01 11:45:35 [async_llm.py:819]     outputs = await engine_core.get_output_async()",
    "ERROR 12-01 11:45:35 [async_llm.py:819] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered "
    "an issue. See stack trace (above) for the root cause.",
]


def test_vllms_shutdown_time_engine_dead_block_is_dropped_and_other_engine_errors_kept():
    kept = ["INFO [core_client.py:696] [shutdown] MPClient: complete", "Shutting down vLLM engine"]
    assert drop_harmless_exit_noise(kept[:1] + ENGINE_SHUTDOWN + kept[1:]) == kept
    other = ENGINE_SHUTDOWN[:-1] + ["ERROR 12-01 11:45:35 [async_llm.py:819] RuntimeError: CUDA error"]
    assert drop_harmless_exit_noise(other) == other


def test_a_tracker_traceback_split_across_batches_is_dropped_and_a_real_one_kept_whole():
    """Ray hands the driver a worker's output in batches; the 4 lines of a tracker traceback
    once came in two (a full-suite run printed them). The printer holds back the lines that
    may begin one until the next batch of that process and stream tells."""
    from eagle_data.job.stages.engines.exit_noise import QuietPrinter

    printed = []
    quiet = QuietPrinter(lambda data: printed.append((data["pid"], data["lines"])))
    one = TRACKER_NOISE[2:6]
    real = ["Traceback (most recent call last):", '  File "/app/x.py", line 3, in f', "ValueError: boom"]
    quiet({"pid": 1, "is_err": True, "lines": ["Shutting down vLLM engine", *one[:2]]})
    quiet({"pid": 2, "is_err": True, "lines": real[:1]})  # another process: its own hold-back
    quiet({"pid": 1, "is_err": True, "lines": [*one[2:], "done"]})
    quiet({"pid": 2, "is_err": True, "lines": real[1:]})
    assert printed == [(1, ["Shutting down vLLM engine"]), (1, ["done"]), (2, real)]
