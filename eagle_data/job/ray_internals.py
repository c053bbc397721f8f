"""Everything that depends on Ray 2.60's internals, in one place: bounded queues between the
generate stream's operators (driver memory) and small Parquet read tasks.

`ray.data._internal` and the `RAY_DATA_PARQUET_BIN_PACKING_BYTES` variable are not public
API. `check_ray_version` (called at import) compares the installed Ray with the pin in
pyproject.toml and says what to do when they differ.

Ray Data's own backpressure limits what an operator runs ahead in object-store bytes (a
share of the object store), and prompts are small: the whole OUT/prompts is read,
repartitioned into engine batches and queued in front of the engine long before the
engine gets to it. Blocks under 100 KiB (Ray's `max_direct_call_object_size`; a batch of
16 prompts is a few KiB) are not in the object store but inlined into the task's reply and
kept in the driver's heap (its core worker's in-process store), with the driver's
bookkeeping of each queued block (its `RefBundle`, metadata, schema). So the driver's
memory grew with the number of engine batches of the whole run (docs/performance.md,
section 4). Here an operator starts no new task while `max_blocks` blocks wait between it
and the operator after it (or the driver, for the last one); and the prompts are read in
tasks of about one shard, since a running task's output is not held back. That bounds
the queued blocks by the engine's in-flight size plus a few read tasks, not the dataset.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import weakref

import numpy as np
import pyarrow.fs as pafs
import ray

from eagle_data.errors import EagleDataError

log = logging.getLogger("eagle_data")

PINNED_RAY = "2.60.0"  # = pyproject.toml's ray pin


def check_ray_version(installed: str = ray.__version__) -> None:
    if installed != PINNED_RAY:
        log.warning("Ray %s is installed; eagle-data is built and tested on Ray %s, and %s uses "
                    "its internals (backpressure policies, the Parquet read-task size). Install "
                    "ray==%s, or check this module against the installed Ray.",
                    installed, PINNED_RAY, __name__, PINNED_RAY)


check_ray_version()
try:
    from ray.data._internal.execution.backpressure_policy import (
        ENABLED_BACKPRESSURE_POLICIES,
        ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY,
        BackpressurePolicy,
    )
except ImportError as e:
    raise EagleDataError(f"Ray {ray.__version__} lacks the backpressure-policy API of Ray {PINNED_RAY} "
                         f"({e}): install ray=={PINNED_RAY}") from None

ENGINE_ERROR = "__inference_error__"  # Ray's vLLM stage: a row's error text, "" on success
# The columns of Ray's vLLM stage output (vLLMOutputData's fields in Ray 2.60) with the
# values a failed row gets; the transformers backend emits the same (a test compares them).
VLLM_OUTPUT_DEFAULTS = {"prompt": "", "prompt_token_ids": None, "num_input_tokens": 0, "generated_tokens": [],
                        "generated_text": "", "num_generated_tokens": 0, "embeddings": None, "metrics": None,
                        "logprobs": None, "prompt_logprobs": None}
# And the bookkeeping columns it adds to every row besides them.
VLLM_STAGE_EXTRA_COLUMNS = ("request_id", "params", "time_taken_llm", "batch_uuid")

MAX_QUEUED_BLOCKS = "eagle_data.max_queued_blocks"
EXECUTIONS: list = []  # weak references to the QueuedBlocksCap of each execution, newest last
# Ray's Parquet reader packs files into read tasks of up to this many uncompressed bytes
# (default 128 MiB: a whole small OUT/prompts in one task); read when the dataset is made.
BIN_BYTES_ENV = "RAY_DATA_PARQUET_BIN_PACKING_BYTES"
READ_TASK_BYTES = 1 << 20


class QueuedBlocksCap(BackpressurePolicy):
    """No new task for an operator while `MAX_QUEUED_BLOCKS` of its output blocks wait.

    Running tasks are not paused (a paused task keeps its CPU, which the operators after
    it may need: a deadlock on a small node), so a read task's batches count in full:
    `read_parquet_in_small_tasks` keeps read tasks small."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        EXECUTIONS.append(weakref.ref(self))  # for engine_pool: this execution's operators

    def can_add_input(self, op) -> bool:
        limit = self._data_context.get_config(MAX_QUEUED_BLOCKS)
        if limit is None:
            return True
        queued = self._topology[op].total_enqueued_output_blocks() + sum(
            self._topology[after].total_enqueued_input_blocks() for after in op.output_dependencies)
        return queued < limit


def bound_queues(ds: ray.data.Dataset, max_blocks: int) -> None:
    """Cap the blocks queued between any two operators of `ds`'s execution at `max_blocks`."""
    ctx = ds.context
    ctx.set_config(MAX_QUEUED_BLOCKS, max_blocks)
    policies = ctx.get_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY, ENABLED_BACKPRESSURE_POLICIES)
    if QueuedBlocksCap not in policies:
        ctx.set_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY, [*policies, QueuedBlocksCap])


def read_parquet_in_small_tasks(files: list[str], fs: pafs.FileSystem, columns: list[str]) -> ray.data.Dataset:
    """`read_parquet` in read tasks of about one prompts shard (READ_TASK_BYTES) each."""
    before = os.environ.get(BIN_BYTES_ENV)
    os.environ[BIN_BYTES_ENV] = str(READ_TASK_BYTES)
    try:
        return ray.data.read_parquet(files, filesystem=fs).select_columns(columns)
    finally:
        if before is None:
            del os.environ[BIN_BYTES_ENV]
        else:
            os.environ[BIN_BYTES_ENV] = before


def actor_nodes(class_names: tuple[str, ...]) -> list[str] | None:
    """The node ids of this job's Ray Data actors running one of `class_names` (alive or
    ended; a restarted actor on its latest node); None where Ray's state API cannot answer."""
    actors = job_actors(class_names)
    return None if actors is None else sorted({a.node_id for a in actors if a.node_id})


def job_actors(class_names: tuple[str, ...]) -> list | None:
    """This job's Ray Data actors running one of `class_names`, from Ray's state API; None
    where it cannot answer (no dashboard, e.g. a local `ray.init(include_dashboard=False)`).
    Ray Data names its actors after the operator: class `MapWorker(MapBatches(TransformersEngine))`."""
    context = ray.get_runtime_context()
    try:
        from ray.util.state import list_actors

        actors = list_actors(address=context.gcs_address, filters=[("job_id", "=", context.get_job_id())],
                             limit=10_000, raise_on_missing_output=False, timeout=10)
        # Without a dashboard the state API falls back to 127.0.0.1:8265, which may be
        # another cluster's: keep only nodes of this one.
        ours = {node["NodeID"] for node in ray.nodes()}
    except Exception as e:  # the state API is best effort: a missing record, not a failed run
        log.debug("Ray's state API did not answer: %s", e)
        return None
    return [a for a in actors if a.node_id in ours and any(f"({name})" in (a.class_name or "") for name in class_names)]


# Lines the engine's processes print at a clean exit that are not errors: vLLM's worker
# attaches shared memory without registering it with Python's resource tracker, and at exit
# the tracker prints a KeyError traceback per name (and the worker a warning) although
# nothing failed. Dropped from the driver's copy of the workers' output only.
HARMLESS_EXIT_NOISE = re.compile(
    r"resource_tracker: process died unexpectedly|warnings\.warn\('resource_tracker: process died")
TRACKER_TRACEBACK = re.compile(r"multiprocessing/resource_tracker\.py|cache\[rtype\]\.remove\(name\)|"
                               r"^KeyError: '/(psm_|mp-)")


# vLLM 0.29's exit path can stop the engine process before it cancels the task reading its
# outputs (vllm_stage_udf cancels it first where it gets the chance); that task then logs
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


def quiet_worker_logs() -> None:
    """Print the workers' output in the driver (the job log) without HARMLESS_EXIT_NOISE."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printer = next((h for name, h in dispatcher.handlers if name == "ray_print_logs"), None)
    if printer is None or getattr(printer, "eagle_quiet", False):
        return

    def print_quietly(data):
        lines = drop_harmless_exit_noise(data.get("lines", []))
        if lines:
            printer({**data, "lines": lines})

    print_quietly.eagle_quiet = True
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", print_quietly)


def wait_for_actors_to_exit(class_names: tuple[str, ...], timeout_s: float = 60) -> None:
    """Until no actor of this job running one of `class_names` is alive (engine replicas shut
    down and their output printed before the job's summary); at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        actors = job_actors(class_names)
        if actors is None or all(a.state == "DEAD" for a in actors):
            return
        time.sleep(0.5)


def ray_data_progress(on: bool) -> None:
    """Ray Data's own progress output on or off, without its warning that it is off."""
    from ray.util.debug import log_once

    ray.data.DataContext.get_current().enable_progress_bars = on
    if not on:
        log_once("ray_data_progress_manager_disabled")  # marks Ray's one-time warning as said


def engine_pool(class_names: tuple[str, ...]) -> dict | None:
    """The engine operator of the newest running execution, from Ray Data's own operator
    state: replicas running / starting (loading the model) / restarting, and the rows handed
    to replicas and not yet back. None before the engine operator exists."""
    for ref in reversed(EXECUTIONS):
        policy = ref()
        if policy is None:
            continue
        for op in policy._topology:
            if any(f"({name})" in op.name for name in class_names) and hasattr(op, "get_actor_info"):
                info, metrics = op.get_actor_info(), op.metrics
                return {"running": info.running, "starting": info.pending, "restarting": info.restarting,
                        "rows_in_engine": metrics.rows_inputs_of_submitted_tasks - metrics.rows_task_outputs_generated}
    return None


ENGINE_STATS_NAMESPACE = "eagle_data_engine_stats"


def publish_engine_stats(stats: dict) -> None:
    """From an engine replica: its latest counters, for the driver's progress line."""
    from ray.experimental import internal_kv

    context = ray.get_runtime_context()
    key = f"{context.get_job_id()}/{context.get_actor_id()}"
    internal_kv._internal_kv_put(key, json.dumps(stats), overwrite=True, namespace=ENGINE_STATS_NAMESPACE)


def engine_stats() -> list[dict]:
    """The counters every engine replica of this job published (publish_engine_stats)."""
    from ray.experimental import internal_kv

    prefix = f"{ray.get_runtime_context().get_job_id()}/"
    try:
        keys = internal_kv._internal_kv_list(prefix, namespace=ENGINE_STATS_NAMESPACE)
        values = [internal_kv._internal_kv_get(k, namespace=ENGINE_STATS_NAMESPACE) for k in keys]
    except Exception as e:  # best effort: a progress line without engine counters
        log.debug("engine stats unavailable: %s", e)
        return []
    return [json.loads(v) for v in values if v]


# Ray's vLLM stage (ray.data.llm, Ray 2.60) and the vLLM it pins (0.29).

def vllm_stage_udf():
    """Ray's vLLM stage UDF with compact log-probabilities and a shutdown that prints nothing
    when all went well.

    Log-probabilities (a request with `logprobs` = k): Ray's `vLLMOutputData` turns vLLM's
    per-token `{id: Logprob}` dicts into per-token dicts of dicts (`_convert_logprob_dict`,
    then pydantic validation and `model_dump`), and Arrow cannot hold dicts with int keys, so
    Ray Data pickles the whole row. Measured per generated token between the engine and
    data/ (docs/performance.md, section 8), that way adds 42 / 115 / 377 us at k = 1 / 5 /
    20, most of it in the replica's own event loop, and this one 2.1 / 3.5 / 7.2 us (20-53x
    less; most of what is left is vLLM filling its container), so `generate_async` here is
    Ray's (`vLLMEngineWrapper.generate_async`: the same request, semaphore and timing) except
    that it asks vLLM for its flat container (`flat_logprobs`: a few lists per request, no
    object per token), takes the k ids, log-probabilities and the sampled token's own out of
    it as arrays (`flat_logprob_values`) and leaves Ray's `logprobs` field None.

    vLLM 0.29's `AsyncLLM.shutdown` stops the engine process before it cancels the task that
    reads the engine's outputs, and that task logs an `EngineDeadError` traceback; here it is
    cancelled first. And the actor waits for vLLM's processes to exit before it does: Ray
    kills an exiting actor's children, the multiprocessing resource tracker among them,
    and a vLLM worker still cleaning up then relaunches the tracker, which prints
    `KeyError` tracebacks for shared memory it never saw."""
    import atexit
    import multiprocessing.resource_tracker

    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

    class VLLMEngine(vLLMEngineStageUDF):
        def __init__(self, *args, **kwargs):
            multiprocessing.resource_tracker.ensure_running()
            super().__init__(*args, **kwargs)
            self.llm.generate_async = self.generate_async  # called by Ray's _generate_with_error_handling
            self.stats = EngineStats.attach(self.llm.engine)
            self.shut = False
            # At the actor's exit vLLM's own exit hook (a weakref finalizer) may stop the
            # engine before `__del__` runs; atexit runs hooks last-registered first, so
            # this one comes before vLLM's.
            atexit.register(self.shut_down)

        async def generate_async(self, row: dict) -> tuple:
            from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMOutputData

            wrapper = self.llm
            k = (row.get("sampling_params") or {}).get("logprobs") or 0
            if k:
                row["sampling_params"] = {**row["sampling_params"], "flat_logprobs": True}
            request = await wrapper._prepare_llm_request(row)
            started = time.perf_counter()
            async with wrapper.semaphore:
                output = await wrapper._generate_async(request)
            took = time.perf_counter() - started
            extra = {}
            if k:
                extra = flat_logprob_values(output.outputs[0], k)
                output.outputs[0].logprobs = None  # Ray's per-token dicts are never built
            return request, {**vLLMOutputData.from_vllm_engine_output(output).model_dump(), **extra}, took

        def shut_down(self) -> None:
            if getattr(self, "shut", True):
                return
            self.shut = True
            engine_processes = descendants(os.getpid()) - {multiprocessing.resource_tracker._resource_tracker._pid}
            stop_output_handler(self.llm.engine)
            self.llm.shutdown()
            wait_for_exit(engine_processes)

        def __del__(self):
            self.shut_down()

    return VLLMEngine


def flat_logprob_values(completion, k: int) -> dict:
    """A vLLM 0.29 completion's log-probability columns (engines/__init__.py). Its
    FlatLogprobs holds, per generated token, the sampled token's entry first and then the
    top k with ranks 1..k (vllm/logprobs.py `append_logprobs_for_next_position`), always
    k + 1 entries: the top k are entries 1..k, by rank, and the sampled token's own
    log-probability is entry 0."""
    from eagle_data.job.stages.engines import logprob_values

    flat, n = completion.logprobs, len(completion.token_ids)
    ids = np.asarray(flat.token_ids, np.int32)
    if len(flat) != n or ids.size != n * (k + 1):
        raise RuntimeError(f"vLLM returned {ids.size} log-probabilities over {len(flat)} positions for {n} "
                           f"generated tokens, not {k} + 1 per token: is this vLLM 0.29?")
    ids = ids.reshape(n, k + 1)
    values = np.asarray(flat.logprobs, np.float32).reshape(n, k + 1)
    ranks = np.asarray(flat.ranks, np.int64).reshape(n, k + 1)[:, 1:]
    if n and not ((ranks == np.arange(1, k + 1)).all() and (ids[:, 0] == np.asarray(completion.token_ids)).all()):
        raise RuntimeError("vLLM's flat log-probabilities are not laid out as in vLLM 0.29 "
                           "(the sampled token, then the top k by rank)")
    return logprob_values(ids[:, 1:], values[:, 1:], values[:, 0])


class EngineStats:
    """A vLLM stat logger that keeps the engine's own counters (generated tokens, requests
    running and waiting) and publishes them every few seconds for the driver's progress line."""

    PUBLISH_EVERY_S = 2

    def __init__(self):
        self.generated_tokens = self.running = self.waiting = 0

    @classmethod
    def attach(cls, engine) -> "EngineStats | None":
        import threading

        manager = getattr(engine, "logger_manager", None)  # None with disable_log_stats
        if manager is None:
            return None
        stats = cls()
        manager.stat_loggers.append(stats)
        threading.Thread(target=stats._publish, daemon=True, name="eagle-engine-stats").start()
        return stats

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is not None:
            self.generated_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.running, self.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args) -> None:
        pass

    def _publish(self) -> None:
        while True:
            try:
                publish_engine_stats({"generated_tokens": self.generated_tokens, "running": self.running,
                                      "waiting": self.waiting, "time": time.time()})
            except Exception as e:  # best effort: the progress line goes without it
                log.debug("engine stats not published: %s", e)
            time.sleep(self.PUBLISH_EVERY_S)


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


def wait_for_exit(pids: set[int], timeout_s: float = 15) -> None:
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_output_handler(engine, timeout_s: float = 5) -> None:
    """Cancel AsyncLLM's output-reading task and wait until it has stopped."""
    import asyncio

    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done():
        return
    loop = handler.get_loop()
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop or not loop.is_running():
        handler.cancel()  # takes effect before the task runs again
        return
    loop.call_soon_threadsafe(handler.cancel)
    deadline = time.monotonic() + timeout_s
    while not handler.done() and time.monotonic() < deadline:
        time.sleep(0.01)


def one_batch_per_block(ds: ray.data.Dataset, rows: int) -> ray.data.Dataset:
    """Blocks of `rows` rows: one engine batch per block, so one per engine task, whose
    output reaches the driver (and a shard) when the task ends. Strict: the non-strict
    repartition is fused into the read task and leaves its block whole (every row then
    reaches data/ at the end). It also spares Ray 2.60's vLLM stage a task mixing an
    all-failed batch with an answered one, which fails (`_backfill_missing_fields`)."""
    return ds.repartition(target_num_rows_per_block=rows, strict=True)


def read_unshaped(datasource_type: type) -> None:
    """Reads of `datasource_type` hand on each block their read function yields as it
    comes. Ray Data's read task buffers them into blocks of `target_max_block_size` (128
    MiB) and hands them on only then, or at the task's end; job/stages/feed.py's one read
    task lasts the whole run, and a turn depth's last prompt block must not wait for the
    next depth, which waits for that block's answers. Planning runs in the driver: once there."""
    from ray.data._internal.logical.operators.read_operator import Read
    from ray.data._internal.output_buffer import OutputBlockSizeOption
    from ray.data._internal.planner.planner import Planner

    plan_read = Planner._DEFAULT_PLAN_FNS[Read]
    if getattr(plan_read, "unshaped", None) is datasource_type:
        return

    def plan(op, physical_children, data_context):
        physical = plan_read(op, physical_children, data_context)
        if isinstance(op.datasource, datasource_type):
            for fn in physical._map_transformer._transform_fns:
                fn._output_block_size_option = OutputBlockSizeOption.of(disable_block_shaping=True)
        return physical

    plan.unshaped = datasource_type
    Planner._DEFAULT_PLAN_FNS[Read] = plan
